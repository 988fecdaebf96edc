"""From the gateway's events to what each client reads: one loop, four small encoders.

`encode_stream()` is the only loop: it drives a generation's events (quotes.ai.gateway) into a
transport's encoder and yields what the encoder makes. Each encoder says how one event looks
on its wire, and nothing else:

- `WorkersAIEncoder`: the public JSON stream, exactly Workers AI's wire format
  (`data: {"response": ...}`, a usage event, `data: [DONE]`, `event: error`);
- `EventSourceEncoder`: the same, plus a closing `event: done` (EventSource would reconnect
  into a second generation without it);
- `HtmxEncoder`: the page's own transport (hx-sse): HTML-escaped text fragments as unnamed
  messages, and named `meta`, `done` and `error` events;
- `WebSocketEncoder`: JSON frames (`meta`, `token`, `done`, `error`) for the consumer.

Each also says how "resume elsewhere" looks (`reconnect`) when a draining process cuts a stream,
and how an event carries its id (`identify`): every event of a generation is numbered
(`<generation id>.<resume key>:<n>`, quotes.ai.gateway.runs), which a client sends back to
resume. The loop numbers them itself: a reader yields the generation's events in order from where
it started (the Opening says where), pings aside, so the n-th event read is the generation's n-th.

An HTTP response must choose its status before its first byte, so `stream_response()` first
`open_stream()`s: everything up to the first token (or the error that came instead) is read, the
status and the headers follow from it, and `encode_stream()` then starts from that first event.
An error before anything was sent is the encoder's `error_answer` (the JSON error, htmx's error
event, an error frame): the views answer their own refusals with it too. The WebSocket has no
status to choose and relays from the start. Keep-alive pings before the first token are
dropped there, for the same reason: the headers are not sent yet.

When the process drains, a stream still open at the drain's deadline reads a Reconnect event
(its run sends it: quotes.ai.gateway.runs.end_for_drain): before its first token it becomes a
503 server_draining (with Retry-After), like a refused one; after it, `encode_stream()` ends it
with the encoder's `reconnect` (an SSE `event: reconnect`, a WebSocket `reconnect` frame),
which tells the client to resume elsewhere.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from django.http import HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.urls import reverse

from .ai import sse
from .ai.catalog import doc_url
from .ai.errors import QuoteError, envelope, internal
from .ai.events import Done, Error, Event, Meta, Ping, Reconnect, Token, Usage
from .ai.gateway.admission import reconnect_retry_ms, server_draining
from .ai.gateway.runs import resume_key
from .request_threads import release_request_thread

Out = TypeVar("Out")
Out_co = TypeVar("Out_co", covariant=True)
Answer_co = TypeVar("Answer_co", covariant=True)


class Encoder(Protocol[Out_co, Answer_co]):
    """How each event looks on one transport. None: nothing to send for it."""

    def error_answer(self, error: Error, meta: Meta) -> Answer_co:
        """The whole answer to a request that fails before anything was sent (an HTTP response
        with the error's status, or an error frame)."""
        ...

    def start(self, meta: Meta) -> Out_co | None: ...

    def meta(self, meta: Meta) -> Out_co | None:
        """`meta` (merged with what came before) changed while the stream flows."""
        ...

    def token(self, text: str) -> Out_co | None: ...

    def usage(self, usage: Usage) -> Out_co | None: ...

    def ping(self) -> Out_co | None: ...

    def done(self, meta: Meta) -> Out_co | None: ...

    def error(self, error: Error) -> Out_co | None: ...

    def reconnect(self, last_event_id: str | None, retry_ms: int) -> Out_co | None:
        """The process is going away (draining): resume elsewhere after `retry_ms`, from
        `last_event_id`. The stream ends after it."""
        ...

    # `out` is what this encoder made (Any: a covariant protocol takes no Out_co argument).
    def identify(self, out: Any, ids: EventIds, n: int) -> Out_co:
        """`out` numbered as the generation's n-th event (its resume id: see EventIds)."""
        ...


class EventIds:
    """A generation's event ids (`<public_id>.<resume key>:<n>`), made once per stream: an SSE
    event's `id:` line costs one concatenation per event."""

    __slots__ = ("prefix", "sse_prefix")

    def __init__(self, public_id: str) -> None:
        self.prefix = f"{public_id}.{resume_key(public_id)}:"
        self.sse_prefix = b"id: " + self.prefix.encode()


#: The error when the events end without Done or Error (made once: never per token).
_ENDED = internal()


@dataclass(frozen=True, slots=True)
class Opening:
    """A stream's beginning: its facts (Meta, merged) and its first real event (a Token, Usage,
    Done or Error), read before an HTTP status is chosen. A resumed stream's opening has the
    facts its client already had and no first event (it is read as the stream flows)."""

    meta: Meta
    first: Event | None
    #: how many of the generation's events came before `first` (its Metas; pings are not
    #: events), or, resumed, the number of the last event its client had
    before: int = 0
    #: a resume: it sends no opening of its own (the client had it), and may end without a
    #: terminal event (the client had seen it)
    resumed: bool = False


async def open_stream(events: AsyncGenerator[Event, None]) -> Opening:
    meta = Meta()
    before = 0
    first = await anext(events, _ENDED)
    while type(first) is Meta or type(first) is Ping:
        if type(first) is Meta:
            meta = meta.merged(first)
            before += 1
        first = await anext(events, _ENDED)
    if type(first) is Reconnect:
        first = server_draining()  # cut by the drain, nothing sent yet: refused like a new stream
    return Opening(meta, first, before)


async def encode_stream(
    events: AsyncGenerator[Event, None], encoder: Encoder[Out, object], opening: Opening | None = None
) -> AsyncGenerator[Out, None]:
    """Drive `events` into `encoder` until Done or Error (always one of them, last), or until
    Reconnect (the draining process cut the stream: the encoder's `reconnect` is last).

    Once the generation's id is known (its first Meta says it), what each event makes carries
    the event's id (EventIds); pings carry none. A resumed stream sends no opening of
    its own, and may end without a terminal event (the client had seen it)."""
    meta = opening.meta if opening is not None else Meta()
    resumed = opening is not None and opening.resumed
    #: the number of the last event read (pings are not events)
    n = opening.before if opening is not None else 0
    #: the number of the last event sent with its id: where a cut stream resumes
    sent = n if resumed else 0
    ids = EventIds(meta.generation_id) if meta.generation_id else None
    async with aclosing(events):
        if not resumed:
            out = encoder.start(meta)
            if out is not None:
                if ids is not None:  # it stands for the events read before the first one
                    sent = n
                    out = encoder.identify(out, ids, n)
                yield out
        event = opening.first if opening is not None else None
        if event is None:
            event = await anext(events, _ENDED)
        while type(event) is not Reconnect:
            if type(event) is Ping:
                out = encoder.ping()
                if out is not None:
                    yield out  # a comment, no event: no id
                event = await anext(events, _ENDED)
                continue
            n += 1
            if type(event) is Token:
                out = encoder.token(event.text)
            elif type(event) is Usage:
                out = encoder.usage(event)
            elif type(event) is Meta:
                merged = meta.merged(event)
                out = encoder.meta(merged) if merged != meta else None
                meta = merged
                if ids is None and meta.generation_id:
                    ids = EventIds(meta.generation_id)
            elif type(event) is Done:
                out = encoder.done(meta)
                if out is not None:
                    yield out if ids is None else encoder.identify(out, ids, n)
                return
            else:  # Error: after the first byte the status is sent, so the error is an event
                assert type(event) is Error
                if event is _ENDED and resumed:
                    return  # resumed after the last event: nothing more to send
                out = encoder.error(event)
                if out is not None:  # _ENDED is none of the generation's events: no id
                    yield out if ids is None or event is _ENDED else encoder.identify(out, ids, n)
                return
            if out is not None:
                if ids is not None:
                    sent = n
                    out = encoder.identify(out, ids, n)
                yield out
            event = await anext(events, _ENDED)
    # Cut by the drain (the run's row is written): the client hears where to go.
    last_event_id = f"{ids.prefix}{sent}" if ids is not None else None
    out = encoder.reconnect(last_event_id, reconnect_retry_ms())
    if out is not None:
        yield out


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def stream_response(
    events: AsyncGenerator[Event, None], encoder: Encoder[bytes, HttpResponse], opening: Opening | None = None
) -> HttpResponseBase:
    """Wait for the first token (or an error) before answering, so an error that happens before
    any text gets its real HTTP status (a refusal its 429 or 503 and Retry-After); then stream.
    A resume comes with its `opening` (its client has had the stream's beginning)."""
    # Nothing from here on needs the request's thread: it goes back to the pool before the wait
    # for the first token, so a burst of new streams holds none either (quotes.request_threads).
    release_request_thread()
    if opening is None:
        opening = await open_stream(events)
        if type(opening.first) is Error:
            await events.aclose()
            return encoder.error_answer(opening.first, opening.meta)
    headers = {**SSE_HEADERS, **meta_headers(opening.meta)}
    if opening.meta.generation_id:
        headers["X-Generation-Id"] = opening.meta.generation_id
    return StreamingHttpResponse(
        encode_stream(events, encoder, opening), content_type="text/event-stream", headers=headers
    )


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


# -- the payloads the page and the socket share ---------------------------------------------------


def permalink_of(generation_id: str | None) -> str | None:
    return reverse("quotes:permalink", args=[generation_id]) if generation_id else None


def meta_payload(meta: Meta) -> dict[str, Any]:
    headers = meta.response_headers()
    return {
        "model": meta.model,
        "model_url": doc_url(meta.model) if meta.model else "",
        "cache_status": headers.get("cf-aig-cache-status", "").upper(),
        "id": meta.generation_id,
        "permalink": permalink_of(meta.generation_id),
    }


def usage_payload(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def error_payload(error: Error) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "retry_after": error.retry_after}


# -- the encoders ---------------------------------------------------------------------------------


def _sse_id(out: bytes, ids: EventIds, n: int) -> bytes:
    # `id:` first: an SSE event's fields may come in any order, and a line costs one concat.
    return ids.sse_prefix + b"%d\n" % n + out


#: How long EventSource waits before it reconnects (and resumes with Last-Event-ID), in ms.
RETRY_MS = 1000


class WorkersAIEncoder:
    """The JSON stream: Workers AI's own wire format, whichever backend answers."""

    __slots__ = ()

    identify = staticmethod(_sse_id)

    def start(self, meta: Meta) -> bytes | None:
        return None  # the facts went out as headers

    def meta(self, meta: Meta) -> bytes | None:
        return None

    def token(self, text: str) -> bytes:
        return sse.token(text)

    def usage(self, usage: Usage) -> bytes:
        return sse.usage(usage)

    def ping(self) -> bytes:
        return sse.PING

    def done(self, meta: Meta) -> bytes:
        return sse.DONE

    def error(self, error: Error) -> bytes:
        return sse.error(error.code, error.message)

    def reconnect(self, last_event_id: str | None, retry_ms: int) -> bytes:
        return sse.reconnect(last_event_id, retry_ms)

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        # The gateway headers (cf-aig-log-id above all) matter most when something failed.
        return error_response(error, meta_headers(meta))


class EventSourceEncoder(WorkersAIEncoder):
    """EventSource reconnects when a body ends, which would write a second quote: a named `done`
    after `[DONE]` tells the client to close() first. A body cut short is another matter: the
    browser reconnects after `retry` ms with Last-Event-ID, which resumes the same generation."""

    __slots__ = ()

    def start(self, meta: Meta) -> bytes:
        return b"retry: %d\n\n" % RETRY_MS

    def done(self, meta: Meta) -> bytes:
        return sse.DONE + sse.named(
            "done", {"id": meta.generation_id, "permalink": permalink_of(meta.generation_id)}
        )


class HtmxEncoder:
    """hx-sse swaps each unnamed message's data into the target as HTML (appended, with
    hx-swap="beforeend") and dispatches each named event as a DOM event: text goes out
    HTML-escaped, facts as named JSON events (`meta` first, then `done` or `error`)."""

    __slots__ = ("_space", "_usage")

    identify = staticmethod(_sse_id)

    def __init__(self) -> None:
        self._usage: Usage | None = None
        self._space = ""  # whitespace held back for the next token

    def start(self, meta: Meta) -> bytes:
        return sse.named("meta", meta_payload(meta))

    def meta(self, meta: Meta) -> bytes:
        return sse.named("meta", meta_payload(meta))

    def token(self, text: str) -> bytes | None:
        # hx-sse never swaps a message whose data is only whitespace (swapEmpty:false), so a
        # token that is a lone space (Gemma writes " " before a digit) would vanish from the
        # page: it goes out with the next token instead.
        if not text.strip():
            self._space += text
            return None
        text, self._space = self._space + text, ""
        return sse.fragment(text)

    def usage(self, usage: Usage) -> None:
        self._usage = usage  # sent with `done`

    def ping(self) -> bytes:
        return sse.PING

    def done(self, meta: Meta) -> bytes:
        return sse.named("done", {**meta_payload(meta), "usage": usage_payload(self._usage)})

    def error(self, error: Error) -> bytes:
        return sse.named("error", error_payload(error))

    def reconnect(self, last_event_id: str | None, retry_ms: int) -> bytes:
        return sse.reconnect(last_event_id, retry_ms)

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        """The real status, and the error as a named event (hx-sse handles any text/event-stream
        response, whatever its status), so the page shows the message instead of swapping an
        error page into the quote."""
        body = self.start(meta) if meta.generation_id else b""
        return HttpResponse(
            body + self.error(error),
            status=error.status,
            content_type="text/event-stream",
            headers={**SSE_HEADERS, **meta_headers(meta), **_retry(error)},
        )


class WebSocketEncoder:
    """JSON frames: `meta` whenever the facts change (the first one before any text), `token`,
    then `done` or `error`. The socket has its own pings."""

    __slots__ = ("_usage",)

    def __init__(self) -> None:
        self._usage: Usage | None = None

    def start(self, meta: Meta) -> None:
        return None

    def meta(self, meta: Meta) -> dict[str, Any]:
        return {"type": "meta", **meta_payload(meta)}

    def token(self, text: str) -> dict[str, Any] | None:
        return {"type": "token", "text": text} if text else None

    def usage(self, usage: Usage) -> None:
        self._usage = usage

    def ping(self) -> None:
        return None

    def done(self, meta: Meta) -> dict[str, Any]:
        return {
            "type": "done",
            "usage": usage_payload(self._usage),
            "id": meta.generation_id,
            "permalink": permalink_of(meta.generation_id),
        }

    def error(self, error: Error) -> dict[str, Any]:
        return {"type": "error", **error_payload(error)}

    def error_answer(self, error: Error, meta: Meta) -> dict[str, Any]:
        return self.error(error)  # the socket has no status: its one error frame

    def reconnect(self, last_event_id: str | None, retry_ms: int) -> dict[str, Any]:
        """Followed by closing the socket with 1012 (service restart): see quotes.consumers."""
        return {"type": "reconnect", "last_event_id": last_event_id, "retry_ms": retry_ms}

    @staticmethod
    def identify(out: dict[str, Any], ids: EventIds, n: int) -> dict[str, Any]:
        out["event_id"] = f"{ids.prefix}{n}"  # "id" is the generation's, in meta and done
        return out
