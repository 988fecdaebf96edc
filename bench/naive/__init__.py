"""The baseline every stream-path goal is measured against: the cheapest streaming proxy this
stack can be (see views.py)."""
