"""Clients for the fault suite: each on a loopback address of its own (127.0.x.y, a visitor of its
own to the app: its own rate count and slots) with a csrftoken cookie of its own (nginx's hash
keeps it on one process, as the page's cookie keeps a visitor), asking for one quote after
another through nginx with a topic of its own, and noting what came back and when each byte did.

A quote's silence is the longest wait for the next byte: from the request to the response's
headers, between two chunks of the body, and from the last chunk to the end of the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from harness.services import client_address
from harness.sse import parse

PERSONA = "alan-watts"
STREAM_PATH = "/api/quotes/stream"

#: Longer than any wait the app may impose: a request silent this long is ended by the client.
CLIENT_TIMEOUT_S = 60.0
#: After anything but a whole quote, a client waits this long before it asks again (no hot loop).
PAUSE_AFTER_FAILURE_S = 0.5


@dataclass
class Quote:
    client: str
    started: float
    ended: float = 0.0
    status: int = 0
    content_type: str = ""
    #: X-Quote-Id: the generation's id (its log row's public_id), on every admitted stream
    quote_id: str = ""
    #: done; error (an error event ended the stream, `code` says which); answered (a status other
    #: than 200, `code` from its JSON body, if any); cut (the body ended without [DONE] or an
    #: error event: the connection broke mid-stream); failed (no response at all)
    outcome: str = ""
    code: str = ""
    silence: float = 0.0
    detail: str = ""

    @property
    def json_error(self) -> bool:
        return self.content_type.startswith("application/json")


MAX_CLIENTS = 1000


def _error_code(text: str) -> str:
    try:
        payload = json.loads(text)
    except ValueError:
        return ""
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("code", "")) if isinstance(error, dict) else ""


async def ask(client: httpx.AsyncClient, base_url: str, name: str) -> Quote:
    """One quote, read to its end, every byte timed."""
    quote = Quote(client=name, started=time.monotonic())
    last = quote.started
    body = b""
    topic = f"faults {name} {secrets.token_hex(6)}"  # its own: no cache hit, no coalescing

    def tick() -> None:
        nonlocal last
        now = time.monotonic()
        quote.silence = max(quote.silence, now - last)
        last = now

    try:
        async with client.stream(
            "POST", base_url + STREAM_PATH, json={"persona": PERSONA, "topic": topic}
        ) as response:
            tick()
            quote.status = response.status_code
            quote.content_type = response.headers.get("content-type", "")
            quote.quote_id = response.headers.get("x-quote-id", "")
            chunks = response.aiter_raw()  # referenced until the end: dropping it closes the stream
            async for chunk in chunks:
                tick()
                body += chunk
            tick()
    except httpx.HTTPError as exc:
        tick()
        quote.outcome = "cut" if quote.status else "failed"
        quote.detail = f"{type(exc).__name__}: {exc}"[:300]
    quote.ended = time.monotonic()
    if quote.outcome:
        return quote
    if quote.status != 200:
        quote.outcome = "answered"
        quote.code = _error_code(body.decode(errors="replace"))
        quote.detail = body[:300].decode(errors="replace")
        return quote
    end = (parse(body) or [{"event": "", "data": ""}])[-1]
    event, data = end["event"], end["data"]
    if event == "message" and data == "[DONE]":
        quote.outcome = "done"
    elif event == "error":
        quote.outcome, quote.code = "error", _error_code(data)
        quote.detail = data[:300]
    else:
        quote.outcome = "cut"
        quote.detail = body[-300:].decode(errors="replace")
    return quote


@dataclass
class Load:
    """`clients` clients asking for quotes from `base_url`, one after another, until stopped."""

    base_url: str
    clients: int
    #: the clients start one after another over this time (about a quote's length), so that
    #: quotes start and end all the time rather than all at once
    ramp_s: float = 0.0
    quotes: list[Quote] = field(default_factory=list)
    #: when things happened, on the monotonic clock (the fault's start and end, ...)
    marks: dict[str, float] = field(default_factory=dict)

    async def _client(
        self, client: httpx.AsyncClient, name: str, delay_s: float, stop: asyncio.Event
    ) -> None:
        async with client:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay_s)
            while not stop.is_set():
                quote = await ask(client, self.base_url, name)
                self.quotes.append(quote)
                if quote.outcome != "done":
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), PAUSE_AFTER_FAILURE_S)

    async def run(self, during: Callable[[Load], Awaitable[None]]) -> None:
        """Start every client, run `during(self)` (the fault's schedule), then let each client
        finish the quote it is reading and stop."""
        assert 0 < self.clients <= MAX_CLIENTS, f"1 to {MAX_CLIENTS} clients, one address each"
        stop = asyncio.Event()
        # Every client made before any asks: making one blocks the loop (and the clients' clocks).
        clients = [client_at(client_address(index)) for index in range(self.clients)]
        tasks = [
            asyncio.create_task(
                self._client(client, client_address(index), index * self.ramp_s / self.clients, stop)
            )
            for index, client in enumerate(clients)
        ]
        try:
            await during(self)
        finally:
            stop.set()
            done, pending = await asyncio.wait(tasks, timeout=2 * CLIENT_TIMEOUT_S)
            for task in pending:
                task.cancel()
            for task in done:
                if (error := task.exception()) is not None:
                    raise error

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()


#: One TLS context for every client (none is used on http://, but httpx makes one per transport
#: unless given one, at about 50 ms of CPU each: 30 clients would stall the loop for seconds).
_TLS = ssl.create_default_context()


def client_at(local_address: str) -> httpx.AsyncClient:
    """A client whose connections come from `local_address`, with a csrftoken cookie of its own
    (the page would have set one: 32 letters and digits)."""
    transport = httpx.AsyncHTTPTransport(local_address=local_address, verify=_TLS)
    cookies = {"csrftoken": secrets.token_hex(16)}
    return httpx.AsyncClient(transport=transport, timeout=CLIENT_TIMEOUT_S, verify=_TLS, cookies=cookies)
