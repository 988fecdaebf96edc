"""An upstream's server-sent events, read with httpx-sse 0.4.3, with its two departures from the
WHATWG rules closed (tests/backends/test_upstream_sse.py pins both in bare httpx-sse):

- A leading BOM hid the first field's name: an event stream is UTF-8, decoded as `utf-8-sig`.
- A read ending in CR was held back until the next showed whether an LF follows: on a CR-only
  stream every event waited for the next. The bytes get LF line ends first, an LF starting a read
  after a CR dropped as a CRLF's second half.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

__all__ = ["ServerSentEvent", "finish_body", "read_error_body", "upstream_events"]


def upstream_events(response: httpx.Response) -> AsyncGenerator[ServerSentEvent, None]:
    """The events of an open streaming response, as httpx-sse's `aiter_sse()` (SSEError on the
    first step when the body is not `text/event-stream`)."""
    response.encoding = "utf-8-sig"
    if isinstance(response.stream, httpx.AsyncByteStream):
        response.stream = LineEnds(response.stream)
    return EventSource(response).aiter_sse()


class LineEnds(httpx.AsyncByteStream):
    """A response body with CR and CRLF line ends turned into LF, read by read."""

    __slots__ = ("_stream",)

    def __init__(self, stream: httpx.AsyncByteStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        after_cr = False  # the previous read ended in CR: an LF starting this one is its pair
        async for chunk in self._stream:
            if not chunk:
                continue
            if after_cr and chunk[:1] == b"\n":
                chunk = chunk[1:]
            after_cr = chunk[-1:] == b"\r"
            if b"\r" in chunk:
                chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if chunk:
                yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


async def read_error_body(response: httpx.Response, limit: int = 64 * 1024) -> bytes:
    """At most `limit` bytes of an error body: enough for any envelope, bounded against a runaway;
    none if it cannot be read (cut, undecodable): the status alone still says what happened."""
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) >= limit:
                break
    except httpx.HTTPError:
        return b""
    return bytes(body[:limit])


#: How long to wait for the end of the body after [DONE] (normally it is already there).
BODY_END_WAIT_S = 0.05


async def finish_body(source: AsyncIterator[Any]) -> None:
    """Read the body's end after [DONE], so httpx pools the connection and the next request skips
    the TCP and TLS round trips to Cloudflare; bounded, so a lingering server holds nothing back."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(BODY_END_WAIT_S):
            async for _ in source:
                pass
