"""`python manage.py quote <persona-slug> [--topic T]`: stream a quote to the terminal."""

from __future__ import annotations

import asyncio
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from streaming import Error, Meta, Token

from quotes import personas, streams
from quotes.backends import reset_backends
from quotes.clients import Client
from quotes.errors import ErrorCode, QuoteError
from quotes.models import Persona
from quotes.rows import writer


class Command(BaseCommand):
    help = "Stream a persona's quote to stdout as it is written (logged like any request)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("persona", help="the persona's slug, e.g. alan-watts")
        parser.add_argument("--topic", default=None, help="what the quote is about (default: the persona's)")

    def handle(self, *args: Any, **options: Any) -> None:
        asyncio.run(self._run(options["persona"], options["topic"]))

    async def _run(self, slug: str, topic: str | None) -> None:
        try:
            params = {"persona": slug, "topic": topic}
            stream = await streams.begin(Client("cli"), transport="cli", params=params)
            model = ""
            async for event in stream.read():
                if type(event) is Meta:
                    model = event.model or model
                elif type(event) is Token:
                    self.stdout.write(event.text, ending="")
                    self.stdout.flush()
                elif type(event) is Error:
                    raise CommandError(f"{event.message} ({event.code})")
            active = personas.peek(slug)
            self.stdout.write(f"\n  — {model} as {active.persona.name if active else slug}")
        except QuoteError as exc:
            if exc.code == ErrorCode.UNKNOWN_PERSONA:
                slugs = ", ".join([p.slug async for p in Persona.objects.active()])
                raise CommandError(f"No active persona {slug!r}; try one of: {slugs}") from None
            raise CommandError(f"{exc.message} ({exc.code})") from None
        finally:
            await writer().flush(10.0)
            await reset_backends()
