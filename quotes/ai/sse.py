"""Server-Sent Events in the Workers AI wire format: the bytes the transports write (one call per
token on the hot path).

Reading an upstream's events is httpx-sse's job (quotes/ai/backends/upstream_sse.py).
"""

from __future__ import annotations

import html
import json
from typing import Any

from .errors import envelope
from .events import Usage

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def encode(data: str, *, event: str | None = None) -> bytes:
    """One SSE event. Multi-line data becomes several `data:` lines, as the spec requires."""
    head = f"event: {event}\n" if event else ""
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return (head + "".join(f"data: {line}\n" for line in lines) + "\n").encode()


def token(text: str) -> bytes:
    # Hot path: one dumps, one concat, one encode per token.
    return b"data: " + _dumps({"response": text}).encode() + b"\n\n"


def usage(value: Usage) -> bytes:
    body = {
        "response": "",
        "usage": {
            "prompt_tokens": value.prompt_tokens,
            "completion_tokens": value.completion_tokens,
            "total_tokens": value.total_tokens,
        },
    }
    return b"data: " + _dumps(body).encode() + b"\n\n"


def error(code: str, message: str) -> bytes:
    return encode(_dumps(envelope(code, message)), event="error")


def reconnect(last_event_id: str | None, retry_ms: int) -> bytes:
    """The server is going away: resume elsewhere. `retry:` sets EventSource's own reconnection
    delay (it reconnects by itself when the body ends, with Last-Event-ID); the named event
    carries the same facts for the fetch and htmx clients."""
    payload = {"last_event_id": last_event_id, "retry_ms": retry_ms}
    return f"retry: {int(retry_ms)}\n".encode() + encode(_dumps(payload), event="reconnect")


# --- htmx (hx-sse) ------------------------------------------------------------------------
# hx-sse swaps each unnamed message's data into the target as HTML and dispatches each named
# event as a DOM event carrying its data: text goes out HTML-escaped, facts as named JSON events.


def fragment(text: str) -> bytes:
    """A token as an HTML-escaped text fragment (an unnamed message, appended by hx-swap)."""
    return encode(html.escape(text, quote=False))


def named(event: str, payload: dict[str, Any]) -> bytes:
    """A named event with a JSON body (`meta`, `done`, `error`)."""
    return encode(_dumps(payload), event=event)
