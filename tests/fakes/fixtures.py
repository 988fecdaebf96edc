"""Fixtures for the fake Workers AI upstream (registered from tests/conftest.py)."""
