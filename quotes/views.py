"""Thin views: parse input, call the gateway, turn its events into a response.

This module is the only place that turns events into bytes for HTTP.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from django.conf import settings
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from .ai import sse
from .ai.backends import get_backend
from .ai.catalog import doc_url
from .ai.conversation import check_context_window, parse_messages
from .ai.errors import QuoteError, internal
from .ai.events import Done, Error, Event, Meta, Ping, Token, Usage
from .ai.gateway import Client, stream_generation
from .models import Persona

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def index(request: HttpRequest) -> HttpResponse:
    personas = [persona async for persona in Persona.objects.active()]
    return render(request, "quotes/index.html", {"personas": personas})


async def persona_page(request: HttpRequest, slug: str) -> HttpResponse:
    try:
        persona = await Persona.objects.active().aget(slug=slug)
    except Persona.DoesNotExist:
        raise Http404("No such persona.") from None
    model = get_backend().model_name(persona.model)
    return render(
        request,
        "quotes/persona.html",
        {
            "persona": persona,
            "model_name": model,
            "model_url": doc_url(model),
            "max_topic_chars": settings.QUOTES_MAX_TOPIC_CHARS,
            "stream_url": "/api/quotes/stream",
        },
    )


def error_response(error: QuoteError | Error, headers: dict[str, str] | None = None) -> JsonResponse:
    headers = dict(headers or {})
    retry_after = getattr(error, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JsonResponse(
        {"error": {"code": error.code, "message": error.message}}, status=error.status, headers=headers
    )


async def client_of(request: HttpRequest) -> Client:
    user = await request.auser()
    return Client.from_request(
        request.META.get("REMOTE_ADDR") or "", user.pk if user.is_authenticated else None
    )


@csrf_exempt  # the JSON API requires Content-Type: application/json instead, which needs CORS cross-site
async def stream_quote(request: HttpRequest) -> HttpResponseBase:
    """POST a JSON body, or GET with query parameters (for EventSource); answer an SSE stream."""
    try:
        params = _read_params(request)
        persona = await _find_persona(params.get("persona"))
        topic = _clean_topic(params.get("topic"), default=persona.default_topic)
        messages = parse_messages(params.get("messages"))
        check_context_window(
            persona.build_request(topic=topic, messages=messages),
            model=get_backend().model_name(persona.model),
        )
    except QuoteError as exc:
        headers = {"Allow": "GET, POST"} if exc.status == 405 else None
        return error_response(exc, headers)
    events = stream_generation(
        persona=persona,
        topic=topic,
        messages=messages,
        client=await client_of(request),
        bypass_cache=_truthy(params.get("fresh")),
    )
    return await _stream_response(events)


def _truthy(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("1", "true", "yes"))


def _read_params(request: HttpRequest) -> dict[str, Any]:
    if request.method == "GET":
        return request.GET.dict()
    if request.method != "POST":
        raise QuoteError("method_not_allowed", "Use POST with a JSON body, or GET for EventSource.", 405)
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise QuoteError(
            "unsupported_media_type", "Send the body as JSON with Content-Type: application/json.", 415
        )
    length = int(request.headers.get("Content-Length") or 0)
    if length > settings.QUOTES_MAX_BODY_BYTES:
        raise QuoteError("body_too_large", f"The body is over {settings.QUOTES_MAX_BODY_BYTES} bytes.", 413)
    try:
        params = json.loads(request.body)
    except ValueError:
        raise QuoteError("invalid_json", "The body is not valid JSON (UTF-8).", 400) from None
    if not isinstance(params, dict):
        raise QuoteError("invalid_json", "The body must be a JSON object.", 400)
    return params


async def _find_persona(slug: object) -> Persona:
    if slug is None or slug == "":
        raise QuoteError("missing_persona", "Say which persona should speak: the `persona` field.", 400)
    if not isinstance(slug, str):
        raise QuoteError("invalid_persona", "`persona` must be a string (a persona's slug).", 400)
    try:
        return await Persona.objects.active().aget(slug=slug)
    except Persona.DoesNotExist:
        raise QuoteError("unknown_persona", f"There is no persona called {slug[:100]!r}.", 404) from None


def _clean_topic(topic: object, *, default: str) -> str:
    if topic is None:
        return default
    if not isinstance(topic, str):
        raise QuoteError("invalid_topic", "`topic` must be a string.", 400)
    topic = " ".join(topic.split())
    if len(topic) > settings.QUOTES_MAX_TOPIC_CHARS:
        raise QuoteError(
            "topic_too_long",
            f"The topic is too long: keep it under {settings.QUOTES_MAX_TOPIC_CHARS} characters.",
            400,
        )
    return topic or default


async def _stream_response(events: AsyncGenerator[Event, None]) -> HttpResponseBase:
    """Wait for the first token (or an error) before answering, so an error that happens before
    any text gets its real HTTP status; after that, stream."""
    meta = Meta()
    try:
        first = await anext(events)
        # Keep-alive pings before the first token are dropped: the headers are not sent yet, and
        # the status and model headers must stay truthful (the first-token timeout bounds this wait).
        while type(first) is Meta or type(first) is Ping:
            if type(first) is Meta:
                meta = meta.merged(first)
            first = await anext(events)
    except StopAsyncIteration:
        first = internal()
    headers = meta.response_headers()
    if meta.model:
        headers["X-Quote-Model"] = meta.model
        headers["X-Quote-Model-Url"] = doc_url(meta.model)
    if meta.generation_id:
        headers["X-Quote-Id"] = meta.generation_id
    if type(first) is Error:
        await events.aclose()
        # The gateway headers (cf-aig-log-id above all) matter most when something failed.
        return error_response(first, headers)
    return StreamingHttpResponse(
        _sse_body(first, events), content_type="text/event-stream", headers={**SSE_HEADERS, **headers}
    )


async def _sse_body(first: Event, events: AsyncGenerator[Event, None]) -> AsyncGenerator[bytes, None]:
    async with aclosing(events):
        event: Event = first
        while True:
            if type(event) is Token:
                yield sse.token(event.text)
            elif type(event) is Usage:
                yield sse.usage(event)
            elif type(event) is Done:
                yield sse.DONE
                return
            elif type(event) is Ping:
                yield sse.PING
            elif type(event) is Error:
                # After the first byte the status is sent: end with an error event and no [DONE].
                yield sse.error(event.code, event.message)
                return
            event = await anext(events, None) or internal()
