"""From a stream's events to what each client reads: one loop (`encode`) driving one small
encoder per wire format (Workers AI's JSON SSE, EventSource, htmx fragments, WebSocket frames),
and `stream_response`, which answers an HTTP request with the stream or, when the stream fails
before its first token, with the encoder's `error_answer` at the error's real status.

Every event a client is sent carries its number in the stream (`<id>.<key>:<n>`), which is what
it resumes from; keep-alive pings carry none. A stream cut by the drain ends with `reconnect`
(resume elsewhere) instead of its error."""

from __future__ import annotations

import html
import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import asdict
from typing import Any, Generic, TypeVar

from django.http import HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.urls import reverse
from streaming import Done, Error, Event, Meta, Ping, Stream, Token, Usage, merged, sse

from .backends.catalog import doc_url
from .errors import ErrorCode, QuoteError, envelope
from .streams import event_id

Out = TypeVar("Out")
Answer = TypeVar("Answer")
RECONNECT_MS = 1000
#: Workers AI's (and OpenAI's) last event of a stream.
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Encoder(Generic[Out, Answer]):
    """How each event looks on one transport; None: nothing to send for it."""

    def start(self, meta: Meta) -> Out | None: ...
    def meta(self, meta: Meta) -> Out | None: ...
    def token(self, text: str) -> Out | None: ...
    def usage(self, usage: Usage) -> Out | None: ...
    def ping(self) -> Out | None: ...
    def done(self, meta: Meta, usage: Usage | None) -> Out | None: ...
    def error(self, error: Error) -> Out | None: ...
    def reconnect(self, last_event_id: str, retry_ms: int) -> Out | None: ...

    def identify(self, out: Out, id: str) -> Out:
        return out

    def error_answer(self, error: Error, meta: Meta) -> Answer:
        """The whole answer to a request that fails before anything was sent."""
        raise NotImplementedError


async def encode(
    events: AsyncGenerator[Event, None],
    encoder: Encoder[Out, Any],
    stream_id: str,
    meta: Meta,
    after: int,
    *,
    first: Event | None = None,
    resumed: bool = False,
) -> AsyncGenerator[Out, None]:
    """Drive `events` (a stream's, after its `after`-th; `first` read already) into
    `encoder` up to the end. `meta`: what the events before them said."""
    n, usage, sent_text, prefix = after, None, resumed, event_id(stream_id, 0)[:-1]
    async with aclosing(events):
        if not resumed and (out := encoder.start(meta)) is not None:
            yield encoder.identify(out, f"{prefix}{n}")
        event = first if first is not None else await anext(events, None)
        while event is not None:
            if type(event) is Ping:
                if (out := encoder.ping()) is not None:
                    yield out
                event = await anext(events, None)
                continue
            n += 1
            if type(event) is Token:
                out, sent_text = encoder.token(event.text), True
            elif type(event) is Usage:
                out, usage = encoder.usage(event), event
            elif type(event) is Meta:
                later = meta.merged(event)
                out, meta = (encoder.meta(later) if later != meta else None), later
            elif type(event) is Done:
                out = encoder.done(meta, usage)
            elif type(event) is Error and event.code == ErrorCode.SERVER_DRAINING and sent_text:
                # Cut by the drain: resume from the last event sent (this one carries no id).
                if (out := encoder.reconnect(f"{prefix}{n - 1}", RECONNECT_MS)) is not None:
                    yield out
                return
            elif type(event) is Error:
                out = encoder.error(event)
            if out is not None:
                yield encoder.identify(out, f"{prefix}{n}")
            if type(event) is Done or type(event) is Error:
                return
            event = await anext(events, None)


async def stream_response(
    stream: Stream, encoder: Encoder[bytes, HttpResponse], after: int = 0
) -> HttpResponseBase:
    """Wait for the first token (or an error) before answering, so an error before any text
    gets its real status; then stream. A resume (`after` > 0) streams at once."""
    events = stream.read(after)
    meta, n, first = merged(stream.events[:after]), after, None
    if not after:
        first = await anext(events)
        while type(first) is Meta:
            meta, n = meta.merged(first), n + 1
            first = await anext(events)
        if type(first) is Error:
            await events.aclose()
            return encoder.error_answer(first, meta)
    headers = {**SSE_HEADERS, **meta_headers(meta)}
    body = encode(events, encoder, stream.id, meta, n, first=first, resumed=bool(after))
    return StreamingHttpResponse(body, content_type="text/event-stream", headers=headers)


def response_headers(meta: Meta) -> dict[str, str]:
    """The upstream's headers with the fallback step and the cache status, as AI Gateway names
    them: an answer from either cache (ours, or the gateway's) reads as a HIT."""
    headers = dict(meta.headers)
    if meta.step is not None:
        headers["cf-aig-step"] = str(meta.step)
    if meta.cache_status and headers.get("cf-aig-cache-status", "").upper() != "HIT":
        headers["cf-aig-cache-status"] = meta.cache_status
    return headers


def meta_headers(meta: Meta) -> dict[str, str]:
    headers = response_headers(meta)
    if meta.model:
        headers["X-Quote-Model"] = meta.model
        headers["X-Quote-Model-Url"] = doc_url(meta.model)
    if meta.id:
        headers["X-Quote-Id"] = headers["X-Generation-Id"] = meta.id
    return headers


def error_response(error: QuoteError | Error, headers: dict[str, str] | None = None) -> JsonResponse:
    """The JSON error (the API's, and any view's that answers JSON)."""
    return JsonResponse(
        envelope(error.code, error.message), status=error.status, headers={**(headers or {}), **_retry(error)}
    )


def _retry(error: QuoteError | Error) -> dict[str, str]:
    return {} if error.retry_after is None else {"Retry-After": str(error.retry_after)}


def permalink_of(id: str | None) -> str | None:
    return reverse("quotes:permalink", args=[id]) if id else None


def meta_payload(meta: Meta) -> dict[str, Any]:
    return {
        "model": meta.model,
        "model_url": doc_url(meta.model) if meta.model else "",
        "cache_status": response_headers(meta).get("cf-aig-cache-status", "").upper(),
        "id": meta.id,
        "permalink": permalink_of(meta.id),
    }


def usage_payload(usage: Usage | None) -> dict[str, int] | None:
    return None if usage is None else {**asdict(usage), "total_tokens": usage.total_tokens}


def error_payload(error: Error) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "retry_after": error.retry_after}


class SSEEncoder(Encoder[bytes, HttpResponse]):
    def ping(self) -> bytes:
        return sse.PING

    def reconnect(self, last_event_id: str, retry_ms: int) -> bytes:
        payload = {"last_event_id": last_event_id, "retry_ms": retry_ms}
        return sse.retry(retry_ms)[:-1] + sse.named("reconnect", payload)

    def identify(self, out: bytes, id: str) -> bytes:
        return sse.with_id(out, id)


class WorkersAIEncoder(SSEEncoder):
    """The JSON stream, in Workers AI's own wire format whichever backend answers (the facts
    go out as headers)."""

    def token(self, text: str) -> bytes:
        return sse.data({"response": text})

    def usage(self, usage: Usage) -> bytes:
        return sse.data({"response": "", "usage": usage_payload(usage)})

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        return DONE

    def error(self, error: Error) -> bytes:
        return sse.named("error", envelope(error.code, error.message))

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        return error_response(error, meta_headers(meta))


class EventSourceEncoder(WorkersAIEncoder):
    """EventSource reconnects when a body ends, which would start a second quote: a named `done`
    after `[DONE]` tells it to close() first; `retry` says how soon it resumes a cut stream."""

    def start(self, meta: Meta) -> bytes:
        return sse.retry(RECONNECT_MS)

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        return DONE + sse.named("done", {"id": meta.id, "permalink": permalink_of(meta.id)})


class HtmxEncoder(SSEEncoder):
    """hx-sse appends each unnamed message to the target as HTML and dispatches each named event
    as a DOM event: text goes out HTML-escaped, facts as named JSON events."""

    def __init__(self) -> None:
        self.space = ""  # whitespace held back for the next token

    def start(self, meta: Meta) -> bytes:
        return sse.named("meta", meta_payload(meta))

    meta = start

    def token(self, text: str) -> bytes | None:
        # hx-sse swaps no message whose data is only whitespace: a lone space goes with the next.
        if not text.strip():
            self.space += text
            return None
        text, self.space = self.space + text, ""
        return sse.event(html.escape(text, quote=False))  # an HTML fragment htmx's hx-sse swaps in

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        return sse.named("done", {**meta_payload(meta), "usage": usage_payload(usage)})

    def error(self, error: Error) -> bytes:
        return sse.named("error", error_payload(error))

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        # The real status, and the error as a named event: the page shows the message.
        return HttpResponse(
            (self.start(meta) if meta.id else b"") + self.error(error),
            status=error.status,
            content_type="text/event-stream",
            headers={**SSE_HEADERS, **meta_headers(meta), **_retry(error)},
        )


class WebSocketEncoder(Encoder[dict[str, Any], dict[str, Any]]):
    """JSON frames: `meta` when the facts change, `token`, then `done` or `error` (or
    `reconnect`, after which the socket closes)."""

    def meta(self, meta: Meta) -> dict[str, Any]:
        return {"type": "meta", **meta_payload(meta)}

    def token(self, text: str) -> dict[str, Any] | None:
        return {"type": "token", "text": text} if text else None

    def done(self, meta: Meta, usage: Usage | None) -> dict[str, Any]:
        return {
            "type": "done",
            "usage": usage_payload(usage),
            "id": meta.id,
            "permalink": permalink_of(meta.id),
        }

    def error(self, error: Error) -> dict[str, Any]:
        return {"type": "error", **error_payload(error)}

    def error_answer(self, error: Error, meta: Meta) -> dict[str, Any]:
        return self.error(error)

    def reconnect(self, last_event_id: str, retry_ms: int) -> dict[str, Any]:
        return {"type": "reconnect", "last_event_id": last_event_id, "retry_ms": retry_ms}

    def identify(self, out: dict[str, Any], id: str) -> dict[str, Any]:
        out["event_id"] = id
        return out


# -- OpenAI's Chat Completions ---------------------------------------------------------------

#: OpenAI's code for a model it does not know: a persona this site does not have.
OPENAI_CODES: dict[str, str] = {ErrorCode.UNKNOWN_PERSONA: "model_not_found"}
#: The request field an error is about, where the error does not say.
OPENAI_PARAMS: dict[str, str] = {
    **dict.fromkeys(
        (ErrorCode.MISSING_PERSONA, ErrorCode.INVALID_PERSONA, ErrorCode.UNKNOWN_PERSONA), "model"
    ),
    ErrorCode.CONTEXT_WINDOW_EXCEEDED: "messages",
}
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def openai_error(error: QuoteError | Error) -> dict[str, dict[str, Any]]:
    """OpenAI's error object: `type` as OpenAI's API sends it, `code` the site's stable code."""
    if error.status == 429:
        kind = "requests"
    elif error.status >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    code = OPENAI_CODES.get(error.code, str(error.code))
    return {
        "error": {
            "message": error.message,
            "type": kind,
            "param": getattr(error, "param", None) or OPENAI_PARAMS.get(error.code),
            "code": code,
        }
    }


def openai_error_response(error: QuoteError | Error, headers: dict[str, str] | None = None) -> JsonResponse:
    """The JSON error of the /v1 routes; a 429 and a 503 keep Retry-After, which the official SDK
    honours; a spent budget tells it not to retry today (`x-should-retry`, OpenAI's header)."""
    headers = {**(headers or {}), **_retry(error)}
    if error.code == ErrorCode.BUDGET_EXHAUSTED:
        headers["x-should-retry"] = "false"
    return JsonResponse(openai_error(error), status=error.status, headers=headers)


def completion_id(public_id: str) -> str:
    return f"chatcmpl-{public_id}"


def finish_reason(usage: Usage | None, max_tokens: int | None) -> str:
    """`length` when the answer used every token it was allowed, else `stop`."""
    if usage is not None and max_tokens is not None and usage.completion_tokens >= max_tokens:
        return "length"
    return "stop"


def openai_usage(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class ChatCompletionsEncoder(SSEEncoder):
    """OpenAI's stream: `chat.completion.chunk`s (the role first, then one per token, then the
    finish_reason), the usage chunk when asked for (`include_usage`), then `data: [DONE]`. An
    error once the stream has begun is a data line holding OpenAI's error object, which the
    official SDK raises; a stream cut by the drain says where to resume (`last_event_id`).
    Each chunk's constant part is built once: a token costs one JSON string."""

    def __init__(self, stream_id: str, model: str, *, include_usage: bool, max_tokens: int | None) -> None:
        self.id, self.model = completion_id(stream_id), model
        self.created = int(time.time())
        self.include_usage, self.max_tokens = include_usage, max_tokens
        self.head = self._chunk({"content": "PLACEHOLDER"}).split(b'"PLACEHOLDER"')
        self.head[0] = b"data: " + self.head[0]
        self.head[1] += b"\n\n"

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
        choices = (
            [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        )
        return _dumps(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        ).encode()

    def start(self, meta: Meta) -> bytes:
        return b"data: " + self._chunk({"role": "assistant", "content": ""}) + b"\n\n"

    def token(self, text: str) -> bytes | None:
        return self.head[0] + _dumps(text).encode() + self.head[1] if text else None

    def done(self, meta: Meta, usage: Usage | None) -> bytes:
        out = b"data: " + self._chunk({}, finish_reason(usage, self.max_tokens)) + b"\n\n"
        if self.include_usage and usage is not None:
            out += b"data: " + self._chunk(None, usage=openai_usage(usage)) + b"\n\n"
        return out + DONE

    def error(self, error: Error) -> bytes:
        return sse.data(openai_error(error))

    def reconnect(self, last_event_id: str, retry_ms: int) -> bytes:
        error = openai_error(Error(ErrorCode.SERVER_DRAINING, RESTARTING, 503, retry_after=1))
        error["error"]["last_event_id"] = last_event_id
        return sse.data(error)

    def error_answer(self, error: Error, meta: Meta) -> HttpResponse:
        return openai_error_response(error, meta_headers(meta))


RESTARTING = "The server is restarting: send the request again with this Last-Event-ID header to resume."
