"""Thin views: parse input, call the gateway, turn its events into a response.

This module is the only place that turns events into bytes for HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.middleware import csrf
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from .ai import sse
from .ai.backends import get_backend
from .ai.catalog import doc_url
from .ai.conversation import check_context_window, check_encodable, parse_messages
from .ai.errors import QuoteError, internal
from .ai.events import Done, Error, Event, Message, Meta, Ping, Token, Usage
from .ai.gateway import Client, stream_generation
from .feedback import count_vote, record_vote
from .models import Generation, Persona
from .security import refuse_cross_site

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
            "max_message_chars": settings.QUOTES_MAX_MESSAGE_CHARS,
            "stream_url": reverse("quotes:stream"),
            # htmx drives the page; ?transport=fetch runs the same page on the fetch client
            # (static/js/quote-stream.js), which the browser tests use to prove that path too.
            "transport": "fetch" if request.GET.get("transport") == "fetch" else "htmx",
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


@dataclass(frozen=True, slots=True)
class QuoteInput:
    """A checked request for one quote, whatever the transport (HTTP, htmx, WebSocket)."""

    persona: Persona
    topic: str
    messages: tuple[Message, ...]
    fresh: bool


async def parse_quote_request(params: dict[str, Any]) -> QuoteInput:
    """Check `persona`, `topic`, `messages` and `fresh` the same way for every transport, or
    raise the QuoteError (400/404) that says what is wrong."""
    persona = await _find_persona(params.get("persona"))
    topic = _clean_topic(params.get("topic"), default=persona.default_topic)
    messages = parse_messages(params.get("messages"))
    check_context_window(
        persona.build_request(topic=topic, messages=messages),
        model=get_backend().model_name(persona.model),
    )
    return QuoteInput(persona=persona, topic=topic, messages=messages, fresh=_truthy(params.get("fresh")))


@csrf_exempt  # the JSON API requires Content-Type: application/json instead, which needs CORS cross-site
async def stream_quote(request: HttpRequest) -> HttpResponseBase:
    """POST a JSON body, or GET with query parameters (for EventSource); answer an SSE stream.

    A request from htmx (`HX-Request: true`) gets the same stream as HTML-escaped text fragments
    plus named `meta`, `done` and `error` events (see `_htmx_body`), and may post the page's form
    (form-encoded, with its CSRF token, which is then checked here: the view itself is exempt).
    """
    htmx = request.headers.get("HX-Request") == "true"
    try:
        refuse_cross_site(request)  # another site's page must not start a (paid) generation
        params = _read_params(request, htmx=htmx)
        quote = await parse_quote_request(params)
    except QuoteError as exc:
        headers = {"Allow": "GET, POST"} if exc.status == 405 else None
        if htmx:
            return _htmx_error_response(exc.as_event(), Meta(), headers)
        return error_response(exc, headers)
    # EventSource always sends `Accept: text/event-stream`; a plain GET (curl) keeps the exact
    # Workers AI wire format.
    eventsource = request.method == "GET" and "text/event-stream" in request.headers.get("Accept", "")
    events = stream_generation(
        persona=quote.persona,
        topic=quote.topic,
        messages=quote.messages,
        client=await client_of(request),
        bypass_cache=quote.fresh,
        transport="htmx" if htmx else "eventsource" if eventsource else "api",
    )
    if htmx:
        return await _htmx_stream_response(events)
    return await _stream_response(events, eventsource=eventsource)


def _truthy(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("1", "true", "yes"))


FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def _read_params(request: HttpRequest, *, htmx: bool = False) -> dict[str, Any]:
    if request.method == "GET":
        return request.GET.dict()
    if request.method != "POST":
        raise QuoteError("method_not_allowed", "Use POST with a JSON body, or GET for EventSource.", 405)
    content_type = request.content_type or ""
    too_large = QuoteError("body_too_large", f"The body is over {settings.QUOTES_MAX_BODY_BYTES} bytes.", 413)
    if int(request.headers.get("Content-Length") or 0) > settings.QUOTES_MAX_BODY_BYTES:
        raise too_large
    try:
        # A chunked body has no Content-Length: measure what arrived.
        if len(request.body) > settings.QUOTES_MAX_BODY_BYTES:
            raise too_large
    except RequestDataTooBig:
        raise too_large from None
    if htmx and content_type in FORM_TYPES:
        return _read_form(request)
    if content_type != "application/json":
        raise QuoteError(
            "unsupported_media_type", "Send the body as JSON with Content-Type: application/json.", 415
        )
    try:
        params = json.loads(request.body)
    except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
        raise QuoteError("invalid_json", "The body is not valid JSON (UTF-8).", 400) from None
    if not isinstance(params, dict):
        raise QuoteError("invalid_json", "The body must be a JSON object.", 400)
    return params


class _CsrfCheck(csrf.CsrfViewMiddleware):
    """Django's own CSRF check, run on demand: it answers the reason instead of a 403 page."""

    def _reject(self, request: HttpRequest, reason: str) -> HttpResponse:
        self.reason = reason
        return HttpResponse(status=403)


def _read_form(request: HttpRequest) -> dict[str, Any]:
    """The persona page's form, posted by htmx. A form can be posted cross-site, so unlike the
    JSON body it must carry a valid CSRF token (and pass Django's Origin/Referer checks)."""
    check = _CsrfCheck(lambda _: HttpResponse())
    if check.process_view(request, lambda _: HttpResponse(), (), {}) is not None:
        raise QuoteError("csrf_failed", "This page has expired. Reload it, then ask again.", 403)
    params: dict[str, Any] = request.POST.dict()
    params.pop("csrfmiddlewaretoken", None)
    if not params.get("topic"):
        params.pop("topic", None)
    raw = params.pop("messages", "")
    if raw:
        try:
            params["messages"] = json.loads(raw)
        except (ValueError, RecursionError):
            raise QuoteError("invalid_messages", "`messages` must be a JSON list of turns.", 400) from None
    return params


_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,100}")


async def _find_persona(slug: object) -> Persona:
    if slug is None or slug == "":
        raise QuoteError("missing_persona", "Say which persona should speak: the `persona` field.", 400)
    if not isinstance(slug, str):
        raise QuoteError("invalid_persona", "`persona` must be a string (a persona's slug).", 400)
    if not _SLUG.fullmatch(slug):  # never a persona, and PostgreSQL refuses some bytes (NUL) outright
        raise QuoteError("unknown_persona", f"There is no persona called {slug[:100]!r}.", 404)
    try:
        return await Persona.objects.active().aget(slug=slug)
    except Persona.DoesNotExist:
        raise QuoteError("unknown_persona", f"There is no persona called {slug[:100]!r}.", 404) from None


def _clean_topic(topic: object, *, default: str) -> str:
    if topic is None:
        return default
    if not isinstance(topic, str):
        raise QuoteError("invalid_topic", "`topic` must be a string.", 400)
    check_encodable(topic, field="`topic`")
    # Control characters (NUL above all, which PostgreSQL cannot store) go; spaces collapse.
    topic = " ".join("".join(ch for ch in topic if ch.isprintable() or ch.isspace()).split())
    if len(topic) > settings.QUOTES_MAX_TOPIC_CHARS:
        raise QuoteError(
            "topic_too_long",
            f"The topic is too long: keep it under {settings.QUOTES_MAX_TOPIC_CHARS} characters.",
            400,
        )
    return topic or default


async def _prefetch(events: AsyncGenerator[Event, None]) -> tuple[Meta, Event]:
    """Everything up to the first token (or error): the merged Meta, and that first event."""
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
    return meta, first


def _meta_headers(meta: Meta) -> dict[str, str]:
    headers = meta.response_headers()
    if meta.model:
        headers["X-Quote-Model"] = meta.model
        headers["X-Quote-Model-Url"] = doc_url(meta.model)
    if meta.generation_id:
        headers["X-Quote-Id"] = meta.generation_id
    return headers


def permalink_of(generation_id: str | None) -> str | None:
    return reverse("quotes:permalink", args=[generation_id]) if generation_id else None


async def _stream_response(
    events: AsyncGenerator[Event, None], *, eventsource: bool = False
) -> HttpResponseBase:
    """Wait for the first token (or an error) before answering, so an error that happens before
    any text gets its real HTTP status; after that, stream."""
    meta, first = await _prefetch(events)
    headers = _meta_headers(meta)
    if type(first) is Error:
        await events.aclose()
        # The gateway headers (cf-aig-log-id above all) matter most when something failed.
        return error_response(first, headers)
    return StreamingHttpResponse(
        _sse_body(first, events, meta=meta, eventsource=eventsource),
        content_type="text/event-stream",
        headers={**SSE_HEADERS, **headers},
    )


async def _sse_body(
    first: Event, events: AsyncGenerator[Event, None], *, meta: Meta, eventsource: bool
) -> AsyncGenerator[bytes, None]:
    async with aclosing(events):
        event: Event = first
        while True:
            if type(event) is Token:
                yield sse.token(event.text)
            elif type(event) is Usage:
                yield sse.usage(event)
            elif type(event) is Done:
                yield sse.DONE
                if eventsource:
                    # EventSource reconnects when a body ends, which would write a second quote:
                    # a named `done` tells the client to close() first.
                    yield sse.named(
                        "done", {"id": meta.generation_id, "permalink": permalink_of(meta.generation_id)}
                    )
                return
            elif type(event) is Ping:
                yield sse.PING
            elif type(event) is Error:
                # After the first byte the status is sent: end with an error event and no [DONE].
                yield sse.error(event.code, event.message)
                return
            elif type(event) is Meta:
                meta = meta.merged(event)
            event = await anext(events, None) or internal()


# --- htmx ---------------------------------------------------------------------------------


def meta_payload(meta: Meta) -> dict[str, Any]:
    headers = meta.response_headers()
    return {
        "model": meta.model,
        "model_url": doc_url(meta.model) if meta.model else "",
        "cache_status": headers.get("cf-aig-cache-status", "").upper(),
        "id": meta.generation_id,
        "permalink": permalink_of(meta.generation_id),
    }


def _error_payload(error: Error) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "retry_after": error.retry_after}


def _htmx_error_response(error: Error, meta: Meta, headers: dict[str, str] | None = None) -> HttpResponse:
    """An error before any text, for htmx: the real status, and the error as a named SSE event
    (hx-sse handles any text/event-stream response, whatever its status), so the page can
    show the message instead of swapping an error page into the quote."""
    headers = {**SSE_HEADERS, **(headers or {})}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    body = sse.named("meta", meta_payload(meta)) if meta.generation_id else b""
    body += sse.named("error", _error_payload(error))
    return HttpResponse(body, status=error.status, content_type="text/event-stream", headers=headers)


async def _htmx_stream_response(events: AsyncGenerator[Event, None]) -> HttpResponseBase:
    meta, first = await _prefetch(events)
    headers = _meta_headers(meta)
    if type(first) is Error:
        await events.aclose()
        return _htmx_error_response(first, meta, headers)
    return StreamingHttpResponse(
        _htmx_body(meta, first, events),
        content_type="text/event-stream",
        headers={**SSE_HEADERS, **headers},
    )


async def _htmx_body(
    meta: Meta, first: Event, events: AsyncGenerator[Event, None]
) -> AsyncGenerator[bytes, None]:
    """`meta` first, then each token as an escaped fragment (hx-swap appends it), then `done`
    with the usage and the permalink, or `error`."""
    usage: Usage | None = None
    async with aclosing(events):
        yield sse.named("meta", meta_payload(meta))
        event: Event = first
        while True:
            if type(event) is Token:
                if event.text:
                    yield sse.fragment(event.text)
            elif type(event) is Usage:
                usage = event
            elif type(event) is Meta:
                merged = meta.merged(event)
                if merged != meta:
                    meta = merged
                    yield sse.named("meta", meta_payload(meta))
            elif type(event) is Done:
                yield sse.named(
                    "done",
                    {
                        **meta_payload(meta),
                        "usage": None
                        if usage is None
                        else {
                            "prompt_tokens": usage.prompt_tokens,
                            "completion_tokens": usage.completion_tokens,
                            "total_tokens": usage.total_tokens,
                        },
                    },
                )
                return
            elif type(event) is Ping:
                yield sse.PING
            elif type(event) is Error:
                yield sse.named("error", _error_payload(event))
                return
            event = await anext(events, None) or internal()


# --- permalinks and feedback --------------------------------------------------------------

#: How long after it was written a quote can still be rated.
FEEDBACK_WINDOW = timedelta(days=1)


async def quote_permalink(request: HttpRequest, public_id: uuid.UUID) -> HttpResponse:
    try:
        generation = await Generation.objects.select_related("persona").aget(
            public_id=public_id, status=Generation.Status.OK, is_preview=False
        )
    except Generation.DoesNotExist:
        raise Http404("No such quote.") from None
    if generation.shared_at is None:  # one write per quote, ever: it is kept longer from now on
        await Generation.objects.filter(pk=generation.pk, shared_at__isnull=True).aupdate(
            shared_at=timezone.now()
        )
    text = generation.text.strip()
    return render(
        request,
        "quotes/permalink.html",
        {
            "generation": generation,
            "persona": generation.persona,
            "text": text,
            "model_url": doc_url(generation.model),
            "absolute_url": request.build_absolute_uri(),
            "persona_url": request.build_absolute_uri(
                reverse("quotes:persona", kwargs={"slug": generation.persona.slug})
            ),
        },
    )


@csrf_exempt  # JSON only, like the stream API: a cross-site form cannot send application/json
async def quote_feedback(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """POST {"value": 1 | -1}: a visitor's thumbs up or down on a quote, one per visitor (see
    quotes/feedback.py). Setting the same value again changes nothing (idempotent); a new value
    replaces that visitor's old one. Rate-limited per visitor (QUOTES_FEEDBACK_RATE_LIMIT)."""
    try:
        if request.method != "POST":
            raise QuoteError("method_not_allowed", "Use POST with a JSON body.", 405)
        client = await client_of(request)
        await count_vote(client.key)
        params = _read_params(request)
        value = params.get("value")
        if type(value) is not int or value not in (1, -1):
            raise QuoteError("invalid_feedback", "`value` must be 1 (thumbs up) or -1 (thumbs down).", 400)
        try:
            generation = await Generation.objects.aget(public_id=public_id, is_preview=False)
        except Generation.DoesNotExist:
            raise QuoteError("unknown_quote", "There is no such quote.", 404) from None
        if generation.status != Generation.Status.OK:
            raise QuoteError("not_rateable", "Only a finished quote can be rated.", 409)
        if generation.created_at < timezone.now() - FEEDBACK_WINDOW:
            raise QuoteError("feedback_closed", "This quote is too old to be rated now.", 403)
    except QuoteError as exc:
        return error_response(exc, {"Allow": "POST"} if exc.status == 405 else None)
    await record_vote(generation_id=generation.pk, client_key=client.key, value=value)
    return JsonResponse({"id": str(generation.public_id), "feedback": value})
