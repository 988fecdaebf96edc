"""Runs: one generation (one public id, one log row), which outlives the connections reading it.

    listener (one per connection, at an offset)  <-  run (one per generation)  <-  flight or replay

A run keeps the generation's events as clients see them (`log`, an EventLog: its Meta first,
then what its flight or its cache replay publishes, the terminal Done or Error last) and
gathers its row as they come. The event numbered n (1-based) in the log is the one a client
names with `Last-Event-ID: <public_id>.<resume key>:<n>` (`resume_key`), whatever its transport:
a connection is a Listener reading the log by index, so a resume is a Listener that starts at n.

How a run ends decides its row:
- its flight or replay reaches Done or Error: the row (ok, error), then the terminal event;
- `stop()` (the Stop button, the stop endpoint, a WebSocket `cancel`): the upstream is closed
  at once, the row says cancelled/`stopped`;
- its last connection drops (`unsubscribe`): it keeps running for QUOTES_RESUME_GRACE_S, so the
  client can resume; if nobody does, the upstream is closed and the row says
  cancelled/`abandoned`;
- the drain's deadline (`end_for_drain`): the upstream is closed, the row says
  cancelled/`server_draining`, and its connections hear Reconnect (they resume elsewhere).

Exactly one row per run, written before its terminal event is published, however many
connections come and go. A finished run's events stay in Django's cache for
QUOTES_RESUME_TTL_S (`resume` reads them from there once the run has left this process's
registry): with Redis as the cache that already works across processes. With REDIS_URL set, a
live run's events also go to Redis as they come (shared_runs.py), so `resume()` on a process that does
not hold the run reads them there and follows the live rest.

Feeding a run is synchronous (the flight's task calls `feed`): a token costs a few field
updates, one list append and one future wake-up per waiting connection, and no task hop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
from array import array
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache

from ...models import Generation
from ..cache import misfit
from ..errors import ErrorCode, stopped
from ..events import Done, Error, Event, Meta, Ping, Reconnect, Token, Usage, decode_events, encode_events
from ..limits import run_on_cache
from ..redis_health import report
from . import shared_runs
from .admission import CUT_GRACE_S, Entry, Ticket, admit, drain, enter, open_streams, server_draining
from .flights import Flight
from .rows import Record, RowFacts, lost_row, write_row, writer
from .tasks import detached_task

logger = logging.getLogger(__name__)

#: `<public_id>.<resume key>:<n>`: the generation's id (a UUID), its `resume_key`, an event's number.
EVENT_ID = re.compile(r"([0-9a-fA-F-]{36})\.([0-9a-f]{16}):(\d{1,9})")

STOPPED = stopped()
RECONNECT = Reconnect()
ABANDONED = Error(ErrorCode.ABANDONED, "Nobody came back for this quote: it was stopped.", 410)


def finished_key(public_id: str) -> str:
    return f"quotes:run:{public_id}"


#: Tokens kept one by one before they are joined into one string.
JOIN_EVERY = 64


class EventLog:
    """A generation's events in order, numbered from 1, kept compactly: a stream may run for
    minutes, and a Token (or even a str) per token would cost about 50 bytes each besides its
    characters. Token texts are joined every JOIN_EVERY tokens, each token remembered by its
    end offset (4 bytes); other events are kept as they are. Reading one back makes a Token
    again. A finished log goes to the cache as JSON (events.encode_events).

    This is the interface a log kept elsewhere (Redis, for a resume on another process) would
    offer: `append`, `len`, `at(i)`, `meta_until(n)`, `text`.
    """

    __slots__ = ("_chunks", "_ends", "_others", "_slots", "_tail")

    def __init__(self) -> None:
        #: per event: a token's ordinal (>= 0), or -1 - its index in `_others`
        self._slots = array("i")
        #: per token: the offset its text ends at, within its chunk
        self._ends = array("I")
        self._chunks: list[str] = []  # JOIN_EVERY tokens' texts each
        self._tail: list[str] = []  # the latest tokens' texts, not yet joined
        self._others: list[Event] = []

    @classmethod
    def of(cls, events: Iterable[Event]) -> EventLog:
        log = cls()
        for event in events:
            log.append(event)
        return log

    def __len__(self) -> int:
        return len(self._slots)

    def append(self, event: Event) -> None:
        if type(event) is Token:
            tail = self._tail
            ordinal = len(self._ends)
            self._slots.append(ordinal)
            start = self._ends[-1] if tail else 0
            self._ends.append(start + len(event.text))
            tail.append(event.text)
            if len(tail) == JOIN_EVERY:
                self._chunks.append("".join(tail))
                tail.clear()
        else:
            self._slots.append(-1 - len(self._others))
            self._others.append(event)

    def at(self, index: int) -> Event:
        """The event at 0-based `index` (the event numbered index + 1)."""
        slot = self._slots[index]
        if slot < 0:
            return self._others[-1 - slot]
        chunk, position = divmod(slot, JOIN_EVERY)
        if chunk == len(self._chunks):
            return Token(self._tail[position])
        start = self._ends[slot - 1] if position else 0
        return Token(self._chunks[chunk][start : self._ends[slot]])

    def meta_until(self, count: int) -> Meta:
        """What the first `count` events said about the generation (merged)."""
        meta = Meta()
        for index in range(count):
            slot = self._slots[index]
            if slot < 0 and type(event := self._others[-1 - slot]) is Meta:
                meta = meta.merged(event)
        return meta

    @property
    def text(self) -> str:
        return "".join(self._chunks) + "".join(self._tail)


class Run:
    __slots__ = (
        "_grace",
        "client_key",
        "closing",
        "ended",
        "finishing",
        "flight",
        "grace_s",
        "hit",
        "listeners",
        "log",
        "public_id",
        "publisher",
        "record",
        "row_facts",
        "stopped",
        "task",
        "ttl",
    )

    def __init__(
        self,
        *,
        record: Record,
        facts: RowFacts,
        client_key: str,
        grace_s: float,
        ttl: int,
    ) -> None:
        self.record = record
        self.public_id = record.public_id
        #: what its row says besides its outcome (and what another process needs to write it)
        self.row_facts = facts
        self.client_key = client_key
        self.grace_s = grace_s
        self.ttl = ttl
        self.log = EventLog()
        self.listeners: set[Listener] = set()
        self.flight: Flight | None = None
        self.task: asyncio.Task[None] | None = None  # a cache replay's driver
        #: a shared or cached answer: its Meta events say HIT
        self.hit = False
        #: the terminal event is known (the row and its publication may be on their way)
        self.closing = False
        #: the terminal event is in the log
        self.ended = False
        self.finishing: asyncio.Task[None] | None = None
        #: its client stopped it while another process read it: it goes on for that reader, and
        #: its row says stopped
        self.stopped = False
        self._grace: asyncio.TimerHandle | None = None
        #: sends the events to Redis for the other processes (only with REDIS_URL)
        self.publisher = shared_runs.Publisher(self) if shared_runs.available() else None
        runs[self.public_id] = self
        open_streams.run_started()

    @property
    def facts(self) -> dict[str, object]:
        """What another process needs to write this run's row (shared_runs), as Generation fields."""
        return self.row_facts.fields(self.record.model)

    # -- the source -----------------------------------------------------------------------------

    def attach(self, flight: Flight) -> None:
        self.flight = flight
        flight.join(self)

    def calls_upstream(self) -> None:
        """The other process's call this run's flight followed was given up before a token
        came, and the flight calls the upstream itself after all: not a shared answer any more
        (the row says miss, the Meta events say what the upstream's say)."""
        self.hit = False
        self.record.cache_status = Generation.CacheStatus.MISS

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
        elif type(event) is Usage:
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

    def _publish(self, event: Event) -> None:
        self.log.append(event)
        if self.publisher is not None:
            self.publisher.poke()
        for listener in self.listeners:
            waiter = listener.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def stop(self) -> bool:
        """Stop, because its client asked: its connections end with `stopped` now. Unless
        another process reads it (a follower, a resume: then it goes on for them, and ends
        when nobody reads it), the upstream closes now and the row says `stopped`. False when
        it was ending already."""
        if self.closing:
            return False
        if self.publisher is not None and await shared_runs.has_readers(self.public_id, followers=True):
            if self.closing:
                return False
            self.stopped = True
            for listener in list(self.listeners):
                listener.end(STOPPED)
            self.publisher.end_readers()  # the client's resumes on other processes end too
            return True
        if self.closing:
            return False
        self.fail(STOPPED, status=Generation.Status.CANCELLED)
        if self.finishing is not None:
            await asyncio.shield(self.finishing)  # the row is written when the answer says "stopped"
        for listener in list(self.listeners):
            listener.end(STOPPED)  # now, not after what it has yet to send
        return True

    def stop_asked(self) -> None:
        """Another process asked to stop this run for its client (shared_runs' sender)."""
        detached_task(self.stop())

    def abandon(self) -> None:
        """Nobody came back within the grace: end, unless another process reads it still."""
        self._grace = None
        if self.closing or self.listeners:
            return
        if self.publisher is None:
            self._abandon_now()
        else:
            detached_task(self._abandon_unless_read())

    async def _abandon_unless_read(self) -> None:
        read = await shared_runs.has_readers(self.public_id)
        if self.closing or self.listeners:
            return
        if read:  # look again a moment later: it ends once the last reader has gone
            self._grace = asyncio.get_running_loop().call_later(shared_runs.READER_RENEW_S, self.abandon)
        else:
            self._abandon_now()

    def _abandon_now(self) -> None:
        if self.stopped:
            self.fail(STOPPED, status=Generation.Status.CANCELLED)
        else:
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
        if self.stopped and status == Generation.Status.OK:
            # Its client stopped it; it went on for another process's reader: the row says
            # stopped (with the whole text and its usage, which that reader was given).
            status, error = Generation.Status.CANCELLED, STOPPED
        self.record.status = status
        self.record.error = error
        self._cancel_grace()
        self.finishing = detached_task(self._finish(terminal))

    async def _finish(self, terminal: Event) -> None:
        try:
            self._detach()
            self.record.text = self.log.text
            # The row, before anyone hears the end (waited for at most log.ROW_WAIT_S).
            await write_row(self.record, self.row_facts)
            self._publish(terminal)
            self.ended = True
            if self.ttl > 0:
                try:
                    await run_on_cache(
                        cache.set,
                        finished_key(self.public_id),
                        {
                            "client": self.client_key,
                            "events": encode_events(map(self.log.at, range(len(self.log)))),
                        },
                        timeout=self.ttl,
                    )
                except Exception as exc:  # a cache that is down costs a late resume, never this answer
                    report(logger, "could not keep a finished generation for resuming", exc)
        finally:
            if runs.get(self.public_id) is self:
                del runs[self.public_id]
            open_streams.run_ended()

    # -- connections ----------------------------------------------------------------------------

    def subscribe(self, index: int, *, ticket: Ticket, keepalive_s: float) -> Listener:
        self._cancel_grace()
        listener = Listener(self, index, ticket=ticket, keepalive_s=keepalive_s)
        self.listeners.add(listener)
        if drain.cut and not self.closing:  # made as the drain's deadline passed: cut at once
            self.fail(server_draining(), status=Generation.Status.CANCELLED)
            listener.end(RECONNECT)
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


#: The runs of this process not yet ended, by public id.
runs: dict[str, Run] = {}


async def end_for_drain() -> None:
    """The drain's deadline (and a test's end): every run still going ends as drained, upstream
    closed and row written, before the process closes its backends under it; its connections
    are told to resume elsewhere (Reconnect), once the row is written."""
    cut = 0
    for run in list(runs.values()):
        if not run.closing:
            run.fail(server_draining(), status=Generation.Status.CANCELLED)
            for listener in run.listeners:
                listener.end(RECONNECT)
                cut += 1
    if cut:
        logger.warning("draining: %d streams still open at the deadline were told to resume elsewhere", cut)
    ending = [run.finishing for run in list(runs.values()) if run.finishing is not None]
    if ending:
        await asyncio.wait(ending, timeout=CUT_GRACE_S)


class Listener:
    """One connection's view of a run: its events from `index` on, and keep-alive pings while it
    is quiet. Timeouts are not its business: the flight's policy enforces them, once (a flight
    that follows another process's run hears of its owner's death by its heartbeat)."""

    __slots__ = (
        "_ending",
        "_handle",
        "_ping_due",
        "_quiet_since",
        "index",
        "keepalive_s",
        "run",
        "ticket",
        "waiter",
    )

    def __init__(self, run: Run, index: int, *, ticket: Ticket, keepalive_s: float) -> None:
        self.run = run
        #: this connection's admission (quotes.ai.gateway.admission): given back at its end
        self.ticket = ticket
        #: the event this connection ends with, before its backlog (its client stopped it, or
        #: the drain's deadline passed)
        self._ending: Error | Reconnect | None = None
        self.keepalive_s = keepalive_s
        #: the next event of the run's history to hand on; after a yield, the event's number n
        self.index = index
        self.waiter: asyncio.Future[None] | None = None
        self._quiet_since = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._ping_due = False

    async def events(self) -> AsyncGenerator[Event, None]:
        loop = asyncio.get_running_loop()
        run = self.run
        log = run.log
        self._quiet_since = loop.time()
        try:
            while True:
                if self._ending is not None:  # a stop ends the connection now, not after its backlog
                    if run.finishing is not None:  # the row first (a drain's Reconnect)
                        await asyncio.shield(run.finishing)
                    await self.ticket.release_client_slot()
                    yield self._ending
                    return
                if self.index < len(log):
                    event = log.at(self.index)
                    self.index += 1
                    kind = type(event)
                    self._quiet_since = loop.time()
                    if kind is Done or kind is Error:
                        await self.ticket.release_client_slot()  # before the client hears the end
                        yield event
                        return
                    yield event
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
                if self._ping_due:
                    self._ping_due = False
                    yield Ping()
        finally:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            run.unsubscribe(self)
            await self.ticket.release()

    def end(self, last: Error | Reconnect) -> None:
        """End this connection with `last` (the run goes on for other readers, or ends: a drain)."""
        self._ending = last
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = loop.call_at(self._quiet_since + self.keepalive_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """The one timer: re-armed at the next due time while the listener is waiting; left
        off while it is busy (the next wait arms it again)."""
        self._handle = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        now = loop.time()
        if now >= self._quiet_since + self.keepalive_s:
            self._quiet_since = now  # the next ping, another interval on
            self._ping_due = True
            waiter.set_result(None)
        else:
            self._arm(loop)


# -- resuming -------------------------------------------------------------------------------------


def _elsewhere(event: Event) -> Event:
    """An event of a run read back from outside the process that held it: a drain's cut, which
    told the client to resume elsewhere, is a lost generation there (the drained process has
    closed its upstream; resuming again would only hear the same)."""
    if type(event) is Error and event.code is ErrorCode.SERVER_DRAINING:
        return shared_runs.generation_lost()
    return event


async def _held(events: AsyncGenerator[Event, None], ticket: Ticket) -> AsyncGenerator[Event, None]:
    """`events` read by a connection that holds `ticket` (a resume not served by a Listener)."""
    try:
        async for event in events:
            if type(event) is Done or type(event) is Error:
                await ticket.release_client_slot()  # before the client hears the end
            yield event
    finally:
        await events.aclose()
        await ticket.release()


async def replay(log: EventLog, index: int = 0, *, pacing: float = 0) -> AsyncGenerator[Event, None]:
    """A finished generation's events from the cache, from `index` on: a late resume's, or a
    cached answer's (generation.py), one token every `pacing` seconds so it still reads as writing."""
    paced = False
    for event in map(log.at, range(index, len(log))):
        if pacing and type(event) is Token:
            if paced:
                await asyncio.sleep(pacing)
            paced = True
        yield _elsewhere(event)


async def _read_elsewhere(
    public_id: str,
    log: EventLog,
    last: str,
    index: int,
    *,
    keepalive_s: float,
    facts: dict[str, object],
) -> AsyncGenerator[Event, None]:
    """A generation live (or just ended) in another process: what Redis held of it (`log`, up
    to entry `last`) from `index` on, then the live rest (shared_runs.follow) until its terminal
    event. A resume that ends with `generation_lost` (the owner died, or drained it) writes the
    generation's row, under its own id, if nobody has: the owner may never write it, and however
    many resumes find it lost, it has one row."""
    for i in range(index, len(log)):
        event = _elsewhere(log.at(i))
        await _row_if_lost(public_id, event, facts, log)
        yield event
    if len(log) and type(log.at(len(log) - 1)) in (Done, Error):
        return  # it had ended
    async for event in shared_runs.follow(public_id, last=last, keepalive_s=keepalive_s, seen=len(log)):
        event = _elsewhere(event)
        await _row_if_lost(public_id, event, facts, log)
        yield event


async def _row_if_lost(public_id: str, event: Event, facts: dict[str, object], log: EventLog) -> None:
    if type(event) is not Error or event.code is not ErrorCode.GENERATION_LOST or not facts:
        return
    try:
        await writer.write(lost_row(public_id, facts, log.text, event.message))
    except asyncio.CancelledError:
        raise  # the row is queued: it is written all the same
    except Exception:
        logger.exception("could not write the log row of a resume")


def resume_key(public_id: str) -> str:
    """The secret half of a generation's event ids, which only its own stream carries: its id
    (a permalink's) alone reads nothing. Keyed with the SECRET_KEY, so every process checks it
    with nothing stored, and not tied to an address (a phone that changes networks resumes)."""
    return hmac.new(
        settings.SECRET_KEY.encode(), b"resume:" + public_id.encode(), hashlib.sha256
    ).hexdigest()[:16]


def parse_event_id(value: object) -> tuple[str, str, int] | None:
    """(public id, resume key, number) of a well-formed event id, else None."""
    if not isinstance(value, str):
        return None
    match = EVENT_ID.fullmatch(value.strip())
    if match is None:
        return None
    return match[1].lower(), match[2], int(match[3])


@dataclass(frozen=True, slots=True)
class Resumed:
    """A resume: the facts its client had (the generation's id among them), the number of the
    last event it had, and the events after it."""

    meta: Meta
    after: int
    events: AsyncGenerator[Event, None]

    @classmethod
    def of(cls, public_id: str, log: EventLog, after: int, events: AsyncGenerator[Event, None]) -> Resumed:
        return cls(log.meta_until(after).merged(Meta(generation_id=public_id)), after, events)


async def resume(
    public_id: str, key: str, after: int, *, client_key: str, admitted: Entry | Error | None = None
) -> Resumed | Error | None:
    """The events of generation `public_id` after the `after`-th, then the live rest: from the
    run in this process, else from its finished events in the cache, else (with REDIS_URL) from
    its events in Redis, live in another process; None when none has it (unknown, expired, or
    `after` beyond what it sent), or when `key` is not its resume key (then as for an unknown
    id, before any run is touched). A draining process serves only the runs it holds: any
    other resume is refused like a new stream (the server_draining Error; nginx asks another
    process), for it could outlive the drain's cut and be closed at exit without a word.

    A resume is a connection like a new stream's: admitted (quotes.ai.gateway.admission) before
    anything is read for it, refused with the admission's Error (429 too many streams, 503 at
    the cap), and holding its ticket while it reads. `admitted`: the process's decision on it
    (admission.enter), but for the drain's refusal, which spares a run held here."""
    if not hmac.compare_digest(key, resume_key(public_id)):
        return None
    run = runs.get(public_id)
    here = run is not None and after <= len(run.log)
    if drain.draining and not here:
        return server_draining()
    options = settings.QUOTES_GATEWAY
    if admitted is None or (isinstance(admitted, Error) and admitted.code is ErrorCode.SERVER_DRAINING):
        admitted = enter(options, while_draining=here)
    ticket = await admit(client_key, options, admitted=admitted, new=False)
    if isinstance(ticket, Error):
        return ticket
    try:
        found = await _resume(public_id, after, ticket=ticket, keepalive_s=options.keepalive_s)
    except BaseException:
        await ticket.release()
        raise
    if not isinstance(found, Resumed):
        await ticket.release()
    return found


async def _resume(
    public_id: str, after: int, *, ticket: Ticket, keepalive_s: float
) -> Resumed | Error | None:
    run = runs.get(public_id)
    if run is not None and after <= len(run.log):
        listener = run.subscribe(after, ticket=ticket, keepalive_s=keepalive_s)
        return Resumed.of(public_id, run.log, after, listener.events())
    if drain.draining:
        return server_draining()
    if shared_runs.available():
        # Redis first: it has the run live in another process, or just ended (with what a
        # resume needs to log itself if the run was lost).
        elsewhere = await _resume_elsewhere(public_id, after, ticket=ticket, keepalive_s=keepalive_s)
        if elsewhere is not None:
            return elsewhere
    finished = await _finished(public_id)
    if finished is None:
        return None
    log = finished[1]
    if after > len(log):
        return None
    return Resumed.of(public_id, log, after, _held(replay(log, after), ticket))


async def _resume_elsewhere(
    public_id: str, after: int, *, ticket: Ticket, keepalive_s: float
) -> Resumed | None:
    found = await shared_runs.read(public_id)
    if found is None:
        return None
    held, last, facts = found
    if after > len(held):
        return None
    log = EventLog()
    for event in held:
        log.append(event)
    events = _read_elsewhere(public_id, log, last, after, keepalive_s=keepalive_s, facts=facts)
    return Resumed.of(public_id, log, after, _held(events, ticket))


async def stop(public_id: str, client_key: str) -> bool | None:
    """Stop generation `public_id` at once for the client that started it, wherever it runs:
    in this process, or (with REDIS_URL) in another one. True when it was stopped now, False
    when it had ended already (nothing left to stop), None when this client has no such
    generation (unknown, someone else's, or forgotten)."""
    run = runs.get(public_id)
    if run is not None:
        if run.client_key != client_key:
            return None
        return await run.stop()
    if shared_runs.available():
        stopped = await shared_runs.stop_elsewhere(public_id, client_key)
        if stopped is not None:
            return stopped
    finished = await _finished(public_id)
    return False if finished is not None and finished[0] == client_key else None


async def _finished(public_id: str) -> tuple[str, EventLog] | None:
    """A finished generation's (client key, events), kept in the cache for resumes
    (QUOTES_RESUME_TTL_S); None when gone, or when the cache cannot say."""
    try:
        stored = await run_on_cache(cache.get, finished_key(public_id))
    except Exception as exc:
        report(logger, "could not read a finished generation", exc)
        return None
    match stored:
        case {"client": str() as client_key, "events": list() as items, **rest} if not rest:
            try:
                return client_key, EventLog.of(decode_events(items))
            except ValueError:
                pass
    misfit("a finished generation", stored)
    return None
