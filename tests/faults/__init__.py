"""Faults: the database, Redis and upstream failing, and the reliability table."""
