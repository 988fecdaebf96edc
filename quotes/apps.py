from __future__ import annotations

from django.apps import AppConfig


class QuotesConfig(AppConfig):
    name = "quotes"
    verbose_name = "Persona Quotes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Connects the signals that keep each process's personas in step with the database, and
        # registers the system checks of the models personas and settings name.
        from . import checks, personas  # noqa: F401
