"""Who may start a stream: one check at the top of every way a stream starts (the views, the
WebSocket's start, the admin's preview, `manage.py quote`: quotes.streams.begin), before any work.

1. This process's own state, with no I/O (`check_capacity`; quotes.gate asks it too, before
   Django's middleware, so an overloaded process refuses for almost nothing): its drain (503
   `server_draining`); its event loop's lag while it serves more than a few streams, so that
   it takes no stream that would slow the ones it has, whatever the host (`Lag`); its open
   streams against QUOTES_MAX_OPEN_STREAMS, the operator's ceiling (both 503 `over_capacity`).
   Each with Retry-After.
2. The client's rate limit and its network's (quotes.rate_limits): 429 `rate_limited`.
3. The client's concurrent streams (QUOTES_MAX_CONCURRENT_STREAMS) and its network's (six times
   that, and no more than a quarter of this process's streams, but always one client's worth):
   429 `too_many_streams`. With Redis the client's and the network's bounds hold across every
   process (a client that changes its cookie to land on each process gets no more); while Redis
   is down, each process's own. The `Slot` taken is held by the stream that starts until it
   ends, dropped connection or not.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from django.conf import settings

from . import state
from .clients import Client
from .errors import DRAINED, ErrorCode, QuoteError
from .rate_limits import NETWORK_FACTOR, count_stream, limiter
from .registry import streams

OVER_CAPACITY_RETRY_S = 2
DRAINING_RETRY_S = 1
TOO_MANY_STREAMS_RETRY_S = 5
#: How often the event loop's lag is sampled, and the lag past which a process that serves
#: streams takes no more: its streams' tokens would wait that long behind other work
#: (docs/benchmarks.md: 50, 25, 10 and 5 ms tried under an overload).
LAG_PROBE_S = 0.05
LAG_LIMIT_S = 0.01
#: Streams a process always takes, however late its loop: a burst's set-ups lag it for a moment
#: (docs/benchmarks.md: with 16, one process took 16 of a burst of 50 it held at pace).
LAG_FLOOR = 32


class Admission:
    """This process's streams: how many are open (admitted, their stream started or not), by
    client and network too, and whether it drains (a part of quotes.state)."""

    def __init__(self) -> None:
        self.open = 0
        self.per_key: Counter[str] = Counter()
        self.draining = False
        self.letting_go: set[asyncio.Task[None]] = set()


class Lag:
    """How late this process's event loop runs what is due (the pattern of Node's `toobusy`): a
    timer due every LAG_PROBE_S, how late it fired, smoothed over a few probes (a 1/3 weight),
    so that one slow moment refuses nothing and a loop that stays late refuses within a few
    probes. A probe overdue now counts as if it fired now: a burst that holds the loop for
    longer is seen before it ends. A part of quotes.state; its timer is all it costs."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.smoothed = 0.0
        self.due = self.loop.time() + LAG_PROBE_S
        self.timer = self.loop.call_at(self.due, self.probe)

    def probe(self) -> None:
        now = self.loop.time()
        self.smoothed += (now - self.due - self.smoothed) / 3
        self.due = now + LAG_PROBE_S
        self.timer = self.loop.call_at(self.due, self.probe)

    def seconds(self) -> float:
        overdue = self.loop.time() - self.due
        return self.smoothed + (overdue - self.smoothed) / 3 if overdue > self.smoothed else self.smoothed

    async def aclose(self) -> None:
        self.timer.cancel()


def network_streams() -> int:
    """A network's streams at most, across the site: six clients' worth."""
    return int(settings.QUOTES_MAX_CONCURRENT_STREAMS) * NETWORK_FACTOR


class Slot:
    """One of this process's open streams, and one of its client's and its network's (here, and
    with Redis, across every process): taken by `admit`, given back by the generation that starts
    with it when it ends (or by the request, if none starts)."""

    def __init__(self, admission: Admission, client: Client) -> None:
        self.admission: Admission | None = admission
        self.keys = [key for key in (client.key, client.network) if key]
        self.shared = ""  # its place in Redis, once taken
        admission.open += 1
        admission.per_key.update(self.keys)

    def release(self) -> None:
        admission, self.admission = self.admission, None
        if admission is None:
            return
        admission.open -= 1
        admission.per_key.subtract(self.keys)
        for key in self.keys:
            if admission.per_key[key] <= 0:
                del admission.per_key[key]
        if self.shared:
            task = asyncio.get_running_loop().create_task(limiter().let_go(self.shared, self.keys))
            admission.letting_go.add(task)
            task.add_done_callback(admission.letting_go.discard)


def check_capacity() -> None:
    """This process's own refusal, with no I/O: its drain, its loop's lag while it serves
    LAG_FLOOR streams or more, or its open streams at the ceiling."""
    admission = state.of(Admission)
    if admission.draining:
        message = "This server is restarting. Please try again in a moment."
        raise QuoteError(ErrorCode.SERVER_DRAINING, message, 503, retry_after=DRAINING_RETRY_S)
    lag = state.of(Lag)  # sampled from the first request on
    if admission.open >= settings.QUOTES_MAX_OPEN_STREAMS or (
        settings.QUOTES_LAG_ADMISSION and admission.open >= LAG_FLOOR and lag.seconds() > LAG_LIMIT_S
    ):
        message = "The site is busy writing other quotes right now. Please try again in a few seconds."
        raise QuoteError(ErrorCode.OVER_CAPACITY, message, 503, retry_after=OVER_CAPACITY_RETRY_S)


def too_many(network: bool) -> QuoteError:
    if network:
        message = (
            f"Your network already has {network_streams()} quotes being written. Wait for one to finish."
        )
    else:
        message = (
            f"You already have {settings.QUOTES_MAX_CONCURRENT_STREAMS} quotes being written. "
            "Wait for one to finish."
        )
    return QuoteError(ErrorCode.TOO_MANY_STREAMS, message, 429, retry_after=TOO_MANY_STREAMS_RETRY_S)


async def admit(client: Client) -> Slot:
    """The stream's admission: capacity, rate limits, then the client's and its network's
    concurrent streams (here first, with no I/O; then across the processes, in Redis)."""
    check_capacity()
    await count_stream(client)
    check_capacity()  # again: other requests came in while this one was counted
    admission = state.of(Admission)
    if admission.per_key[client.key] >= settings.QUOTES_MAX_CONCURRENT_STREAMS:
        raise too_many(network=False)
    here = min(
        network_streams(), max(settings.QUOTES_MAX_CONCURRENT_STREAMS, settings.QUOTES_MAX_OPEN_STREAMS // 4)
    )
    if client.network and admission.per_key[client.network] >= here:
        raise too_many(network=True)
    slot = Slot(admission, client)
    caps = [settings.QUOTES_MAX_CONCURRENT_STREAMS, network_streams()][: len(slot.keys)]
    try:
        full, slot.shared = await limiter().hold(slot.keys, caps)
    except BaseException:
        slot.release()
        raise
    if full:
        slot.release()
        raise too_many(network=full == 2)
    return slot


async def drain(timeout_s: float) -> int:
    """Take no more streams; wait up to `timeout_s` for the open ones to end (those admitted just
    before included), then stop the rest with `server_draining`. How many were stopped."""
    admission, live = state.of(Admission), streams()
    admission.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (admission.open or live.live) and (left := deadline - loop.time()) > 0:
        if live.live:
            closing = [stream.closed for stream in live.live]
            await asyncio.wait(closing, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        else:  # admitted, its stream not started yet
            await asyncio.sleep(min(left, 0.05))
    return await live.drain(0, DRAINED)
