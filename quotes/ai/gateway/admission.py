"""Who may open a stream, checked before any work is done for it:

1. the process's open-stream cap (`max_open_streams`, QUOTES_MAX_OPEN_STREAMS): a count in this
   process's memory, whoever asks. Past it the answer is an immediate 503 with Retry-After, before
   any header of a stream is sent, so the streams the process already holds keep their pace
   instead of every stream slowing down together;
2. the client's rate limit and concurrent-stream cap (quotes.ai.limits, in the shared cache, so
   they hold across processes): 429 with Retry-After.

An admitted stream holds a `Ticket` until it ends; `release()` gives back what it holds.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ...conf import GatewaySettings
from .. import limits
from ..errors import ErrorCode
from ..events import Error

logger = logging.getLogger(__name__)

#: Seconds a refused client is told to wait: about the time a short quote takes to stream.
OVER_CAPACITY_RETRY_AFTER_S = 5


class OpenStreams:
    """The streams open in this process (HTTP and WebSocket alike)."""

    def __init__(self) -> None:
        self.count = 0

    def try_open(self, cap: int) -> bool:
        if self.count >= cap:
            return False
        self.count += 1
        return True

    def close(self) -> None:
        self.count -= 1


open_streams = OpenStreams()


def at_capacity(options: GatewaySettings) -> bool:
    """Whether a new stream would be refused now (checked before a request is even parsed; the
    admission itself checks again)."""
    return open_streams.count >= options.max_open_streams


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
