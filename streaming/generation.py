"""One generation: one list of events, read by any number of readers from an offset.

    generation = Generation(id, grace_s=10, keepalive_s=15)
    last = await generation.run(source)   # in a task of its own: publish the source's events
    ...                                   # (the caller keeps its record of `generation.events`)
    generation.close(last)                # readers see the end

`read(after)` is one connection: the events after the `after`-th, the live rest, then the end. A
dropped connection is not a stop: with no reader left, the generation runs on for `grace_s`
(so the client can resume), then stops with ABANDONED. `stop(error)` ends it now: its source
is cancelled (the upstream closes) unless an identical request follows it (`follow()`: the
follower's source), which keeps the source running; its own readers end with `error` at once.

`Generations` keeps this event loop's generations by id (resume, stop) and by answer key (an
identical request joins one in flight), and counts its open streams."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter, deque
from collections.abc import AsyncGenerator
from contextlib import aclosing

from .events import Done, Error, Event, Ping, Token

logger = logging.getLogger(__name__)

ABANDONED = Error("abandoned", "Nobody came back for this quote: it was stopped.", 410)
ENDED_EARLY = Error("internal_error", "The model ended without finishing the quote.", 500)
FAILED = Error("internal_error", "Something went wrong while writing the quote.", 500)
PING = Ping()


class Generation:
    def __init__(self, id: str, *, client: str = "", grace_s: float = 0, keepalive_s: float = 15) -> None:
        self.id = id
        #: who asked for it: only they may stop it
        self.client = client
        self.events: list[Event] = []
        #: the source's last event (Done or Error), once it came
        self.outcome: Done | Error | None = None
        #: what readers end with, once closed: the outcome, or the stop's error
        self.end: Done | Error | None = None
        #: why it was stopped before its outcome (its client's stop, abandonment, the drain)
        self.stopped: Error | None = None
        self.readers = 0
        self.followers = 0
        self.pings = 0
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        self.first_token_at: float | None = None
        self.grace_s = grace_s
        self.keepalive_s = keepalive_s
        self._loop = loop
        self._last = self.started_at  # when the latest event (or ping) went out
        self._changed = asyncio.Event()
        self._task: asyncio.Task[object] | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._pinger: asyncio.TimerHandle | None = None
        #: resolved with `end` once closed
        self.closed: asyncio.Future[Done | Error] = loop.create_future()

    # -- the source ----------------------------------------------------------------------------

    async def run(self, source: AsyncGenerator[Event, None]) -> Done | Error:
        """Publish `source`'s events up to its Done or Error; return what the readers will end
        with (that, or the stop's error). A stop cancels this, unless it is followed."""
        self._task = asyncio.current_task()
        try:
            async with aclosing(source):
                if self.stopped is None:  # (else it was stopped before it ran)
                    async for event in source:
                        if type(event) is Done or type(event) is Error:
                            self.outcome = event
                            break
                        if self.first_token_at is None and type(event) is Token:
                            self.first_token_at = self._loop.time()
                        self.events.append(event)
                        self._last = self._loop.time()
                        self._wake()
        except asyncio.CancelledError:
            if self._task is None or self.stopped is None:
                raise  # not a stop of ours: the loop is going away
            self._task.uncancel()
        except Exception:
            logger.exception("generation %s: its source failed", self.id)
            self.outcome = FAILED
        finally:
            self._task = None
        if self.outcome is None:
            self.outcome = self.stopped or ENDED_EARLY
        self._wake()  # followers see the outcome now
        return self.stopped or self.outcome

    def close(self, end: Done | Error) -> None:
        """Readers may see the end now."""
        self.end = end
        for timer in (self._grace, self._pinger):
            if timer is not None:
                timer.cancel()
        if not self.closed.done():
            self.closed.set_result(end)
        self._wake()

    def stop(self, error: Error) -> bool:
        """End it now: its readers end with `error`, and its source is cancelled unless another
        generation follows it. False when it had ended or been stopped already."""
        if self.outcome is not None or self.stopped is not None:
            return False
        self.stopped = error
        if self._grace is not None:
            self._grace.cancel()
        if not self.followers and self._task is not None:
            self._task.cancel()
        self._wake()
        return True

    # -- readers -------------------------------------------------------------------------------

    async def read(self, after: int = 0) -> AsyncGenerator[Event, None]:
        """The events after the first `after`, the live rest, then the end (one more event,
        numbered after the last); a Ping after each quiet `keepalive_s` once text flows."""
        self.readers += 1
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        index, pings = after, self.pings
        try:
            while True:
                events = self.events
                while index < len(events):
                    index += 1
                    yield events[index - 1]
                end = self.stopped or self.end
                if end is not None:
                    if index == len(events):
                        yield end
                    return
                if self.pings != pings:
                    pings = self.pings
                    yield PING
                    continue
                if self._pinger is None and self.first_token_at is not None:
                    self._pinger = self._loop.call_at(self._last + self.keepalive_s, self._ping)
                await self._changed.wait()
        finally:
            self.readers -= 1
            if not self.readers and self.end is None and self.stopped is None:
                self._grace = self._loop.call_later(self.grace_s, self.stop, ABANDONED)

    def follow(self) -> AsyncGenerator[Event, None]:
        """The source's events from the first, then its outcome: the source of an identical
        request that joined this one. It keeps the source running (counted from now) while this
        one's own client stops or leaves."""
        self.followers += 1
        return self._follow()

    async def _follow(self) -> AsyncGenerator[Event, None]:
        index = 0
        try:
            while True:
                events = self.events
                while index < len(events):
                    index += 1
                    yield events[index - 1]
                if self.outcome is not None:
                    yield self.outcome
                    return
                await self._changed.wait()
        finally:
            self.followers -= 1
            if not self.followers and self.stopped is not None and self.outcome is None and self._task:
                self._task.cancel()

    def _wake(self) -> None:
        self._changed.set()
        self._changed.clear()

    def _ping(self) -> None:
        self._pinger = None
        if self.end is not None or not self.readers:
            return
        now = self._loop.time()
        if now >= self._last + self.keepalive_s:
            self._last = now
            self.pings += 1
            self._wake()
        else:
            self._pinger = self._loop.call_at(self._last + self.keepalive_s, self._ping)


class Generations:
    """This event loop's generations: live ones by id and answer key, and the latest `KEEP`
    ended ones by id for `keep_s` more (a late resume); and the open streams it counts (the
    admitted requests and the generations they started), in all and by client."""

    KEEP = 10_000

    def __init__(self) -> None:
        self.by_id: dict[str, Generation] = {}
        self.by_key: dict[str, Generation] = {}
        self.live: set[Generation] = set()
        self.ended_ids: deque[tuple[float, str]] = deque()
        self.open = 0
        self.per_client: Counter[str] = Counter()
        self.draining = False

    def add(self, generation: Generation, key: str = "") -> None:
        self.by_id[generation.id] = generation
        self.live.add(generation)
        if key:
            self.by_key[key] = generation

    def ended(self, generation: Generation, key: str = "", *, keep_s: float = 0) -> None:
        self.live.discard(generation)
        if key and self.by_key.get(key) is generation:
            del self.by_key[key]
        now = asyncio.get_running_loop().time()
        self.ended_ids.append((now + keep_s, generation.id))
        while self.ended_ids and (self.ended_ids[0][0] <= now or len(self.ended_ids) > self.KEEP):
            self.by_id.pop(self.ended_ids.popleft()[1], None)

    def joinable(self, key: str) -> Generation | None:
        generation = self.by_key.get(key)
        return generation if generation is not None and generation.stopped is None else None

    async def drain(self, timeout_s: float, error: Error) -> int:
        """Take no more; wait up to `timeout_s` for the open streams to end (those admitted just
        before included), then stop the rest with `error` and wait for them to close. Returns
        how many were stopped."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self.open or self.live) and (left := deadline - loop.time()) > 0:
            if self.live:
                closing = [generation.closed for generation in self.live]
                await asyncio.wait(closing, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            else:  # admitted, its generation not started yet
                await asyncio.sleep(min(left, 0.05))
        cut = list(self.live)
        for generation in cut:
            generation.stop(error)
        if cut:
            await asyncio.wait([generation.closed for generation in cut], timeout=5)
        return len(cut)


_registries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Generations] = weakref.WeakKeyDictionary()


def generations() -> Generations:
    """The running event loop's generations (one loop per server process)."""
    loop = asyncio.get_running_loop()
    registry = _registries.get(loop)
    if registry is None:
        registry = _registries[loop] = Generations()
    return registry


async def replay(events: list[Event], pacing_s: float) -> AsyncGenerator[Event, None]:
    """A finished answer again, one token every `pacing_s`, so that it still reads as writing."""
    paced = False
    for event in events:
        if type(event) is Token:
            if paced:
                await asyncio.sleep(pacing_s)
            paced = True
        yield event
