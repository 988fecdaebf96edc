"""The client's SSE reader, for the tests and the benchmarks: the app's streams (and the fake's)
as events, each `{"event": name, "data": data}` (data lines joined by a line feed; an event
without data is no event; ids and comments dropped). tests/asgi.py's `parse_sse` is stricter: it
checks the app's framing line by line, which is what those tests test."""

from __future__ import annotations

import json
from collections.abc import Iterable


def events_of(lines: Iterable[str]) -> list[dict[str, str]]:
    """The events of a stream's lines (httpx's `iter_lines`, or a body split at its line ends)."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                events.append({"event": "message", **current, "data": "\n".join(data)})
            current, data = {}, []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field != "id":  # every event's resume id (issue 14)
                current[field] = value
    return events


def parse(body: bytes) -> list[dict[str, str]]:
    """The whole events of `body` (CRLF, CR or LF line ends)."""
    text = body.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return events_of(text.split("\n"))


class Reader:
    """Incremental: `feed` each chunk as it arrives, get the events it completed (LF line ends,
    as the app and the fake send)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, str]]:
        self._buffer += chunk
        end = self._buffer.rfind(b"\n\n")
        if end < 0:
            return []
        whole, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
        return events_of(whole.decode(errors="replace").split("\n"))


def text_of(events: list[dict[str, str]], *, html: bool = False) -> str:
    """The quote's text: from Workers AI's JSON events, or htmx's text fragments."""
    messages = [e["data"] for e in events if e["event"] == "message" and e["data"] != "[DONE]"]
    return "".join(messages if html else [json.loads(data)["response"] for data in messages])
