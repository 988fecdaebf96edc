"""A request for a quote, checked the same way whatever carries it (the JSON API, the page's
form, the WebSocket): its input, its events, its resume, and the count of refused ones."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from . import personas
from .ai.backends import backend_for
from .ai.conversation import check_context_window, clean_topic, parse_messages
from .ai.errors import ErrorCode, QuoteError
from .ai.events import Error, Event, Message
from .ai.gateway import admission
from .ai.gateway.generation import Client, stream_generation
from .ai.gateway.runs import Resumed, parse_event_id, resume
from .models import Persona, PersonaVersion
from .security import RateLimited


@dataclass(frozen=True, slots=True)
class QuoteInput:
    persona: Persona
    version: PersonaVersion | None
    topic: str
    messages: tuple[Message, ...]
    fresh: bool


_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,100}")


async def parse_quote_request(params: dict[str, Any]) -> QuoteInput:
    """`params` checked, or the QuoteError (400/404) that says what is wrong."""
    slug = params.get("persona")
    if slug is None or slug == "":
        message = "Say which persona should speak: the `persona` field."
        raise QuoteError(ErrorCode.MISSING_PERSONA, message, 400)
    if not isinstance(slug, str):
        raise QuoteError(ErrorCode.INVALID_PERSONA, "`persona` must be a string (a persona's slug).", 400)
    # Not a slug: never a persona, and PostgreSQL refuses some bytes (NUL) outright.
    if not _SLUG.fullmatch(slug) or (active := await personas.get_active(slug)) is None:
        raise QuoteError(ErrorCode.UNKNOWN_PERSONA, f"There is no persona called {slug[:100]!r}.", 404)
    persona = active.persona
    topic = clean_topic(params.get("topic"), default=persona.default_topic)
    messages = parse_messages(params.get("messages"))
    check_context_window(
        persona.build_request(topic=topic, messages=messages),
        model=backend_for(persona).model_name(persona.model),
    )
    fresh = params.get("fresh")
    fresh = fresh is True or (isinstance(fresh, str) and fresh.lower() in ("1", "true", "yes"))
    return QuoteInput(persona, active.version, topic, messages, fresh)


def events_for(
    quote: QuoteInput, client: Client, transport: str, admitted: admission.Entry | Error | None = None
) -> AsyncGenerator[Event, None]:
    return stream_generation(
        persona=quote.persona,
        version=quote.version,
        topic=quote.topic,
        messages=quote.messages,
        client=client,
        bypass_cache=quote.fresh,
        transport=transport,
        admitted=admitted,
    )


async def resume_quote(
    last_event_id: object, client: Client, admitted: admission.Entry | Error | None = None
) -> Resumed | Error:
    """The generation's events after `last_event_id`, or the admission's refusal; a QuoteError
    for an id this site never sent, or one it keeps no longer."""
    parsed = parse_event_id(last_event_id)
    if parsed is None:
        message = "`last_event_id` must be an event id this site sent: <generation id>.<key>:<number>."
        raise QuoteError(ErrorCode.INVALID_LAST_EVENT_ID, message, 400)
    public_id, key, after = parsed
    resumed = await resume(public_id, key, after, client_key=client.key, admitted=admitted)
    if resumed is None:
        message = "This quote cannot be resumed here (unknown, or kept no longer). Ask for a new one."
        raise QuoteError(ErrorCode.RESUME_UNAVAILABLE, message, 404)
    return resumed


async def count_refused(client: Client) -> RateLimited | None:
    """Count a quote request refused before admission (invalid, its socket busy...) against the
    client's and its network's limits: the 429 to answer instead of its own error once over."""
    refused = await admission.count(client.key, settings.QUOTES_GATEWAY, network_key=client.network_key)
    return None if refused is None else RateLimited(refused.message, refused.retry_after or 1)
