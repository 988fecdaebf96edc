"""Everything that talks to a model. No Django views in here."""
