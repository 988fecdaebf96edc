from __future__ import annotations

import logging

from django.apps import AppConfig
from django.conf import settings

logger = logging.getLogger(__name__)


class QuotesConfig(AppConfig):
    name = "quotes"
    verbose_name = "Persona Quotes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Connects the signals that keep the process-local persona cache in step with the database.
        from . import forks, personas  # noqa: F401

        # Before any handler loads its middleware; registers forks' system checks too.
        forks.inline_middleware()

        for name, replacement in settings.RETIRED_VARIABLES.items():
            logger.warning("%s is set but no longer does anything: %s bound that wait.", name, replacement)
