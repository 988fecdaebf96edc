"""Pure ASGI, in front of Django: a new stream asked of a process that takes no more (its drain,
its event loop's lag, its ceiling: quotes.admission.check_capacity) is refused here, in the
dialect its URL answers in, before Django's middleware, the session, the persona or the
database. An overloaded process spends its time on the streams it serves, not on refusals.

It lets through, for Django to answer as ever: any other request; a resume (Last-Event-ID, or a
`last_event_id` field), which admission never refuses; a page of another origin (its 403 comes
first); a body it cannot read as the view would (the view's 400, 413 or 415). The refusal is
counted as the view counts it (quotes.rows.refused: the metric, and the persona's analytics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from django.conf import settings
from django.http import HttpResponse
from django.urls import NoReverseMatch, reverse
from streaming import Meta

from . import chat_api, rows, views
from .admission import check_capacity
from .clients import ASGIApp, Receive, Scope, Send, header_values
from .encoders import openai_error_response
from .errors import QuoteError
from .ops.logging import REQUEST_ID_HEADER, log_access, request_id_from
from .security import scope_from_elsewhere

Message = MutableMapping[str, Any]


class Gate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.paths: dict[str, str] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "POST"):
            return await self.app(scope, receive, send)
        if self.paths is None:
            self.paths = _stream_paths()
        if (url := self.paths.get(scope["path"])) is not None and not _passes(scope):
            try:
                check_capacity()  # (with no I/O; the streams' requests stop here)
            except QuoteError as error:
                return await self.refuse(scope, receive, send, url, error)
        await self.app(scope, receive, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send, url: str, error: QuoteError) -> None:
        started = time.perf_counter()
        messages, body = await _read_body(receive)
        params = _params(scope, url, body)
        if params is None or params.get("last_event_id"):  # the view's 4xx, or a resume
            return await self.app(scope, _replay(messages, receive), send)
        response, transport, slug = _answer(scope, url, error, params)
        rows.refused(error, slug, transport)
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]
        request_id = request_id_from(_header(scope, b"x-request-id"))
        headers += [
            (b"content-length", str(len(response.content)).encode()),
            (b"x-content-type-options", b"nosniff"),
            (REQUEST_ID_HEADER.encode(), request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": response.content})
        log_access(scope["method"], scope["path"], response.status_code, started)


def _stream_paths() -> dict[str, str]:
    """The paths of the URLs that start a stream, by their names (those the URLconf has)."""
    paths = {}
    for name in ("stream", "stream-form", "chat-completions"):
        try:
            paths[reverse(f"quotes:{name}")] = name
        except NoReverseMatch:
            continue
    return paths


def _header(scope: Scope, name: bytes) -> str:
    values = header_values(scope, name)
    return values[-1] if values else ""


def _passes(scope: Scope) -> bool:
    """Requests the gate never refuses: a resume by header, and a page of another origin."""
    return bool(_header(scope, b"last-event-id")) or scope_from_elsewhere(scope)


async def _read_body(receive: Receive) -> tuple[list[Message], bytes | None]:
    """The messages read, and the body: None when it is over the view's limit, or the client left."""
    messages: list[Message] = []
    size, limit = 0, settings.QUOTES_MAX_BODY_BYTES
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        size += len(message.get("body", b""))
        if size > limit:
            return messages, None
        if not message.get("more_body"):
            return messages, b"".join(m.get("body", b"") for m in messages)


def _replay(messages: list[Message], receive: Receive) -> Callable[[], Any]:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


def _params(scope: Scope, url: str, body: bytes | None) -> dict[str, Any] | None:
    """The request's fields as the view reads them, or None when the view would refuse them."""
    if body is None:
        return None
    if scope["method"] == "GET":
        if url != "stream" or "text/event-stream" not in _header(scope, b"accept"):
            return None  # only an EventSource may GET a stream (the view's 405, 406)
        fields = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return {name: values[-1] for name, values in fields.items()}
    content_type = _header(scope, b"content-type").partition(";")[0].strip().lower()
    if url == "stream-form":
        if content_type != "application/x-www-form-urlencoded":
            return None
        fields = parse_qs(body.decode("utf-8", "replace"))
        return {name: values[-1] for name, values in fields.items()}
    if content_type != "application/json":
        return None
    try:
        return views.json_object(body)
    except QuoteError:
        return None


def _answer(
    scope: Scope, url: str, error: QuoteError, params: dict[str, Any]
) -> tuple[HttpResponse, str, object]:
    """The refusal as the URL's view answers it, its transport's name, and the persona asked."""
    if url == "chat-completions":
        return openai_error_response(error), chat_api.TRANSPORT, params.get("model")
    if url == "stream-form":
        encoder, transport = views.stream_dialect(htmx=True, method="POST", accept="")
    else:
        htmx = _header(scope, b"hx-request") == "true"
        accept = _header(scope, b"accept")
        encoder, transport = views.stream_dialect(htmx=htmx, method=scope["method"], accept=accept)
    response = encoder.error_answer(error.as_event(), Meta())
    if url == "stream":
        response["Vary"] = "HX-Request"
    return response, transport, params.get("persona")
