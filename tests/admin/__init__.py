"""The admin: personas, log, analytics, metrics, import and export, retention."""
