"""`python manage.py export_personas [--output FILE]`: every persona as a JSON list (stdout by default)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.serializers.json import DjangoJSONEncoder

from quotes.models import Persona


def persona_fields() -> list[str]:
    """The fields a file carries, in the model's order: everything but the database id."""
    return [f.name for f in Persona._meta.concrete_fields if not f.primary_key]


class Command(BaseCommand):
    help = "Write every persona as JSON (a list of objects, one per persona, keyed by slug on import)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--output", "-o", help="write to this file instead of stdout")

    def handle(self, *args: Any, **options: Any) -> None:
        fields = persona_fields()
        personas = Persona.objects.order_by("display_order", "name", "slug")
        data = [{name: getattr(persona, name) for name in fields} for persona in personas]
        # A decimal (a daily spend ceiling) as its exact text.
        text = json.dumps(data, cls=DjangoJSONEncoder, indent=2, ensure_ascii=False) + "\n"
        output = options["output"]
        if not output:
            self.stdout.write(text, ending="")
            return
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"Cannot write {output}: {exc.strerror}") from None
        self.stdout.write(f"Exported {len(data)} personas to {output}.")
