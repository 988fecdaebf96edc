"""One stream: one list of events, read by any number of readers from an offset.

    streams = Streams(Endings(...))
    stream = streams.open("id-1", key="...", grace_s=10)
    stream.start(source, on_end)          # its own task: the source's events, then on_end, then the end
    stream.read(after)                    # what a connection reads: the events after the `after`-th
    stream.stop(error)                    # end it now

A stream owns its life: it runs its source in a task of its own, then awaits `on_end(stream,
end)` (the caller's record: a log row, a cache, a bill), and survives its failure; only then do its
readers see the end. A dropped connection is not a stop: with no reader left, the stream runs on
for `grace_s` (the client can resume), then stops with `Endings.abandoned`. `stop(error)` ends it
now: its source is cancelled (the upstream closes) unless an identical request follows it
(`follow()`), which keeps the source running; its own readers end with `error` at once.

`Streams` keeps a process's streams by id (resume, stop) and by key (an identical request joins one
in flight); an ended stream stays findable by id for `keep_s`, for a late resume.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from .events import Done, Error, Event, Ping, Token

__all__ = ["Endings", "OnEnd", "Stream", "Streams", "replay"]

logger = logging.getLogger(__name__)

PING = Ping()
#: What the caller does with a stream once its source has ended, before its readers see the end.
OnEnd = Callable[["Stream", "Done | Error"], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Endings:
    """The errors a stream ends with by itself, in the caller's words."""

    #: nobody came back within the grace: it was stopped
    abandoned: Error
    #: the source ended without a Done or an Error
    ended_early: Error
    #: the source, or `on_end`, raised
    failed: Error


class Stream:
    def __init__(
        self,
        id: str,
        endings: Endings,
        *,
        grace_s: float = 0,
        keepalive_s: float = 15,
        key: str = "",
        events: Sequence[Event] = (),
    ) -> None:
        self.id = id
        self.key = key
        #: its events so far (`events`: those known before its source runs, a Meta say)
        self.events: list[Event] = list(events)
        self.readers = 0
        self.followers = 0
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        self.first_token_at: float | None = None
        self.grace_s = grace_s
        self.keepalive_s = keepalive_s
        #: resolved with what readers end with, once they may see it
        self.closed: asyncio.Future[Done | Error] = loop.create_future()
        self._endings = endings
        self._loop = loop
        self._outcome: Done | Error | None = None  # the source's last event, once it came
        self._stopped: Error | None = None  # why it was stopped before its outcome
        self._end: Done | Error | None = None
        self._pings = 0
        self._last = self.started_at  # when the latest event (or ping) went out
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._grace: asyncio.TimerHandle | None = None
        self._pinger: asyncio.TimerHandle | None = None
        self._on_ended: Callable[[Stream], None] | None = None

    @property
    def stopped(self) -> Error | None:
        """Why it was stopped before its source ended (a stop, abandonment, a drain), if it was."""
        return self._stopped

    # -- its life ----------------------------------------------------------------------------

    def start(self, source: AsyncGenerator[Event, None], on_end: OnEnd | None = None) -> None:
        """Run `source` in a task of its own, then `on_end`, then let readers see the end."""
        self._task = self._loop.create_task(self._live(source, on_end))

    async def _live(self, source: AsyncGenerator[Event, None], on_end: OnEnd | None) -> None:
        end: Done | Error = self._endings.failed
        try:
            end = await self._run(source)
            if on_end is not None:
                await on_end(self, end)
        except asyncio.CancelledError:
            raise  # the loop is going away
        except Exception:
            logger.exception("stream %s: its end could not be recorded", self.id)
        finally:
            if self._on_ended is not None:
                self._on_ended(self)
            self._close(end)

    async def _run(self, source: AsyncGenerator[Event, None]) -> Done | Error:
        """Publish `source`'s events up to its Done or Error; what the readers will end with
        (that, or the stop's error). A stop cancels this, unless the stream is followed."""
        self._running = True
        try:
            async with aclosing(source):
                if self._stopped is None:  # (else it was stopped before it ran)
                    async for event in source:
                        if type(event) is Done or type(event) is Error:
                            self._outcome = event
                            break
                        first = self.first_token_at is None and type(event) is Token
                        if first:
                            self.first_token_at = self._loop.time()
                        self.events.append(event)
                        self._last = self._loop.time()
                        self._wake()
                        if first and (self.readers or self.followers):
                            # The first token reaches its readers before the rest of a burst
                            # (a fast model, a read holding many events) is published; the
                            # rest go out as they come, together when they came together.
                            await asyncio.sleep(0)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or self._stopped is None:
                raise  # not a stop of ours: the loop is going away
            task.uncancel()
        except Exception:
            logger.exception("stream %s: its source failed", self.id)
            self._outcome = self._endings.failed
        finally:
            self._running = False
        if self._outcome is None:
            self._outcome = self._stopped or self._endings.ended_early
        self._wake()  # followers see the outcome now
        return self._stopped or self._outcome

    def _close(self, end: Done | Error) -> None:
        self._end = end
        for timer in (self._grace, self._pinger):
            if timer is not None:
                timer.cancel()
        if not self.closed.done():
            self.closed.set_result(end)
        self._wake()

    def stop(self, error: Error) -> bool:
        """End it now: its readers end with `error`, and its source is cancelled unless another
        stream follows it. False when it had ended or been stopped already."""
        if self._outcome is not None or self._stopped is not None:
            return False
        self._stopped = error
        if self._grace is not None:
            self._grace.cancel()
        if not self.followers and self._running and self._task is not None:
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
        index, pings = after, self._pings
        try:
            while True:
                events = self.events
                while index < len(events):
                    index += 1
                    yield events[index - 1]
                end = self._stopped or self._end
                if end is not None:
                    if index == len(events):
                        yield end
                    return
                if self._pings != pings:
                    pings = self._pings
                    yield PING
                    continue
                if self._pinger is None and self.first_token_at is not None:
                    self._pinger = self._loop.call_at(self._last + self.keepalive_s, self._ping)
                await self._changed.wait()
        finally:
            self.readers -= 1
            if not self.readers and self._end is None and self._stopped is None:
                self._grace = self._loop.call_later(self.grace_s, self.stop, self._endings.abandoned)

    def follow(self) -> AsyncGenerator[Event, None]:
        """The source's events from the first, then its outcome: the source of an identical
        request that joins this one. It keeps the source running (counted from now) while this
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
                if self._outcome is not None:
                    yield self._outcome
                    return
                await self._changed.wait()
        finally:
            self.followers -= 1
            if not self.followers and self._stopped is not None and self._outcome is None and self._running:
                assert self._task is not None
                self._task.cancel()

    def _wake(self) -> None:
        self._changed.set()
        self._changed.clear()

    def _ping(self) -> None:
        self._pinger = None
        if self._end is not None or not self.readers:
            return
        now = self._loop.time()
        if now >= self._last + self.keepalive_s:
            self._last = now
            self._pings += 1
            self._wake()
        else:
            self._pinger = self._loop.call_at(self._last + self.keepalive_s, self._ping)


class Streams:
    """A process's streams: the live ones by id and by key, and the latest `keep` ended ones by id
    for `keep_s` more (a late resume)."""

    def __init__(self, endings: Endings, *, keep: int = 10_000, keep_s: float = 300) -> None:
        self.endings = endings
        self.keep, self.keep_s = keep, keep_s
        self.live: set[Stream] = set()
        self._by_id: dict[str, Stream] = {}
        self._by_key: dict[str, Stream] = {}
        self._ended: deque[tuple[float, str]] = deque()

    def open(
        self,
        id: str,
        *,
        key: str = "",
        grace_s: float = 0,
        keepalive_s: float = 15,
        events: Sequence[Event] = (),
    ) -> Stream:
        """A new stream, found by `id` (and, while it is live, by `key`, unless empty)."""
        stream = Stream(id, self.endings, grace_s=grace_s, keepalive_s=keepalive_s, key=key, events=events)
        stream._on_ended = self._ended_one
        self._by_id[id] = stream
        self.live.add(stream)
        if key:
            self._by_key[key] = stream
        return stream

    def get(self, id: str) -> Stream | None:
        return self._by_id.get(id)

    def joinable(self, key: str) -> Stream | None:
        """The live stream of `key` that an identical request may follow."""
        stream = self._by_key.get(key)
        return stream if stream is not None and stream.stopped is None else None

    def _ended_one(self, stream: Stream) -> None:
        self.live.discard(stream)
        if stream.key and self._by_key.get(stream.key) is stream:
            del self._by_key[stream.key]
        now = asyncio.get_running_loop().time()
        self._ended.append((now + self.keep_s, stream.id))
        while self._ended and (self._ended[0][0] <= now or len(self._ended) > self.keep):
            self._by_id.pop(self._ended.popleft()[1], None)

    async def drain(self, timeout_s: float, error: Error) -> int:
        """Wait up to `timeout_s` for the live streams to end, then stop the rest with `error` and
        wait for them to close. Returns how many were stopped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.live and (left := deadline - loop.time()) > 0:
            closing = [stream.closed for stream in self.live]
            await asyncio.wait(closing, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        cut = list(self.live)
        for stream in cut:
            stream.stop(error)
        if cut:
            await asyncio.wait([stream.closed for stream in cut], timeout=5)
        return len(cut)


async def replay(events: list[Event], pacing_s: float) -> AsyncGenerator[Event, None]:
    """A finished answer again, one token every `pacing_s`, so that it still reads as writing."""
    paced = False
    for event in events:
        if type(event) is Token:
            if paced:
                await asyncio.sleep(pacing_s)
            paced = True
        yield event
