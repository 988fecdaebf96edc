"""Runs: one generation (one public id, one log row), which outlives the connections reading it.

    listener (one per connection, at an offset)  <-  run (one per generation)  <-  flight or replay

A run keeps the generation's events as clients see them (`history`: its Meta first, then what
its flight or its cache replay publishes, the terminal Done or Error last) and gathers its log
row as they come. The event numbered n (1-based) in `history` is the one a client names with
`Last-Event-ID: <public_id>:<n>`, whatever its transport: a connection is a Listener reading
`history` by index, so a resume is only a Listener that starts at n. A token is kept as its
text alone (a `str`, not a Token: the object would cost about 40 bytes more per token, for as
long as the run is kept), and made a Token again as it is handed on.

How a run ends decides its row:
- its flight or replay reaches Done or Error: the row (ok, error), then the terminal event;
- `stop()` (the Stop button, the stop endpoint, a WebSocket `cancel`): the upstream is closed
  at once, the row says cancelled/`stopped`;
- its last connection drops (`unsubscribe`): it keeps running for QUOTES_RESUME_GRACE_S, so the
  client can resume; if nobody does, the upstream is closed and the row says
  cancelled/`abandoned`.

Exactly one row per run, written before its terminal event is published, however many
connections come and go. A finished run's events stay in Django's cache for
QUOTES_RESUME_TTL_S (`resume` reads them from there once the run has left this process's
registry): with Redis as the cache that already works across processes. A resume of a run still
live in another process is the cross-process part: `resume()` is where a Redis-backed event log
would be read.

Feeding a run is synchronous (the flight's task calls `feed`): a token costs a few field
updates, one list append and one future wake-up per waiting connection, and no task hop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from django.core.cache import cache

from ...models import Generation
from ..errors import ErrorCode
from ..events import Done, Error, Event, Meta, Ping, Token, Usage
from ..limits import run_on_cache
from .admission import Ticket
from .flights import Flight, detached_task
from .log import Record
from .policy import timeout_error

logger = logging.getLogger(__name__)

#: How much longer than its flight a listener waits, so a live flight's own error comes first.
LISTENER_GRACE_S = 1.0

#: `<public_id>:<n>`: the generation's public id (a UUID) and an event's 1-based number.
EVENT_ID = re.compile(r"([0-9a-fA-F-]{36}):(\d{1,9})")

STOPPED = Error(ErrorCode.STOPPED, "The quote was stopped.", 409)
ABANDONED = Error(ErrorCode.ABANDONED, "Nobody came back for this quote: it was stopped.", 410)


def finished_key(public_id: str) -> str:
    return f"quotes:run:{public_id}"


class Run:
    __slots__ = (
        "_grace",
        "_log",
        "client_key",
        "closing",
        "ended",
        "finishing",
        "first_token_s",
        "flight",
        "grace_s",
        "history",
        "hit",
        "listeners",
        "public_id",
        "record",
        "task",
        "ticket",
        "ttl",
    )

    def __init__(
        self,
        *,
        record: Record,
        ticket: Ticket,
        log: Callable[[], Awaitable[None]],
        client_key: str,
        grace_s: float,
        ttl: int,
    ) -> None:
        self.record = record
        self.public_id = record.public_id
        self.ticket = ticket
        self._log = log
        self.client_key = client_key
        self.grace_s = grace_s
        self.ttl = ttl
        #: the events so far; a token as its text (see the module's docstring)
        self.history: list[Event | str] = []
        self.listeners: set[Listener] = set()
        self.flight: Flight | None = None
        self.task: asyncio.Task[None] | None = None  # a cache replay's driver
        self.first_token_s = math.inf
        #: a shared or cached answer: its Meta events say HIT
        self.hit = False
        #: the terminal event is known (the row and its publication may be on their way)
        self.closing = False
        #: the terminal event is in `history`
        self.ended = False
        self.finishing: asyncio.Task[None] | None = None
        self._grace: asyncio.TimerHandle | None = None
        runs[self.public_id] = self

    # -- the source -----------------------------------------------------------------------------

    def attach(self, flight: Flight) -> None:
        self.flight = flight
        self.first_token_s = flight.first_token_s
        flight.join(self)

    def drive(self, events: AsyncGenerator[Event, None]) -> None:
        """Feed `events` (a cache replay) from a task of the run's own."""

        async def replay() -> None:
            try:
                async for event in events:
                    self.feed(event)
                    if self.closing:
                        return
            finally:
                await events.aclose()

        self.task = detached_task(replay())

    def _detach(self) -> None:
        flight, self.flight = self.flight, None
        if flight is not None:
            flight.leave(self)  # the last run to leave cancels the flight: the upstream closes now
        task = self.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    # -- events in ------------------------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """One event from the source (hot path: no await, nothing computed twice)."""
        if self.closing:
            return
        if type(event) is Token:
            if self.record.ttft is None:
                self.record.ttft = time.perf_counter()
            self._publish(event.text)
            return
        if type(event) is Usage:
            self.record.usage = event
        elif type(event) is Meta:
            record = self.record
            record.model = event.model or record.model
            record.headers.update(event.headers)
            if event.step is not None:
                record.step = event.step
            if self.hit:
                event = Meta(model=event.model, headers=event.headers, step=event.step, cache_status="HIT")
        elif type(event) is Done:
            self._close(Generation.Status.OK, None, event)
            return
        elif type(event) is Error:
            busy = event.code is ErrorCode.BUSY
            self._close(Generation.Status.BUSY if busy else Generation.Status.ERROR, event, event)
            return
        self._publish(event)

    def _publish(self, event: Event | str) -> None:
        self.history.append(event)
        for listener in self.listeners:
            waiter = listener.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def stop(self) -> asyncio.Task[None] | None:
        """Stop at once, because the client asked: the upstream closes now, the row says
        `stopped`. The task that writes the row and ends the run, or None if it was ending."""
        if self.closing:
            return None
        self.fail(STOPPED, status=Generation.Status.CANCELLED)
        return self.finishing

    def abandon(self) -> None:
        """Nobody came back within the grace: stop, and say so on the row."""
        self._grace = None
        if not self.closing and not self.listeners:
            self.fail(ABANDONED, status=Generation.Status.CANCELLED)

    def fail(self, error: Error, *, status: str = Generation.Status.ERROR) -> None:
        """End early with `error` (not from the source): the upstream is closed now."""
        if self.closing:
            return
        self._close(status, error, error)
        self._detach()

    def _close(self, status: str, error: Error | None, terminal: Event) -> None:
        # The source is left in _finish, not here: feed() may be running inside the flight's
        # loop over its runs, which must not change under it.
        self.closing = True
        self.record.status = status
        self.record.error = error
        self._cancel_grace()
        self.finishing = detached_task(self._finish(terminal))

    async def _finish(self, terminal: Event) -> None:
        try:
            self._detach()
            await self.ticket.release_client_slot()  # before the client hears "done" and asks again
            self.record.parts = [entry for entry in self.history if type(entry) is str]
            await self._log()  # the row, before anyone hears the end
            self._publish(terminal)
            self.ended = True
            if self.ttl > 0:
                try:
                    await run_on_cache(
                        cache.set,
                        finished_key(self.public_id),
                        (self.client_key, self.history),
                        timeout=self.ttl,
                    )
                except Exception:  # a cache that is down costs a late resume, never this answer
                    logger.exception("could not keep a finished generation for resuming")
        finally:
            if runs.get(self.public_id) is self:
                del runs[self.public_id]
            await self.ticket.release()

    # -- connections ----------------------------------------------------------------------------

    def subscribe(self, index: int, *, keepalive_s: float, idle_s: float) -> Listener:
        self._cancel_grace()
        listener = Listener(self, index, keepalive_s=keepalive_s, idle_s=idle_s)
        self.listeners.add(listener)
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        self.listeners.discard(listener)
        if self.listeners or self.closing:
            return
        if self.grace_s <= 0:
            self.abandon()
        else:
            self._grace = asyncio.get_running_loop().call_later(self.grace_s, self.abandon)

    def _cancel_grace(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def meta_until(self, index: int) -> Meta:
        """What the first `index` events said about the generation (a resumed response's headers)."""
        meta = Meta()
        for event in self.history[:index]:
            if type(event) is Meta:
                meta = meta.merged(event)
        return meta


#: The runs of this process not yet ended, by public id.
runs: dict[str, Run] = {}


class Listener:
    """One connection's view of a run: its events from `index` on, keep-alive pings while it is
    quiet, and deadlines of its own (to the first token, then between events) so that whatever
    becomes of the flight, the run ends with the timeout error the flight would give."""

    __slots__ = (
        "_handle",
        "_ping_due",
        "_quiet_since",
        "_timed_out",
        "deadline",
        "idle_s",
        "index",
        "keepalive_s",
        "run",
        "started",
        "waiter",
    )

    def __init__(self, run: Run, index: int, *, keepalive_s: float, idle_s: float) -> None:
        self.run = run
        self.keepalive_s = keepalive_s
        self.idle_s = idle_s
        #: the next event of the run's history to hand on; after a yield, the event's number n
        self.index = index
        self.waiter: asyncio.Future[None] | None = None
        self.started = run.record.ttft is not None
        self.deadline = math.inf
        self._quiet_since = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._ping_due = False
        self._timed_out = False

    async def events(self) -> AsyncGenerator[Event, None]:
        loop = asyncio.get_running_loop()
        run = self.run
        history = run.history
        now = loop.time()
        self._quiet_since = now
        self.deadline = now + (self.idle_s if self.started else run.first_token_s) + LISTENER_GRACE_S
        try:
            while True:
                if self.index < len(history):
                    entry = history[self.index]
                    self.index += 1
                    if type(entry) is str:
                        event: Event = Token(entry)
                        self.started = True
                    else:
                        event = entry  # type: ignore[assignment]
                    kind = type(event)
                    now = loop.time()
                    self._quiet_since = now
                    if self.started:
                        self.deadline = now + self.idle_s + LISTENER_GRACE_S
                    yield event
                    if kind is Done or kind is Error:
                        return
                    continue
                if run.ended:
                    return  # resumed at the last event: nothing more to say
                self.waiter = loop.create_future()
                if self._handle is None:
                    self._arm(loop)
                try:
                    await self.waiter
                finally:
                    self.waiter = None
                if self._timed_out:
                    self._timed_out = False
                    self.deadline = math.inf
                    # The run ends with the error this connection waited too long for.
                    run.fail(timeout_error(started=self.started, total=False))
                    continue
                if self._ping_due:
                    self._ping_due = False
                    yield Ping()
        finally:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            run.unsubscribe(self)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        due = min(self._quiet_since + self.keepalive_s, self.deadline)
        self._handle = loop.call_at(due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """The one timer: re-armed at the next due time while the listener is waiting; left
        off while it is busy (the next wait arms it again)."""
        self._handle = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        now = loop.time()
        if now >= self.deadline:
            self._timed_out = True
            waiter.set_result(None)
        elif now >= self._quiet_since + self.keepalive_s:
            self._quiet_since = now  # the next ping, another interval on
            self._ping_due = True
            waiter.set_result(None)
        else:
            self._arm(loop)


# -- resuming -------------------------------------------------------------------------------------


class Cursor:
    """Where a connection is in its generation, for the transports to number what they send:
    after each event, `position.index` is that event's n. Set once the run exists."""

    __slots__ = ("position", "public_id", "resumed", "run", "sse_prefix")

    def __init__(self) -> None:
        self.public_id = ""
        self.sse_prefix = b""
        self.position: Listener | Replayer | None = None
        self.run: Run | None = None
        #: a resume: the transport sends no opening of its own (the client had it)
        self.resumed = False

    def bind(self, public_id: str, position: Listener | Replayer, run: Run | None) -> None:
        self.public_id = public_id
        self.sse_prefix = b"id: " + public_id.encode() + b":"
        self.position = position
        self.run = run


class Replayer:
    """A finished generation's events from the cache, from `index` on (a late resume)."""

    __slots__ = ("events_", "index")

    def __init__(self, events: list[Event | str], index: int) -> None:
        self.events_ = events
        self.index = index

    async def events(self) -> AsyncGenerator[Event, None]:
        events = self.events_
        while self.index < len(events):
            entry = events[self.index]
            self.index += 1
            yield Token(entry) if type(entry) is str else entry  # type: ignore[misc]


def parse_event_id(value: object) -> tuple[str, int] | None:
    if not isinstance(value, str):
        return None
    match = EVENT_ID.fullmatch(value.strip())
    if match is None:
        return None
    return match[1].lower(), int(match[2])


@dataclass(frozen=True, slots=True)
class Resumed:
    meta: Meta
    events: AsyncGenerator[Event, None]
    cursor: Cursor


async def resume(public_id: str, after: int, *, keepalive_s: float, idle_s: float) -> Resumed | None:
    """The events of generation `public_id` after the `after`-th, then the live rest: from the
    run in this process, else from its finished events in the cache; None when neither has it
    (unknown, expired, or `after` beyond what it sent)."""
    cursor = Cursor()
    cursor.resumed = True
    run = runs.get(public_id)
    if run is not None and after <= len(run.history):
        listener = run.subscribe(after, keepalive_s=keepalive_s, idle_s=idle_s)
        cursor.bind(public_id, listener, run)
        return Resumed(run.meta_until(after), listener.events(), cursor)
    try:
        stored = await run_on_cache(cache.get, finished_key(public_id))
    except Exception:
        logger.exception("could not read a finished generation for resuming")
        return None
    if not isinstance(stored, tuple) or len(stored) != 2:
        return None
    events: list[Event | str] = stored[1]
    if after > len(events):
        return None
    replayer = Replayer(events, after)
    cursor.bind(public_id, replayer, None)
    meta = Meta()
    for event in events[:after]:
        if type(event) is Meta:
            meta = meta.merged(event)
    return Resumed(meta, replayer.events(), cursor)


async def finished_owner(public_id: str) -> str | None:
    """The client key of a finished generation still kept for resuming."""
    try:
        stored = await run_on_cache(cache.get, finished_key(public_id))
    except Exception:
        return None
    return stored[0] if isinstance(stored, tuple) and len(stored) == 2 else None
