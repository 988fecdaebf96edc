"""Server-Sent Events: encoding in the Workers AI wire format, and incremental decoding.

Both are ours and both sit on the hot path (one call per token). The decoder follows the WHATWG
rules (a leading BOM, CR, LF and CRLF line ends, comments, multi-line data, `event`, `id`,
`retry`) and takes the raw bytes of the body as the network hands them over, cut anywhere:
mid-line, mid-character, between the CR and the LF of one line end. It replaced httpx-sse's
text -> lines -> events layers (an async generator each) on the upstream read path; the
hypothesis tests in tests/test_sse_decoder.py hold it to a reference decoder on random cuts.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
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


# --- decoding -----------------------------------------------------------------------------------

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class SSEDecoder:
    """Bytes in, dispatched events out: `feed(chunk)` returns the events completed by `chunk`.

    An event still open when the body ends is never dispatched (as the spec says), so nothing
    needs flushing at the end.
    """

    __slots__ = ("_buffer", "_data", "_event", "_id", "_retry", "_skip_lf", "_start")

    def __init__(self) -> None:
        self._buffer = b""  # the unfinished last line
        #: the first bytes of the body until we know whether they are a BOM; None after that
        self._start: bytes | None = b""
        #: a CR ended the previous chunk: an LF starting this one completes that line end
        self._skip_lf = False
        self._data: list[bytes] = []
        self._event = b""
        self._id = b""
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        if self._start is not None:
            chunk = self._strip_bom(chunk)
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 10:  # b"\n"
                chunk = chunk[1:]
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            # A CR at the very end ends its line now; an LF starting the next chunk is its pair.
            self._skip_lf = buffer[-1] == 13
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        events: list[ServerSentEvent] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(self._dispatch())
                else:
                    self._event = b""
                continue
            if line[0] == 58:  # b":": a comment
                continue
            name, colon, value = line.partition(b":")
            if colon and value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value
            elif name == b"id":
                if b"\0" not in value:
                    self._id = value
            elif name == b"retry" and value.isdigit():  # bytes.isdigit: ASCII digits only
                self._retry = int(value)
        return events

    def _dispatch(self) -> ServerSentEvent:
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        event = ServerSentEvent(
            data=data.decode("utf-8", "replace"),
            event=self._event.decode("utf-8", "replace") if self._event else "message",
            id=self._id.decode("utf-8", "replace"),
            retry=self._retry,
        )
        self._data = []
        self._event = b""
        return event

    def _strip_bom(self, chunk: bytes) -> bytes:
        """Drop one UTF-8 BOM at the very start of the body, however the first reads cut it."""
        start = (self._start or b"") + chunk
        if len(start) < len(_BOM) and _BOM.startswith(start):
            self._start = start
            return b""
        self._start = None
        return start[len(_BOM) :] if start.startswith(_BOM) else start
