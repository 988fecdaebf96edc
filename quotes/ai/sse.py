"""Server-Sent Events encoding in the Workers AI wire format.

Encoding is ours (it is a few lines and sits on the hot path); decoding upstream streams uses
httpx-sse, which follows the WHATWG rules (CR, LF and CRLF, comments, multi-line data).
"""

from __future__ import annotations

import html
import json
from typing import Any

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
    return encode(_dumps({"error": {"code": code, "message": message}}), event="error")


# --- htmx (hx-sse) ------------------------------------------------------------------------
# hx-sse swaps each unnamed message's data into the target as HTML and dispatches each named
# event as a DOM event carrying its data: text goes out HTML-escaped, facts as named JSON events.


def fragment(text: str) -> bytes:
    """A token as an HTML-escaped text fragment (an unnamed message, appended by hx-swap)."""
    return encode(html.escape(text, quote=False))


def named(event: str, payload: dict[str, Any]) -> bytes:
    """A named event with a JSON body (`meta`, `done`, `error`)."""
    return encode(_dumps(payload), event=event)
