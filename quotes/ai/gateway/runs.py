"""Runs: one generation (its public id, its row), outliving the connections that read it.

    listener (a connection, at an offset) <- run (a generation) <- flight (one source, one log)

A flight is one source of events: an upstream call under the retry policy, a cached answer
replayed, or another process's run followed. Its events go into one log, and every run on it
reads that log behind its own opening Meta: the request that started it, and identical requests
that joined it. A run ends with its own terminal event (the flight's, or its client's stop, its
abandonment, the drain's cut) and writes its row before that event can be read. The n-th event
of a run is the one a client names with `Last-Event-ID: <public id>.<resume key>:<n>`.
docs/architecture.md has the walk, and how each ending is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import time
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import cache

from ...models import Generation
from ..cache import misfit, store_answer
from ..errors import ErrorCode, internal, stopped
from ..events import Done, Error, Event, Meta, Ping, Reconnect, Token, Usage, decode_events, encode_events
from ..limits import run_on_cache
from ..redis_health import report
from . import shared_runs
from .admission import CUT_GRACE_S, Entry, Ticket, admit, drain, enter, open_streams, server_draining
from .policy import Plan, generate
from .rows import Record, RowFacts, lost_row, write_row, writer
from .tasks import detached_task

logger = logging.getLogger(__name__)

#: `<public_id>.<resume key>:<n>`: the generation's id (a UUID), its `resume_key`, an event's number.
EVENT_ID = re.compile(r"([0-9a-fA-F-]{36})\.([0-9a-f]{16}):(\d{1,9})")

STOPPED = stopped()
RECONNECT = Reconnect()
ABANDONED = Error(ErrorCode.ABANDONED, "Nobody came back for this quote: it was stopped.", 410)
HIT = Generation.CacheStatus.HIT


def finished_key(public_id: str) -> str:
    return f"quotes:run:{public_id}"


#: Tokens kept one by one before they are joined into one string.
JOIN_EVERY = 64


class EventLog:
    """Events in order, kept compactly (a Token object per token would cost about 50 bytes
    besides its text): token texts are joined every JOIN_EVERY tokens and remembered by their
    end offsets; other events are kept as they are. `at(i)` makes a Token again."""

    __slots__ = ("_chunks", "_ends", "_others", "_slots", "_tail")

    def __init__(self) -> None:
        self._slots = array("i")  # per event: a token's ordinal (>= 0), or -1 - its index in _others
        self._ends = array("I")  # per token: where its text ends in its chunk
        self._chunks: list[str] = []
        self._tail: list[str] = []  # the latest tokens' texts, not joined yet
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
            self._slots.append(len(self._ends))
            self._ends.append((self._ends[-1] if tail else 0) + len(event.text))
            tail.append(event.text)
            if len(tail) == JOIN_EVERY:
                self._chunks.append("".join(tail))
                tail.clear()
        else:
            self._slots.append(-1 - len(self._others))
            self._others.append(event)

    def at(self, index: int) -> Event:
        slot = self._slots[index]
        if slot < 0:
            return self._others[-1 - slot]
        chunk, position = divmod(slot, JOIN_EVERY)
        if chunk == len(self._chunks):
            return Token(self._tail[position])
        return Token(self._chunks[chunk][self._ends[slot - 1] if position else 0 : self._ends[slot]])

    def others(self, count: int) -> list[Event]:
        """The events other than tokens among the first `count`."""
        return [self._others[-1 - slot] for slot in self._slots[:count] if slot < 0]

    def text(self, count: int) -> str:
        """The text of the tokens among the first `count` events."""
        tokens = next((slot + 1 for slot in reversed(self._slots[:count]) if slot >= 0), 0)
        whole, rest = divmod(tokens, JOIN_EVERY)
        text = "".join(self._chunks[:whole])
        if rest and whole < len(self._chunks):
            text += self._chunks[whole][: self._ends[tokens - 1]]
        elif rest:
            text += "".join(self._tail[:rest])
        return text


def merged(events: Iterable[Event], meta: Meta | None = None) -> Meta:
    """What the Meta events among `events` say, merged in order."""
    meta = meta or Meta()
    for event in events:
        if type(event) is Meta:
            meta = meta.merged(event)
    return meta


class Flight:
    """One source of events, kept in one log that every run on it reads. A flight with an answer
    key is joined by identical requests (`flights`) and keeps its complete answer for `ttl` s.
    When its last run leaves, it is cancelled: the upstream closes, or the model thread stops."""

    def __init__(self, key: str = "", ttl: int = 0) -> None:
        self.key = key
        self.ttl = ttl
        self.log = EventLog()
        self.runs: list[Run] = []
        self.task: asyncio.Task[None] | None = None
        #: the terminal event, once published (a run joining later ends with it)
        self.ended: Event | None = None
        #: the first token's index in the log, and when it came
        self.first_token: tuple[int, float] | None = None
        if key:
            flights[key] = self

    def start(self, events: AsyncIterator[Event], *, plan: Plan | None = None, pacing: float = 0) -> None:
        """Publish `events` from a task of the flight's own: the policy's (an upstream call), a
        cached answer's (one token every `pacing` s, so that it still reads as writing), or
        another process's run's (shared_runs.follow; if its owner gives it up before a token,
        `plan` is called here after all; after a token, the generation is lost)."""
        self.task = detached_task(self._publish_all(events, plan, pacing))

    def join(self, run: Run) -> None:
        self.runs.append(run)
        if self.ended is not None:
            run.source_ended(self.ended)

    def leave(self, run: Run) -> None:
        if run in self.runs:
            self.runs.remove(run)
        if not self.runs and self.task is not None and not self.task.done():
            self.unregister()  # now: a request arriving while it unwinds starts its own
            self.task.cancel()  # nobody reads it: the upstream closes now

    def unregister(self) -> None:
        if self.key and flights.get(self.key) is self:
            del flights[self.key]

    def publish(self, event: Event) -> None:
        kind = type(event)
        if kind is Done or kind is Error:
            self.ended = event
            self.unregister()
            for run in list(self.runs):
                run.source_ended(event)
            return
        if kind is Token and self.first_token is None:
            self.first_token = (len(self.log), time.perf_counter())
        self.log.append(event)
        for run in self.runs:
            run.wake()

    async def _publish_all(self, events: AsyncIterator[Event], plan: Plan | None, pacing: float) -> None:
        paced = False
        try:
            async for event in events:
                if pacing and type(event) is Token:
                    if paced:
                        await asyncio.sleep(pacing)
                    paced = True
                if self.key and plan is None and type(event) is Done:  # its own upstream call's
                    # Cached before [DONE] goes out: a client that has seen the end can count on it.
                    await store_answer(self.key, [*map(self.log.at, range(len(self.log)))], ttl=self.ttl)
                self.publish(event)
        except asyncio.CancelledError:
            raise
        except shared_runs.OwnerGone:
            if self.first_token is not None or plan is None:
                self.publish(shared_runs.generation_lost())
                return
            if self.runs:  # this process's own call now: one of its rows counts what it costs
                self.runs[0].record.cache_status = Generation.CacheStatus.MISS
            await self._publish_all(generate(plan), None, 0)
        except Exception:
            logger.exception("a generation's source failed (flight %s)", self.key or "without a key")
            self.publish(internal())
        finally:
            self.unregister()


async def listed(events: Iterable[Event]) -> AsyncGenerator[Event, None]:
    for event in events:
        yield event


#: Flights that identical requests may join, by answer-cache key.
flights: dict[str, Flight] = {}


class Run:
    """One generation: its opening Meta, then its flight's log up to `cut`, then its terminal
    event (`end`), readable once its row is written. `stop()` ends its client's connections now;
    a run nobody reads any more ends after QUOTES_RESUME_GRACE_S (see docs/architecture.md)."""

    __slots__ = (
        "_grace",
        "client_key",
        "closing",
        "cut",
        "end",
        "facts",
        "finishing",
        "flight",
        "listeners",
        "opening",
        "public_id",
        "publisher",
        "record",
        "stopped",
    )

    def __init__(
        self, *, record: Record, facts: RowFacts, client_key: str, flight: Flight, claim: str = ""
    ) -> None:
        self.record = record
        self.public_id = record.public_id
        self.facts = facts
        self.client_key = client_key
        self.opening = Meta(
            model=record.model, cache_status=record.cache_status.upper(), generation_id=record.public_id
        )
        self.flight = flight
        self.listeners: set[Listener] = set()
        #: closed: its events end at this length of the flight's log
        self.cut: int | None = None
        self.end: Event | None = None
        self.closing = False
        self.finishing: asyncio.Task[None] | None = None
        #: its client stopped it while another process's follower read it: it goes on for that
        #: follower, and its row says stopped
        self.stopped = False
        self._grace: asyncio.TimerHandle | None = None
        self.publisher = shared_runs.Publisher(self.public_id, claim) if shared_runs.available() else None
        runs[self.public_id] = self
        open_streams.run_started()
        flight.join(self)
        self.wake()

    # -- its events -------------------------------------------------------------------------------

    def __len__(self) -> int:
        cut = self.cut
        return (len(self.flight.log) if cut is None else cut) + (1 if self.end is None else 2)

    def at(self, index: int) -> Event:
        if index == 0:
            return self.opening
        cut = self.cut
        if index <= (len(self.flight.log) if cut is None else cut):
            event = self.flight.log.at(index - 1)
            if type(event) is Meta and self.record.cache_status == HIT:
                return Meta(model=event.model, headers=event.headers, step=event.step, cache_status="HIT")
            return event
        assert self.end is not None
        return self.end

    def wake(self) -> None:
        if self.publisher is not None:
            poke(self)
        for listener in self.listeners:
            waiter = listener.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    # -- how it ends ------------------------------------------------------------------------------

    def source_ended(self, event: Event) -> None:
        if type(event) is Done:
            self._close(Generation.Status.OK, None, event)
        elif type(event) is Error:
            busy = event.code is ErrorCode.BUSY
            self._close(Generation.Status.BUSY if busy else Generation.Status.ERROR, event, event)

    async def stop(self) -> bool:
        """Its client's stop: its connections end with `stopped` now. Unless a follower on another
        process reads it (then it goes on for that one), the upstream closes now and the row says
        `stopped`. False when it was ending already."""
        if self.closing:
            return False
        if self.publisher is not None and await shared_runs.has_readers(self.public_id, followers=True):
            if self.closing:
                return False
            self.stopped = True
            self.publisher.stop_due = True  # its client's resumes on other processes end too
            self.wake()
        else:
            if self.closing:
                return False
            self.fail(STOPPED, status=Generation.Status.CANCELLED)
            if self.finishing is not None:
                await asyncio.shield(self.finishing)  # the row is written when the answer says "stopped"
        for listener in list(self.listeners):
            listener.end(STOPPED)  # now, not after what it has yet to send
        return True

    def abandon(self) -> None:
        """Nobody came back within the grace: end, unless another process reads it still."""
        self._grace = None
        if self.closing or self.listeners:
            return
        if self.publisher is None:
            self.fail(STOPPED if self.stopped else ABANDONED, status=Generation.Status.CANCELLED)
        else:
            detached_task(self._abandon_unless_read())

    async def _abandon_unless_read(self) -> None:
        read = await shared_runs.has_readers(self.public_id)
        if self.closing or self.listeners:
            return
        if read:  # look again a moment later: it ends once the last reader has gone
            self._grace = asyncio.get_running_loop().call_later(shared_runs.READER_RENEW_S, self.abandon)
        else:
            self.fail(STOPPED if self.stopped else ABANDONED, status=Generation.Status.CANCELLED)

    def fail(self, error: Error, *, status: str = Generation.Status.ERROR) -> None:
        """End now with `error`, not its flight's: the run leaves its flight at once."""
        if not self.closing:
            self._close(status, error, error)
            self.flight.leave(self)

    def _close(self, status: str, error: Error | None, terminal: Event) -> None:
        self.closing = True
        self.cut = len(self.flight.log)
        if self.stopped and status == Generation.Status.OK:
            # Stopped by its client, gone on for a follower elsewhere: its row says stopped.
            status, error = Generation.Status.CANCELLED, STOPPED
        self.record.status, self.record.error = status, error
        self._cancel_grace()
        self.finishing = detached_task(self._finish(terminal))

    async def _finish(self, terminal: Event) -> None:
        try:
            # Not in _close: it may run inside the flight's loop over its runs.
            self.flight.leave(self)
            record, log, cut = self.record, self.flight.log, self.cut or 0
            others = log.others(cut)
            meta = merged(others)
            record.model = meta.model or record.model
            record.headers.update(meta.headers)
            record.step = record.step if meta.step is None else meta.step
            record.usage = next((e for e in reversed(others) if type(e) is Usage), None)
            first = self.flight.first_token
            if first is not None and first[0] < cut:
                record.ttft = max(first[1], record.started)
            record.text = log.text(cut)
            await write_row(record, self.facts)  # before anyone hears the end (rows.ROW_WAIT_S at most)
            self.end = terminal
            self.wake()
            ttl = settings.QUOTES_GATEWAY.resume_ttl_s
            if ttl > 0:
                events = encode_events(map(self.at, range(len(self))))
                try:
                    stored = {"client": self.client_key, "events": events}
                    await run_on_cache(cache.set, finished_key(self.public_id), stored, timeout=ttl)
                except Exception as exc:  # a cache that is down costs a late resume, never this answer
                    report(logger, "could not keep a finished generation for resuming", exc)
        finally:
            if runs.get(self.public_id) is self:
                del runs[self.public_id]
            open_streams.run_ended()

    # -- its connections --------------------------------------------------------------------------

    def subscribe(self, index: int, *, ticket: Ticket) -> Listener:
        self._cancel_grace()
        listener = Listener(self, index, ticket=ticket)
        self.listeners.add(listener)
        if drain.cut and not self.closing:  # made as the drain's deadline passed: cut at once
            self.fail(server_draining(), status=Generation.Status.CANCELLED)
            listener.end(RECONNECT)
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        self.listeners.discard(listener)
        if self.listeners or self.closing:
            return
        grace_s = settings.QUOTES_GATEWAY.resume_grace_s
        if grace_s <= 0:
            self.abandon()
        else:
            self._grace = asyncio.get_running_loop().call_later(grace_s, self.abandon)

    def _cancel_grace(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None


#: The runs of this process not yet ended, by public id.
runs: dict[str, Run] = {}


async def end_for_drain() -> None:
    """The drain's deadline (and a test's end): every run still going ends as drained, its row
    written, and its connections are told to resume elsewhere (Reconnect)."""
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
    """One connection's view of a run: its events from `index` on, and a keep-alive Ping after
    each quiet `keepalive_s`. Timeouts are the flight's policy's, not its business."""

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

    def __init__(self, run: Run, index: int, *, ticket: Ticket) -> None:
        self.run = run
        self.ticket = ticket  # this connection's admission: given back at its end
        #: what this connection ends with before its backlog (its client's stop, the drain's cut)
        self._ending: Error | Reconnect | None = None
        self.keepalive_s = settings.QUOTES_GATEWAY.keepalive_s
        self.index = index
        self.waiter: asyncio.Future[None] | None = None
        self._quiet_since = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._ping_due = False

    async def events(self) -> AsyncGenerator[Event, None]:
        loop = asyncio.get_running_loop()
        run = self.run
        self._quiet_since = loop.time()
        try:
            while True:
                if self._ending is not None:
                    if run.finishing is not None:  # the row first (a drain's Reconnect)
                        await asyncio.shield(run.finishing)
                    await self.ticket.release_client_slot()
                    yield self._ending
                    return
                if self.index < len(run):
                    event = run.at(self.index)
                    self.index += 1
                    self._quiet_since = loop.time()
                    if type(event) is Done or type(event) is Error:
                        await self.ticket.release_client_slot()  # before the client hears the end
                        yield event
                        return
                    yield event
                    continue
                if run.end is not None:
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
        self._ending = last
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = loop.call_at(self._quiet_since + self.keepalive_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """The one timer: re-armed while the listener waits, left off while it is busy."""
        self._handle = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        now = loop.time()
        if now >= self._quiet_since + self.keepalive_s:
            self._quiet_since = now
            self._ping_due = True
            waiter.set_result(None)
        else:
            self._arm(loop)


# -- across processes: this process's one sender --------------------------------------------------

_dirty: set[Run] = set()
_sending: dict[str, Run] = {}
_wake: asyncio.Event | None = None
_sender: asyncio.Task[None] | None = None


def poke(run: Run) -> None:
    """`run` has something to send to Redis (new events, a stop for its readers, its end)."""
    global _wake, _sender
    _sending[run.public_id] = run
    _dirty.add(run)
    if _sender is None or _sender.done():
        _wake = asyncio.Event()
        _sender = detached_task(_send())
    assert _wake is not None
    _wake.set()


async def _send() -> None:
    """Every run's new events, heartbeats, stops and ends in one pipeline per round trip (under
    load, one round trip carries many runs' tokens); the stops other processes asked of this
    process's runs come back in the same round trip."""
    assert _wake is not None
    wake = _wake
    while _sending:
        if not _dirty:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), shared_runs.HEARTBEAT_EVERY_S)
        wake.clear()
        now = time.monotonic()
        batch = _dirty | {run for run in _sending.values() if run.publisher and now >= run.publisher.beat_due}
        _dirty.clear()
        outgoing = []
        for run in batch:
            publisher = run.publisher
            assert publisher is not None
            events = [*map(run.at, range(publisher.sent, len(run)))]
            ended = run.end is not None
            outgoing.append(
                shared_runs.Outgoing(
                    publisher, events, ended, run.client_key, run.facts.fields(run.record.model)
                )
            )
        done, again, asked = await shared_runs.send(outgoing, now)
        for run in batch:
            if run.publisher in done:
                _sending.pop(run.public_id, None)
            elif run.publisher in again:
                _dirty.add(run)
        if asked is None:  # Redis failed: other processes miss these runs for now, their clients do not
            if shared_runs.cancelled():
                return
            await asyncio.sleep(shared_runs.HEARTBEAT_EVERY_S)
            continue
        for public_id in asked:
            if (asked_run := runs.get(public_id)) is not None:
                detached_task(asked_run.stop())


async def flush(timeout_s: float) -> None:
    """Wait (up to `timeout_s`) until every run's last events are in Redis (before an exit)."""
    if _sender is not None and not _sender.done():
        await asyncio.wait([_sender], timeout=timeout_s)


async def close() -> None:
    """Stop sending and close the Redis clients (the end of a test's loop)."""
    reset()
    await shared_runs.close()


def reset() -> None:
    """Forget a loop that is gone (a finished test's): its sender, its clients."""
    global _sender
    if _sender is not None and not _sender.done() and _sender.get_loop().is_running():
        _sender.cancel()
    _sender = None
    _sending.clear()
    _dirty.clear()


# -- resuming -------------------------------------------------------------------------------------


def elsewhere(event: Event) -> Event:
    """An event of a run read back outside the process that held it: a drain's cut, which told
    the client to resume elsewhere, is a lost generation there."""
    if type(event) is Error and event.code is ErrorCode.SERVER_DRAINING:
        return shared_runs.generation_lost()
    return event


async def read(
    public_id: str, held: list[Event], after: int, last: str | None, facts: dict[str, object], ticket: Ticket
) -> AsyncGenerator[Event, None]:
    """A generation's events after the `after`-th, from a list read from the cache (`last` None)
    or from Redis (up to entry `last`), then, from Redis, the live rest; read by a connection that
    holds `ticket`. A generation that ends `generation_lost` (its owner died, or drained it) gets
    its row, under its own id, if none is there: its process may never write it."""
    text = "".join(e.text for e in held[:after] if type(e) is Token)
    live = None
    if last and not (held and type(held[-1]) in (Done, Error)):
        keepalive_s = settings.QUOTES_GATEWAY.keepalive_s
        live = shared_runs.follow(public_id, last=last, keepalive_s=keepalive_s, seen=len(held))
    try:
        async for event in _after(held[after:], live):
            event = elsewhere(event)
            if type(event) is Token:
                text += event.text
                yield event
                continue
            if type(event) is Error and event.code is ErrorCode.GENERATION_LOST and facts:
                with contextlib.suppress(Exception):  # queued at once: written even if cancelled here
                    await writer.write(lost_row(public_id, facts, text, event.message))
            if type(event) is Done or type(event) is Error:
                await ticket.release_client_slot()  # before the client hears the end
            yield event
    finally:
        await ticket.release()


async def _after(
    events: list[Event], live: AsyncGenerator[Event, None] | None
) -> AsyncGenerator[Event, None]:
    for event in events:
        yield event
    if live is not None:
        async with contextlib.aclosing(live):
            async for event in live:
                yield event


def resume_key(public_id: str) -> str:
    """The secret half of a generation's event ids, which only its own stream carries: its id (a
    permalink's) alone reads nothing. Keyed with SECRET_KEY: every process checks it, nothing stored."""
    return hmac.new(
        settings.SECRET_KEY.encode(), b"resume:" + public_id.encode(), hashlib.sha256
    ).hexdigest()[:16]


def parse_event_id(value: object) -> tuple[str, str, int] | None:
    """(public id, resume key, number) of a well-formed event id, else None."""
    match = EVENT_ID.fullmatch(value.strip()) if isinstance(value, str) else None
    return None if match is None else (match[1].lower(), match[2], int(match[3]))


@dataclass(frozen=True, slots=True)
class Resumed:
    """A resume: the facts its client had (the generation's id among them), the number of the
    last event it had, and the events after it."""

    meta: Meta
    after: int
    events: AsyncGenerator[Event, None]


async def resume(
    public_id: str, key: str, after: int, *, client_key: str, admitted: Entry | Error | None = None
) -> Resumed | Error | None:
    """The events of generation `public_id` after the `after`-th, then the live rest: from its run
    here, else (with REDIS_URL) from Redis, live in another process, else from its finished events
    in the cache. None when none has it, or when `key` is not its resume key. A resume is admitted
    like a new stream (`admitted`: the process's decision, but for the drain's refusal, which
    spares a run held here); a draining process serves only the runs it holds."""
    if not hmac.compare_digest(key, resume_key(public_id)):
        return None
    run = runs.get(public_id)
    here = run is not None and after <= len(run)
    if drain.draining and not here:
        return server_draining()
    options = settings.QUOTES_GATEWAY
    if admitted is None or (isinstance(admitted, Error) and admitted.code is ErrorCode.SERVER_DRAINING):
        admitted = enter(options, while_draining=here)
    ticket = await admit(client_key, options, admitted=admitted, new=False)
    if isinstance(ticket, Error):
        return ticket
    try:
        if run is not None and after <= len(run):
            return Resumed(
                merged(map(run.at, range(after))), after, run.subscribe(after, ticket=ticket).events()
            )
        if drain.draining:  # its run here ended meanwhile: a draining process reads no other
            await ticket.release()
            return server_draining()
        found: tuple[list[Event], str | None, dict[str, Any]] | None = None
        if shared_runs.available():
            found = await shared_runs.read(public_id)
        if found is None and (finished := await _finished(public_id)) is not None:
            found = finished[1], None, {}
        if found is None or after > len(found[0]):
            await ticket.release()
            return None
    except BaseException:
        await ticket.release()
        raise
    held, last, facts = found
    meta = merged(held[:after]).merged(Meta(generation_id=public_id))
    return Resumed(meta, after, read(public_id, held, after, last, facts, ticket))


async def stop(public_id: str, client_key: str) -> bool | None:
    """Stop generation `public_id` now for the client that started it, wherever it runs. True when
    stopped now, False when it had ended, None when this client has no such generation."""
    run = runs.get(public_id)
    if run is not None:
        return await run.stop() if run.client_key == client_key else None
    if shared_runs.available():
        stopped_there = await shared_runs.stop_elsewhere(public_id, client_key)
        if stopped_there is not None:
            return stopped_there
    finished = await _finished(public_id)
    return False if finished is not None and finished[0] == client_key else None


async def _finished(public_id: str) -> tuple[str, list[Event]] | None:
    """A finished generation's (client key, events), kept for resumes (QUOTES_RESUME_TTL_S)."""
    try:
        stored = await run_on_cache(cache.get, finished_key(public_id))
    except Exception as exc:
        report(logger, "could not read a finished generation", exc)
        return None
    match stored:
        case {"client": str() as client_key, "events": list() as items, **rest} if not rest:
            with contextlib.suppress(ValueError):
                return client_key, decode_events(items)
    misfit("a finished generation", stored)
    return None
