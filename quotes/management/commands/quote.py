"""`python manage.py quote <persona-slug> [--topic T]`: stream a quote to the terminal."""

from __future__ import annotations

import asyncio
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from quotes.ai.backends import reset_backends
from quotes.ai.events import Error, Meta, Token
from quotes.ai.gateway.generation import stream_generation
from quotes.models import Persona


class Command(BaseCommand):
    help = "Stream a persona's quote to stdout as it is written (and log it like any request)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("persona", help="the persona's slug, e.g. alan-watts")
        parser.add_argument("--topic", default=None, help="what the quote is about (default: the persona's)")

    def handle(self, *args: Any, **options: Any) -> None:
        asyncio.run(self._run(options["persona"], options["topic"]))

    async def _run(self, slug: str, topic: str | None) -> None:
        try:
            await self._stream(slug, topic)
        finally:
            await reset_backends()

    async def _stream(self, slug: str, topic: str | None) -> None:
        try:
            persona = await Persona.objects.active().aget(slug=slug)
        except Persona.DoesNotExist:
            slugs = ", ".join([p.slug async for p in Persona.objects.active()])
            raise CommandError(f"No active persona {slug!r}. Try one of: {slugs}") from None
        model = ""
        events = stream_generation(persona=persona, topic=topic or persona.default_topic, transport="cli")
        async for event in events:
            if type(event) is Meta:
                model = event.model or model
            elif type(event) is Token:
                self.stdout.write(event.text, ending="")
                self.stdout.flush()
            elif type(event) is Error:
                raise CommandError(f"{event.message} ({event.code})")
        self.stdout.write(f"\n  — {model} as {persona.name}")
