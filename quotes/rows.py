"""The request log's rows, written by one task per process through Django's async ORM.

A generation's row is inserted `running` as it starts and completed once as it ends: neither
write waits in front of the first token. While the database is down or refuses writes, rows wait
in memory, in order, at most MAX_WAITING generations (a generation's insert and its end are one
entry: the end takes the place of an insert not yet written). A row the database refuses (its
persona deleted, a value no column holds) is set aside; the writer goes on with the next. A row
of which nothing can be written (the queue is full, the row is refused, the process exits first)
is logged as one JSON line, and counted lost. Refused requests are no rows: they are counted per
persona, hour and code, and the counts written every FLUSH_S."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from collections import Counter
from contextvars import Context
from decimal import Decimal

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core import serializers
from django.db import IntegrityError, InternalError, close_old_connections, connections
from django.db.models import F
from django.utils import timezone
from streaming import Done, Error, Stream, Token, Usage, merged

from . import state
from .errors import QuoteError
from .models import Generation, Refusal
from .ops import metrics
from .personas import UNREACHABLE, memory, peek

logger = logging.getLogger(__name__)

#: Generations whose rows wait at most (about 2 KiB each); past it a row is logged instead.
MAX_WAITING = 10_000
#: What the columns hold: PostgreSQL's integer, and a DecimalField(12, 8).
MAX_COUNT = 2**31 - 1
MAX_COST = Decimal("9999.99999999")
#: How long /healthz says `failing` after the database refused a row.
REFUSED_SHOWN_S = 300.0
#: How long a generation's end waits for its row (the row follows if the database is slow).
ROW_WAIT_S = 2.0
FLUSH_S = 5.0
CANCELLED = frozenset({"stopped", "abandoned", "server_draining"})
#: The database is unreachable, or refuses writes (InternalError: read-only): rows wait.
WAIT_FOR_DATABASE: tuple[type[Exception], ...] = (*UNREACHABLE, InternalError)


def finish_fields(row: Generation, stream: Stream, end: Done | Error) -> None:
    """What a generation's events say, onto its row: status, text, usage, timings (its cost is
    the bill's: quotes.streams.Bill)."""
    events = stream.events
    meta = merged(events)
    usage = next((e for e in reversed(events) if type(e) is Usage), None)
    row.model = (meta.model or row.model)[:200]
    row.fallback_step = min(meta.step or 0, 32767)
    row.upstream_headers = meta.headers
    row.text = _storable("".join(e.text for e in events if type(e) is Token))
    if type(end) is Error:
        row.status = Generation.Status.CANCELLED if end.code in CANCELLED else Generation.Status.ERROR
        row.error_code, row.error_message = end.code[:50], _storable(end.message)
    else:
        row.status = Generation.Status.OK
    if usage is not None:  # an upstream's counts, whatever they are, as the columns hold them
        row.prompt_tokens = min(max(usage.prompt_tokens, 0), MAX_COUNT)
        row.completion_tokens = min(max(usage.completion_tokens, 0), MAX_COUNT)
    now = asyncio.get_running_loop().time()
    if stream.first_token_at is not None:
        row.ttft_ms = (stream.first_token_at - stream.started_at) * 1000
    row.duration_ms = (now - stream.started_at) * 1000


def _storable(text: str) -> str:
    """`text` as every database stores it: PostgreSQL takes no NUL, and no driver sends a lone
    surrogate (JSON can carry one: "\\ud800")."""
    text = text.replace("\x00", "")
    return text if text.isascii() else text.encode("utf-8", "replace").decode()


def clamp_cost(cost: Decimal) -> Decimal:
    return min(cost, MAX_COST)


class Waiting:
    """A generation's row waiting to be written: its insert, or (`final`) the whole row."""

    __slots__ = ("done", "final", "row")

    def __init__(self, row: Generation, final: bool, done: asyncio.Future[None]) -> None:
        self.row, self.final, self.done = row, final, done


class RowWriter:
    """This event loop's writer: the rows waiting, a generation each, in order; one task writing them."""

    def __init__(self) -> None:
        self.waiting: dict[str, Waiting] = {}
        self.refusals: Counter[tuple[int, dt.datetime, str]] = Counter()
        self.failing = ""
        #: the last row the database refused: when, and why
        self.refused: tuple[float, str] | None = None
        self.refusal_writes = 0
        self.refusals_in_flight = 0
        self._wake = asyncio.Event()
        self._flush_due: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def insert(self, row: Generation) -> None:
        self._queue(row, final=False)

    async def finish(self, row: Generation) -> None:
        """Queue the whole row; wait until it is written (at most ROW_WAIT_S, not while failing)."""
        done = self._queue(row, final=True)
        if not self.failing:
            await asyncio.wait([done], timeout=ROW_WAIT_S)

    def count_refusal(self, persona_id: int, code: str) -> None:
        hour = timezone.now().replace(minute=0, second=0, microsecond=0)
        self.refusals[persona_id, hour, code] += 1
        if self._flush_due is None:
            self._flush_due = asyncio.get_running_loop().call_later(FLUSH_S, self._start)

    async def flush(self, timeout_s: float) -> None:
        """Write the rows waiting and the refusals counted (within `timeout_s`); log rows left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # A write under way, then one more for what it did not take: counts come in meanwhile.
        target = self.refusal_writes + self.refusals_in_flight + (1 if self.refusals else 0)
        while (self.waiting or self.refusal_writes < target) and loop.time() < deadline:
            self._start()
            await asyncio.sleep(0.05)
        for waiting in self.waiting.values():
            lost(waiting.row, "the process exited before the database took it")
            waiting.done.set_result(None)
        self.waiting.clear()

    async def aclose(self) -> None:
        """Flush, then stop the writer (and close its database connection)."""
        await self.flush(10.0)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _queue(self, row: Generation, *, final: bool) -> asyncio.Future[None]:
        key = str(row.public_id)
        waiting = self.waiting.get(key)
        if waiting is not None:  # its insert has not been written: the whole row takes its place
            waiting.final = waiting.final or final
            return waiting.done
        done = asyncio.get_running_loop().create_future()
        if len(self.waiting) >= MAX_WAITING:
            if final:  # its insert, if it was written, stays `running` until the prune marks it lost
                lost(row, "too many rows waiting for the database", counted=row.pk is None)
            # else its end will bring the whole row
            done.set_result(None)
            return done
        self.waiting[key] = Waiting(row, final, done)
        metrics.ROWS_WAITING.set(len(self.waiting))
        self._start()
        return done

    def _start(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            # A fresh context, not a copy of the request's: that holds the request's connection.
            self._task = asyncio.get_running_loop().create_task(self._write_all(), context=Context())

    async def _write_all(self) -> None:
        # Its ORM calls go to one thread of its own, never to a request's.
        async with ThreadSensitiveContext():
            try:
                await self._write_until_cancelled()
            finally:
                await sync_to_async(connections.close_all)()

    async def _write_until_cancelled(self) -> None:
        backoff = 0.25
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while self.waiting:
                    key, waiting = next(iter(self.waiting.items()))
                    final = waiting.final
                    await self._write(waiting.row, final)
                    if waiting.final != final:
                        continue  # it ended while its insert was written: now the whole row
                    del self.waiting[key]
                    metrics.ROWS_WAITING.set(len(self.waiting))
                    waiting.done.set_result(None)
                if self.refusals:
                    await self._write_refusals()
            except WAIT_FOR_DATABASE as exc:
                if not isinstance(exc, InternalError):
                    memory.outage.failed(exc)
                elif not self.failing:
                    logger.warning("the database refuses the log's writes; rows wait in memory: %s", exc)
                self.failing = f"{type(exc).__name__}: {exc}"[:200]
                await sync_to_async(close_old_connections)()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._wake.set()
                continue
            if self.failing:
                self.failing = ""
                memory.outage.recovered()
            backoff = 0.25

    async def _write(self, row: Generation, final: bool) -> None:
        try:
            if not final:
                await row.asave(force_insert=True)
            elif row.pk is None or not await Generation.objects.filter(pk=row.pk).aupdate(**_fields(row)):
                row.pk = None
                await row.asave(force_insert=True)  # its insert was refused or lost: the whole row now
        except WAIT_FOR_DATABASE:
            raise
        except Exception as exc:  # the row itself is refused: its persona deleted, a value no column holds
            why = f"{type(exc).__name__}: {exc}"[:300]
            self.refused = (time.monotonic(), why)
            if final:  # (an insert refused: the row's end tries the whole row again)
                lost(row, f"the database refused it: {why}", counted=row.pk is None)

    async def _write_refusals(self) -> None:
        if self._flush_due is not None:
            self._flush_due.cancel()
            self._flush_due = None
        counts, self.refusals = self.refusals, Counter()
        self.refusals_in_flight = 1
        try:
            while counts:
                (persona_id, hour, code), count = next(iter(counts.items()))
                try:
                    await sync_to_async(_add_refusals)(persona_id, hour, code, count)
                except WAIT_FOR_DATABASE:
                    self.refusals.update(counts)  # those not written yet: the next try
                    raise
                except Exception:  # these counts themselves are refused: set aside, the rest go on
                    logger.exception("%d refusals (%s) not counted", count, code)
                del counts[persona_id, hour, code]
        finally:
            self.refusals_in_flight = 0
        self.refusal_writes += 1


def _add_refusals(persona_id: int, hour: dt.datetime, code: str, count: int) -> None:
    keys = {"persona_id": persona_id, "hour": hour, "code": code}
    for _ in range(2):  # another process may make the hour's row between our update and create
        if Refusal.objects.filter(**keys).update(count=F("count") + count):
            return
        try:
            Refusal.objects.create(**keys, count=count)
            return
        except IntegrityError:
            continue
    logger.warning("%d refusals not counted: persona %s is gone", count, persona_id)


def refused(error: QuoteError, slug: object, transport: str) -> None:
    """A 429 or 503 is no generation: counted (metrics, and per persona for the analytics)."""
    if error.status not in (429, 503):
        return
    metrics.stream_refused(transport, error.code)
    if (active := peek(slug)) is not None:
        writer().count_refusal(active.persona.pk, error.code)


def _fields(row: Generation) -> dict[str, object]:
    names = [f.attname for f in Generation._meta.concrete_fields if f.attname not in ("id", "created_at")]
    return {name: getattr(row, name) for name in names}


def lost(row: Generation, why: str, *, counted: bool = True) -> None:
    """A row the database will not get (`counted`: nothing of it; else its end, and the row stays
    `running`): its fields as one JSON line in the log, at ERROR."""
    if counted:
        metrics.row_lost()
    (record,) = json.loads(serializers.serialize("json", [row]))
    logger.error("log row not written (%s): %s", why, json.dumps(record["fields"], ensure_ascii=False))


def write_refusals_left() -> None:
    """At exit, once nothing answers any more: the refusals counted since the last write (sync)."""
    try:
        for rows in state.every(RowWriter):
            for key, count in rows.refusals.items():
                _add_refusals(*key, count)
            rows.refusals.clear()
    finally:
        connections.close_all()


def writer() -> RowWriter:
    """The running event loop's row writer (a part of quotes.state)."""
    return state.of(RowWriter)
