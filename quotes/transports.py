"""From the gateway's events to what each client reads: one loop (`encode_stream`) driving four
small encoders (Workers AI's JSON SSE, EventSource, htmx fragments, WebSocket frames), and
`stream_response`, which answers an HTTP request with the stream or, before any text, with the
encoder's `error_answer` at the error's real status. See docs/architecture.md ("Out")."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import asdict
from typing import Any, Generic, TypeVar, cast

from django.http import HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.urls import reverse

from .ai import sse
from .ai.catalog import doc_url
from .ai.errors import QuoteError, envelope, internal
from .ai.events import Done, Error, Event, Meta, Ping, Reconnect, Token, Usage
from .ai.gateway.admission import reconnect_retry_ms, server_draining
from .ai.gateway.runs import Resumed, resume_key
from .request_threads import release_request_thread

Out = TypeVar("Out")
Answer = TypeVar("Answer")


def id_prefix(public_id: str) -> str:
    """What a generation's event ids start with: `<public_id>.<resume key>:` (then its number)."""
    return f"{public_id}.{resume_key(public_id)}:"


class Encoder(Generic[Out, Answer]):
    """How each event looks on one transport. None (the default): nothing to send for it."""

    def start(self, meta: Meta) -> Out | None: ...
    def meta(self, meta: Meta) -> Out | None: ...  # the facts changed while the stream flows
    def token(self, text: str) -> Out | None: ...
    def usage(self, usage: Usage) -> Out | None: ...
    def ping(self) -> Out | None: ...
    def done(self, meta: Meta, usage: Usage | None) -> Out | None: ...
    def error(self, error: Error) -> Out | None: ...
    # The process drains: resume elsewhere after `retry_ms`, from `last_event_id`. Sent last.
    def reconnect(self, last_event_id: str | None, retry_ms: int) -> Out | None: ...

    def identify(self, out: Out, prefix: str, n: int) -> Out:
        """`out` numbered as the generation's n-th event (its resume id)."""
        return out

    def error_answer(self, error: Error, meta: Meta) -> Answer:
        """The whole answer to a request that fails before anything was sent."""
        raise NotImplementedError


#: The error when the events end without Done or Error (made once: never per token).
_ENDED = internal()


async def encode_stream(
    events: AsyncGenerator[Event, None],
    encoder: Encoder[Out, Any],
    meta: Meta | None = None,
    after: int = 0,
    *,
    first: Event | None = None,
    resumed: bool = False,
) -> AsyncGenerator[Out, None]:
    """Drive `events` into `encoder` until Done, Error or Reconnect. `meta`: the facts read so far,
    `after`: the generation's events before `events` (a new stream's Metas, read before an HTTP
    status is chosen with its `first` real event; a resume's, its client had). Events are numbered
    as read (a reader yields the generation's events in order from where it started; pings are
    none). A resume sends no opening, and may end without a terminal event: its client had them."""
    meta, n, usage = meta or Meta(), after, None
    sent = n if resumed else 0  # the last event sent with its id: where a cut stream resumes
    prefix = id_prefix(meta.generation_id) if meta.generation_id else None
    async with aclosing(events):
        if not resumed and (out := encoder.start(meta)) is not None:
            if prefix is not None:  # it stands for the events read before the first one
                sent, out = n, encoder.identify(out, prefix, n)
            yield out
        event = first or await anext(events, _ENDED)
        while (kind := type(event)) is not Reconnect:  # the event's type, taken once per event
            if kind is Token:
                out = encoder.token(cast(Token, event).text)
            elif kind is Ping:  # no event: no number, no id
                if (out := encoder.ping()) is not None:
                    yield out
                event = await anext(events, _ENDED)
                continue
            elif kind is Usage:
                usage = cast(Usage, event)
                out = encoder.usage(usage)
            elif kind is Meta:
                merged = meta.merged(cast(Meta, event))
                out = encoder.meta(merged) if merged != meta else None
                meta = merged
                if prefix is None and meta.generation_id:
                    prefix = id_prefix(meta.generation_id)
            elif kind is Done:
                out = encoder.done(meta, usage)
            else:  # Error: after the first byte the status is sent, so the error is an event
                if event is _ENDED and resumed:
                    return  # resumed after the last event: nothing more to send
                out = encoder.error(cast(Error, event))
            n += 1
            if out is not None:
                if prefix is not None and event is not _ENDED:  # _ENDED is none of its events: no id
                    sent, out = n, encoder.identify(out, prefix, n)
                yield out
            if kind is Done or kind is Error:
                return
            event = await anext(events, _ENDED)
    # Cut by the drain (the run's row is written): the client hears where to go.
    out = encoder.reconnect(f"{prefix}{sent}" if prefix is not None else None, reconnect_retry_ms())
    if out is not None:
        yield out


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def stream_response(
    events: AsyncGenerator[Event, None],
    encoder: Encoder[bytes, HttpResponse],
    resumed: Resumed | None = None,
) -> HttpResponseBase:
    """Wait for the first token (or an error) before answering, so an error before any text gets
    its real status; then stream. A resume comes with its Resumed (its client had the beginning)."""
    # The wait needs no request thread: a burst of new streams holds none (quotes.request_threads).
    release_request_thread()
    if resumed is not None:
        meta, after, first = resumed.meta, resumed.after, None
    else:
        meta, after = Meta(), 0
        first = await anext(events, _ENDED)
        while type(first) is Meta or type(first) is Ping:
            if type(first) is Meta:
                meta, after = meta.merged(first), after + 1
            first = await anext(events, _ENDED)
        if type(first) is Reconnect:
            first = server_draining()  # cut by the drain, nothing sent yet: refused like a new stream
        if type(first) is Error:
            await events.aclose()
            return encoder.error_answer(first, meta)
    headers = {**SSE_HEADERS, **meta_headers(meta)}
    if meta.generation_id:
        headers["X-Generation-Id"] = meta.generation_id
    body = encode_stream(events, encoder, meta, after, first=first, resumed=resumed is not None)
    return StreamingHttpResponse(body, content_type="text/event-stream", headers=headers)


def meta_headers(meta: Meta) -> dict[str, str]:
    headers = meta.response_headers()
    if meta.model:
        headers["X-Quote-Model"] = meta.model
        headers["X-Quote-Model-Url"] = doc_url(meta.model)
    if meta.generation_id:
        headers["X-Quote-Id"] = meta.generation_id
    return headers


def error_response(error: QuoteError | Error, headers: dict[str, str] | None = None) -> JsonResponse:
    """The JSON error (the API's, and any view's that answers JSON)."""
    return JsonResponse(
        envelope(error.code, error.message), status=error.status, headers={**(headers or {}), **_retry(error)}
    )


def _retry(error: QuoteError | Error) -> dict[str, str]:
    return {} if error.retry_after is None else {"Retry-After": str(error.retry_after)}


def permalink_of(generation_id: str | None) -> str | None:
    return reverse("quotes:permalink", args=[generation_id]) if generation_id else None


def meta_payload(meta: Meta) -> dict[str, Any]:
    return {
        "model": meta.model,
        "model_url": doc_url(meta.model) if meta.model else "",
        "cache_status": meta.response_headers().get("cf-aig-cache-status", "").upper(),
        "id": meta.generation_id,
        "permalink": permalink_of(meta.generation_id),
    }


def usage_payload(usage: Usage | None) -> dict[str, int] | None:
    return None if usage is None else {**asdict(usage), "total_tokens": usage.total_tokens}


def error_payload(error: Error) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "retry_after": error.retry_after}


class SSEEncoder(Encoder[bytes, HttpResponse]):
    def ping(self) -> bytes:
        return sse.PING

    def reconnect(self, last_event_id: str | None, retry_ms: int) -> bytes:
        return sse.reconnect(last_event_id, retry_ms)

    def identify(self, out: bytes, prefix: str, n: int) -> bytes:
        return f"id: {prefix}{n}\n".encode() + out  # `id:` first: an SSE event's fields come in any order


class WorkersAIEncoder(SSEEncoder):
    """The JSON stream: Workers AI's own wire format, whichever backend answers (the facts go out
    as headers)."""

    def token(self, text: str) -> bytes:
        return sse.token(text)

    def usage(self, usage: Usage) -> bytes:
        return sse.usage(usage)

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        return sse.DONE

    def error(self, error: Error) -> bytes:
        return sse.error(error.code, error.message)

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        # The gateway headers (cf-aig-log-id above all) matter most when something failed.
        return error_response(error, meta_headers(meta))


class EventSourceEncoder(WorkersAIEncoder):
    """EventSource reconnects when a body ends, which would write a second quote: a named `done`
    after `[DONE]` tells the client to close() first. A body cut short resumes after `retry` ms."""

    def start(self, meta: Meta) -> bytes:
        return b"retry: 1000\n\n"  # how long EventSource waits to reconnect (and resume), in ms

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        id_ = meta.generation_id
        return sse.DONE + sse.named("done", {"id": id_, "permalink": permalink_of(id_)})


class HtmxEncoder(SSEEncoder):
    """hx-sse appends each unnamed message's data to the target as HTML and dispatches each named
    event as a DOM event: text goes out HTML-escaped, facts as named JSON events."""

    _space = ""  # whitespace held back for the next token

    def start(self, meta: Meta) -> bytes:
        return sse.named("meta", meta_payload(meta))

    meta = start

    def token(self, text: str) -> bytes | None:
        # hx-sse never swaps a message whose data is only whitespace (swapEmpty:false), so a lone
        # space (Gemma writes " " before a digit) would vanish from the page: it goes with the next.
        if not text.strip():
            self._space += text
            return None
        text, self._space = self._space + text, ""
        return sse.fragment(text)

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        return sse.named("done", {**meta_payload(meta), "usage": usage_payload(usage)})

    def error(self, error: Error) -> bytes:
        return sse.named("error", error_payload(error))

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        # The real status, and the error as a named event (hx-sse handles any text/event-stream
        # response, whatever its status), so the page shows the message, not an error page.
        return HttpResponse(
            (self.start(meta) if meta.generation_id else b"") + self.error(error),
            status=error.status,
            content_type="text/event-stream",
            headers={**SSE_HEADERS, **meta_headers(meta), **_retry(error)},
        )


class WebSocketEncoder(Encoder[dict[str, Any], dict[str, Any]]):
    """JSON frames: `meta` whenever the facts change, `token`, then `done` or `error`. The socket
    has its own pings."""

    def meta(self, meta: Meta) -> dict[str, Any]:
        return {"type": "meta", **meta_payload(meta)}

    def token(self, text: str) -> dict[str, Any] | None:
        return {"type": "token", "text": text} if text else None

    def done(self, meta: Meta, usage: Usage | None) -> dict[str, Any]:
        id_ = meta.generation_id
        return {"type": "done", "usage": usage_payload(usage), "id": id_, "permalink": permalink_of(id_)}

    def error(self, error: Error) -> dict[str, Any]:
        return {"type": "error", **error_payload(error)}

    def error_answer(self, error: Error, meta: Meta) -> dict[str, Any]:
        return self.error(error)  # the socket has no status: its one error frame

    def reconnect(self, last_event_id: str | None, retry_ms: int) -> dict[str, Any]:
        """Followed by closing the socket with 1012 (service restart): see quotes.consumers."""
        return {"type": "reconnect", "last_event_id": last_event_id, "retry_ms": retry_ms}

    def identify(self, out: dict[str, Any], prefix: str, n: int) -> dict[str, Any]:
        out["event_id"] = f"{prefix}{n}"  # "id" is the generation's, in meta and done
        return out
