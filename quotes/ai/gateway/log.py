"""The request log: what each stream gathers for its `Generation` row (`Record`), and the writer
that group-commits every stream's row from one thread (`LogWriter`).

A row per stream used to be one `asave()` on the request's own thread, with a transaction (and,
on SQLite, an fsync) of its own: at a few hundred streams that is a commit and a thread per
stream. Here the rows of every stream in the process go through one queue to one writer thread,
which inserts whatever has queued up in one transaction (`bulk_create`): while it commits, the
next batch gathers. Each stream still awaits its own row before it sends its terminal event, so
a client that has seen `[DONE]` (or an error) can count on the row; and the row is queued
before that wait begins, so a stream cancelled while waiting (its client left) still has its
row written. Nothing is lost to a failed batch either: it is retried row by row, each insert
retried on a briefly locked database.

The writer thread opens its database connection on demand and, like a request, closes it when
there is nothing left to write (per CONN_MAX_AGE), so an idle process holds no connection.
At interpreter exit the queue is drained before the process ends.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal

from django.db import IntegrityError, OperationalError, close_old_connections, transaction

from ... import metrics
from ...models import Generation, Persona, PersonaVersion
from ..catalog import estimate_cost
from ..events import Error, GenerationRequest, Usage

logger = logging.getLogger(__name__)

#: Attempts per row when a batch has failed and rows are written one by one.
ROW_ATTEMPTS = 5
#: Most rows in one INSERT (SQLite allows 32,766 variables; a row has about 25 fields).
BATCH_SIZE = 500

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


#: Tokens kept one by one before they are joined into one string (memory: a stream may run for
#: minutes, and a str per token costs about 50 bytes besides its characters).
JOIN_EVERY = 64


@dataclass(frozen=True, slots=True)
class RowFacts:
    """What a generation's row says besides how it went (its Record): who asked what of whom,
    and how they read it (for the metrics)."""

    persona: Persona
    version: PersonaVersion | None
    backend: str
    topic: str
    request: GenerationRequest
    client_hash: str
    preview: bool
    transport: str

    def fields(self, model: str) -> dict[str, object]:
        """As Generation fields: what another process needs to write this generation's row if
        its own process dies (quotes.ai.gateway.shared_runs)."""
        return {
            "persona_id": self.persona.pk,
            "persona_version_id": self.version.pk if self.version else None,
            "backend": self.backend,
            "model": model,
            "topic": self.topic,
            "client_hash": self.client_hash,
            "is_preview": self.preview,
        }


async def write_row(record: Record, facts: RowFacts) -> None:
    """Write one generation's row, once its outcome is in `record` (the one place rows of
    generations are made: quotes.ai.gateway.runs.Run at its end, or stream_generation for a
    request that ended before its run existed)."""
    row = record.row(facts)
    metrics.stream_finished(row, transport=facts.transport)
    try:
        await writer.write(row)
    except asyncio.CancelledError:
        raise  # the row is queued: it is written all the same
    except Exception:
        logger.exception("could not write the log row of a generation")


@dataclass(slots=True)
class Record:
    """What the log row needs, gathered while the stream flows (one append per token)."""

    started: float
    #: the text so far: joined pieces of JOIN_EVERY tokens each, then the latest tokens
    joined: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    ttft: float | None = None
    usage: Usage | None = None
    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    step: int = 0
    status: str = ""
    error: Error | None = None
    cache_status: str = ""
    public_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def add_text(self, text: str) -> None:
        parts = self.parts
        parts.append(text)
        if len(parts) >= JOIN_EVERY:
            self.joined.append("".join(parts))
            parts.clear()

    @property
    def text(self) -> str:
        return "".join(self.joined) + "".join(self.parts)

    def row(self, facts: RowFacts) -> Generation:
        usage = self.usage
        cost = None
        if self.cache_status == Generation.CacheStatus.HIT:
            cost = Decimal(0)  # nothing was paid for a cached or shared answer
        elif usage is not None:
            estimate = estimate_cost(self.model, usage.prompt_tokens, usage.completion_tokens)
            cost = Decimal(str(round(estimate, 8))) if estimate is not None else None
        return Generation(
            public_id=self.public_id,
            persona_id=facts.persona.pk,
            persona_version=facts.version,
            backend=facts.backend,
            model=self.model,
            fallback_step=self.step,
            topic=facts.topic,
            status=self.status or Generation.Status.ERROR,
            cache_status=self.cache_status,
            error_code=self.error.code if self.error else "",
            error_message=self.error.message if self.error else "",
            # PostgreSQL cannot store NUL in text: a model that writes one must not cost the row.
            text=self.text.replace("\x00", ""),
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cost_usd=cost,
            ttft_ms=(self.ttft - self.started) * 1000 if self.ttft is not None else None,
            duration_ms=(time.perf_counter() - self.started) * 1000,
            request=asdict(facts.request),
            upstream_headers=self.headers,
            client_hash=facts.client_hash,
            is_preview=facts.preview,
        )


class LogWriter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Generation, _Waiter | None, bool]] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy = False  # a batch is being written
        #: rows written since the process started
        self.written = 0

    async def write(self, row: Generation) -> None:
        """Queue `row` and wait until it is committed. The row is queued before the wait, so
        cancelling the caller does not cancel the write; the error of a row that could not be
        written at all is raised here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._enqueue(row, (loop, done))
        await asyncio.shield(done)

    def submit(self, row: Generation) -> None:
        """Queue `row` without waiting for it (a caller that has nothing to send after it)."""
        self._enqueue(row, None)

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every queued row is written (tests, shutdown). True if the queue emptied."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and not self._busy:
                    return True
            self._wake.set()
            time.sleep(0.01)
        return False

    def stop(self, timeout: float = 30.0) -> None:
        """Write what is queued, then end the thread (at exit)."""
        self._stopping = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._wake.set()
            thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------

    def _enqueue(self, row: Generation, waiter: _Waiter | None) -> None:
        counted = metrics.log_row_queued()  # the queue depth gauge, when metrics are on
        with self._lock:
            self._pending.append((row, waiter, counted))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="quotes-log-writer", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            if not self._stopping:
                self._wake.wait()
            with self._lock:
                self._wake.clear()
                batch, self._pending = self._pending[:BATCH_SIZE], self._pending[BATCH_SIZE:]
                self._busy = bool(batch)
                if self._pending:
                    self._wake.set()
            if batch:
                failures = self._write(batch)
                with self._lock:
                    idle = not self._pending
                if idle:
                    # Like the end of a request: drop the connection unless CONN_MAX_AGE keeps it,
                    # before the streams hear their rows are in (so a finished test, or an idle
                    # process, holds no connection).
                    close_old_connections()
                self._resolve(batch, failures)
                with self._lock:
                    self._busy = False
            elif self._stopping:
                close_old_connections()
                return

    def _write(self, batch: Sequence[tuple[Generation, _Waiter | None, bool]]) -> dict[int, BaseException]:
        rows = [row for row, _, _ in batch]
        try:
            with transaction.atomic():
                # Idempotent by generation id (public_id is unique): a row written twice, such as
                # a lost generation's, which each resume that finds it lost writes, is kept once.
                Generation.objects.bulk_create(rows, ignore_conflicts=True)
            self.written += len(rows)
            return {}
        except Exception:
            logger.warning("a batch of %d log rows failed; writing them one by one", len(rows), exc_info=True)
        failures: dict[int, BaseException] = {}
        for index, row in enumerate(rows):
            try:
                self._write_one(row)
                self.written += 1
            except Exception as exc:
                logger.exception("could not write the log row %s", row.public_id)
                failures[index] = exc
        return failures

    def _write_one(self, row: Generation) -> None:
        """Insert one row, retrying a briefly locked database: a log row must not be lost to a
        transient lock."""
        row.pk = None
        row._state.adding = True
        for attempt in range(ROW_ATTEMPTS):
            try:
                row.save(force_insert=True)
                return
            except IntegrityError:
                if Generation.objects.filter(public_id=row.public_id).exists():
                    return  # written already (idempotent by generation id)
                raise
            except OperationalError:
                if attempt == ROW_ATTEMPTS - 1:
                    raise
                close_old_connections()
                time.sleep(0.05 * 2**attempt)

    def _resolve(
        self, batch: Sequence[tuple[Generation, _Waiter | None, bool]], failures: dict[int, BaseException]
    ) -> None:
        # One wake-up per event loop for the whole batch, not one per row.
        by_loop: defaultdict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]
        ]
        by_loop = defaultdict(list)
        for index, (_, waiter, counted) in enumerate(batch):
            metrics.log_row_done(counted=counted, lost=index in failures)
            if waiter is not None:
                loop, done = waiter
                by_loop[loop].append((done, failures.get(index)))
        for loop, waiters in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, waiters)


def _settle(waiters: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for done, error in waiters:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


writer = LogWriter()
atexit.register(writer.stop)
