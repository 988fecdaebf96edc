"""Server-Sent Events framing (WHATWG HTML), the bytes a transport writes: one call per token on
the hot path."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["PING", "data", "event", "named", "retry", "with_id"]

#: A comment line: it keeps a quiet connection open through proxies, and readers ignore it.
PING = b": ping\n\n"

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def event(data: str, *, name: str | None = None, id: str | None = None) -> bytes:
    """One event. Multi-line data becomes several `data:` lines, as the format requires."""
    head = (f"id: {id}\n" if id else "") + (f"event: {name}\n" if name else "")
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return (head + "".join(f"data: {line}\n" for line in lines) + "\n").encode()


def data(payload: dict[str, Any]) -> bytes:
    """An unnamed event whose data is one JSON object."""
    return b"data: " + _dumps(payload).encode() + b"\n\n"


def named(name: str, payload: dict[str, Any]) -> bytes:
    """A named event with a JSON object as its data."""
    return event(_dumps(payload), name=name)


def with_id(out: bytes, id: str) -> bytes:
    """`out` (one event) carrying `id` (a client resumes from it with Last-Event-ID)."""
    return f"id: {id}\n".encode() + out


def retry(ms: int) -> bytes:
    """How long EventSource waits before it reconnects (and resumes)."""
    return f"retry: {int(ms)}\n\n".encode()
