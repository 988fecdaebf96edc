"""Who may open a stream, checked before any work is done for it:

1. the process's open-stream cap (`max_open_streams`, QUOTES_MAX_OPEN_STREAMS): a count in this
   process's memory, whoever asks. Past it the answer is an immediate 503 with Retry-After, before
   any header of a stream is sent, so the streams the process already holds keep their pace
   instead of every stream slowing down together;
2. the client's rate limit and concurrent-stream cap (quotes.ai.limits, in the shared cache, so
   they hold across processes): 429 with Retry-After.

An admitted stream holds a `Ticket` until it ends; `release()` gives back what it holds.

And whether this process still takes streams at all: once it drains (`drain`, begun on SIGTERM by
quotes.server) every new stream is refused at once (503 server_draining, with Retry-After, so
nginx or the client goes to another process) and /healthz answers 503 "draining"; the open ones
run on until they end or the drain's deadline (QUOTES_DRAIN_TIMEOUT_S), where each is cut: its
transport tells the client to resume elsewhere (quotes.transports) and its log row says
server_draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from dataclasses import dataclass
from typing import Any

from ...conf import GatewaySettings
from .. import limits
from ..errors import ErrorCode
from ..events import Error

logger = logging.getLogger(__name__)

#: Seconds a refused client is told to wait: about the time a short quote takes to stream.
OVER_CAPACITY_RETRY_AFTER_S = 5
#: Seconds a client refused by a draining process is told to wait: the other processes take it
#: now (nginx retries there at once); a client of this one process alone finds it restarted.
DRAINING_RETRY_AFTER_S = 1


class OpenStreams:
    """The streams open in this process (HTTP and WebSocket alike)."""

    def __init__(self) -> None:
        self.count = 0
        #: set when the count falls to 0 (made by a drain, which waits for it)
        self.emptied: asyncio.Event | None = None

    def try_open(self, cap: int) -> bool:
        if self.count >= cap:
            return False
        self.count += 1
        return True

    def close(self) -> None:
        self.count -= 1
        if not self.count and self.emptied is not None:
            self.emptied.set()


open_streams = OpenStreams()


def at_capacity(options: GatewaySettings) -> bool:
    """Whether a new stream would be refused now (checked before a request is even parsed; the
    admission itself checks again). `refusal()` says why."""
    return drain.draining or open_streams.count >= options.max_open_streams


def refusal(options: GatewaySettings) -> Error | None:
    """The Error that refuses a new stream in this process now (draining, or at its cap), else None."""
    if drain.draining:
        return server_draining()
    if open_streams.count >= options.max_open_streams:
        return over_capacity()
    return None


def server_draining() -> Error:
    return Error(
        ErrorCode.SERVER_DRAINING,
        "This server is restarting. Please try again in a moment.",
        503,
        retry_after=DRAINING_RETRY_AFTER_S,
    )


def over_capacity() -> Error:
    return Error(
        ErrorCode.OVER_CAPACITY,
        "The site is busy writing other quotes right now. Please try again in a few seconds.",
        503,
        retry_after=OVER_CAPACITY_RETRY_AFTER_S,
    )


@dataclass(slots=True)
class Ticket:
    client_key: str
    #: still holding a slot of the client's concurrent-stream cap (shared cache)
    client_slot: bool = True
    #: still counted in this process's open streams
    process_slot: bool = True

    async def release_client_slot(self) -> None:
        """Give the client's slot back (before the client hears "done" and asks again)."""
        if self.client_slot:
            self.client_slot = False
            await _shielded(limits.run_on_cache(limits.release_stream_slot, self.client_key))

    async def release(self) -> None:
        if self.process_slot:
            self.process_slot = False
            open_streams.close()
        await self.release_client_slot()


async def admit(client_key: str, options: GatewaySettings) -> Ticket | Error:
    """A Ticket, or the Error (503 over capacity, 429 rate limited) that refuses the stream."""
    if drain.draining:
        return server_draining()
    if not open_streams.try_open(options.max_open_streams):
        return over_capacity()
    limit, window = options.rate_limit
    try:
        # Atomic, in one round trip on Redis, and safe against this request being cancelled.
        refused = await limits.admit_stream(
            client_key, limit=limit, window=window, max_streams=options.max_concurrent_streams
        )
    except BaseException:
        open_streams.close()
        raise
    if refused is None:
        return Ticket(client_key)
    open_streams.close()
    reason, retry_after = refused
    if reason == "rate_limited":
        message = f"You have asked for {limit} quotes in a short while. Try again in {retry_after} s."
    else:
        message = "You already have quotes being written. Wait for one to finish."
    return Error(reason, message, 429, retry_after=retry_after)


async def _shielded(coroutine: Any) -> None:
    """Finish `coroutine` even if this task is cancelled meanwhile."""
    task = asyncio.ensure_future(coroutine)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        raise  # the task goes on by itself
    except Exception:
        logger.exception("cleanup after a generation failed")


# -- draining -------------------------------------------------------------------------------------

#: How long the client of a cut stream waits before it resumes (EventSource's `retry`), in ms: a
#: random pick in this range, so the streams of a whole process do not all land on the next one
#: in the same instant.
RECONNECT_RETRY_MS = (250, 1500)
#: After the cut, how long the cut streams get to send their last event and write their rows.
CUT_GRACE_S = 5.0


class StreamWatch:
    """What the drain knows of one open stream (kept by its task): whether it is waiting for its
    next event (a cut then cancels that wait) and whether it has been cut."""

    __slots__ = ("cut", "waiting")

    def __init__(self) -> None:
        self.waiting = False
        self.cut = False


class Drain:
    """This process's drain (one per process: `drain`)."""

    def __init__(self) -> None:
        self.draining = False
        #: the open streams, by the task that drives each (weakly: a stream whose response was
        #: never sent leaves no trace)
        self._watches: weakref.WeakKeyDictionary[asyncio.Task[Any], StreamWatch] = weakref.WeakKeyDictionary()

    def watch(self) -> StreamWatch:
        """The current task's stream (made on first ask: the HTTP view and then the relay, in
        one task, share it)."""
        task = asyncio.current_task()
        assert task is not None
        watch = self._watches.get(task)
        if watch is None:
            watch = self._watches[task] = StreamWatch()
        return watch

    def forget(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._watches.pop(task, None)

    def cut_error(self) -> Error | None:
        """server_draining when the current task's stream was cut by the drain (for its log row)."""
        task = asyncio.current_task()
        watch = self._watches.get(task) if task is not None else None
        return server_draining() if watch is not None and watch.cut else None

    async def run(self, timeout_s: float) -> None:
        """Refuse new streams from now on; let the open ones run for up to `timeout_s`; then cut
        the rest and wait (briefly) until they have told their clients and written their rows."""
        self.draining = True
        logger.info("draining: %d open streams, deadline in %g s", open_streams.count, timeout_s)
        emptied = open_streams.emptied = asyncio.Event()
        if open_streams.count:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(emptied.wait(), timeout_s)
        cut = self.cut()
        if cut:
            logger.warning(
                "draining: %d streams still open at the deadline were told to resume elsewhere", len(cut)
            )
        # The streams that ended by themselves are waited for too: their last bytes must reach
        # daphne before the reactor stops.
        tasks = [task for task in list(self._watches) if not task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=CUT_GRACE_S)

    def cut(self) -> list[asyncio.Task[Any]]:
        """Cut every open stream: one waiting for its next event at once (its task is cancelled,
        which closes its upstream), one busy sending as soon as it comes back for more."""
        cut = []
        for task, watch in list(self._watches.items()):
            if task.done() or watch.cut:
                continue
            watch.cut = True
            if watch.waiting:
                task.cancel()
            cut.append(task)
        return cut


def reconnect_retry_ms() -> int:
    return random.randint(*RECONNECT_RETRY_MS)


drain = Drain()
