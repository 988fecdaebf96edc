"""The `Generation` rows (a run's own from `Record` and `RowFacts`; `lost_row`, `refusal_row`) and the
writer that group-commits them from one thread (`RowWriter`), with an outbox on disk for the rows the
database cannot take now (`Outbox`). docs/architecture.md: "One generation, one row", "The row writer"."""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.core import serializers
from django.core.signing import Signer
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)

from ... import metrics
from ...models import Generation, Persona, PersonaVersion
from ..catalog import estimate_cost
from ..errors import ErrorCode
from ..events import Error, GenerationRequest, Usage

logger = logging.getLogger(__name__)

#: Most rows in one INSERT (SQLite allows 32,766 variables; a row has about 25 fields).
BATCH_SIZE = 500
#: The longest a stream waits for its row before its terminal event (the row follows if late).
ROW_WAIT_S = 0.5
#: The outbox's replay backoff: RETRY_MIN_S, doubling on each failure up to RETRY_MAX_S.
RETRY_MIN_S = 0.25
RETRY_MAX_S = 5.0
#: How long the writer keeps its database connection with nothing to write.
IDLE_CLOSE_S = 1.0
#: PostgreSQL SQLSTATEs (and classes) of a database that cannot take writes now but will: a lost
#: connection, read-only (a hot standby), a deadlock, no resources, a lock, a cancel, a restart.
TRANSIENT_SQLSTATES = ("08", "25006", "40001", "40P01", "53", "55P03", "57014", "57P", "58")
#: The fields a row keeps through the outbox: those its stream sets. Never its id, its creation
#: time, or what visitors did with it later (shared it, rated it).
REPLAYED = (
    *("public_id", "persona", "persona_version", "backend", "model", "fallback_step", "topic"),
    *("status", "cache_status", "error_code", "error_message", "text", "prompt_tokens"),
    *("completion_tokens", "cost_usd", "ttft_ms", "duration_ms", "request", "upstream_headers"),
    *("client_hash", "is_preview", "request_count"),
)
#: What a run's own row overwrites in a row written on its behalf: all it set but its id.
OWNED = REPLAYED[1:]
#: The outbox lines' signing salt: the module's old name, so lines already written stay readable.
SIGNED_AS = "quotes.ai.gateway.log.outbox"

_Row = tuple[Generation, bool]  # a row, and whether its own run wrote it (its `owner`)
_Entry = tuple[_Row, "asyncio.Future[None] | None", bool]


@dataclass(frozen=True, slots=True)
class RowFacts:
    """What a generation's row says besides how it went: who asked what of whom, read how."""

    persona: Persona
    version: PersonaVersion | None
    backend: str
    topic: str
    request: GenerationRequest
    client_hash: str
    preview: bool
    transport: str

    def fields(self, model: str) -> dict[str, object]:
        """As Generation fields: what another process needs to write this row if this one dies."""
        return {
            "persona_id": self.persona.pk,
            "persona_version_id": self.version.pk if self.version else None,
            "backend": self.backend,
            "model": model,
            "topic": self.topic,
            "client_hash": self.client_hash,
            "is_preview": self.preview,
        }


#: `RowFacts.fields`' names and JSON types: what a run's facts read back from Redis must be.
FACT_TYPES: dict[str, tuple[type, ...]] = dict.fromkeys(("backend", "model", "topic", "client_hash"), (str,))
FACT_TYPES |= {"persona_id": (int,), "persona_version_id": (int, type(None)), "is_preview": (bool,)}


async def write_row(record: Record, facts: RowFacts) -> None:
    """Write a generation's own row, once its outcome is in `record`. Never raises."""
    row = record.row(facts)
    metrics.stream_finished(row, transport=facts.transport)
    await writer.write(row, owner=True)


def lost_row(public_id: str | uuid.UUID, facts: dict[str, object], text: str, message: str) -> Generation:
    """The `generation_lost` row of a generation whose process went away, from what Redis held."""
    status, code = Generation.Status.ERROR, ErrorCode.GENERATION_LOST
    text = text.replace("\x00", "")  # as in Record.row
    return Generation(
        **facts, public_id=public_id, status=status, error_code=code, error_message=message, text=text
    )


def refusal_row(
    public_id: str | uuid.UUID, facts: dict[str, object], *, status: str, code: str, message: str
) -> Generation:
    """The row of a window's refused requests (quotes.ai.refusals): no request, no topic, no text."""
    return Generation(**facts, public_id=public_id, status=status, error_code=code, error_message=message)


@dataclass(slots=True)
class Record:
    """What the log row needs, gathered while the stream flows."""

    started: float
    text: str = ""
    ttft: float | None = None
    usage: Usage | None = None
    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    step: int = 0
    status: str = ""
    error: Error | None = None
    cache_status: str = ""
    public_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def row(self, facts: RowFacts) -> Generation:
        usage = self.usage
        estimate = estimate_cost(self.model, usage.prompt_tokens, usage.completion_tokens) if usage else None
        if self.cache_status == Generation.CacheStatus.HIT:
            estimate = 0  # nothing was paid for a cached or shared answer
        return Generation(
            **facts.fields(self.model),
            public_id=self.public_id,
            fallback_step=self.step,
            status=self.status or Generation.Status.ERROR,
            cache_status=self.cache_status,
            error_code=self.error.code if self.error else "",
            error_message=self.error.message if self.error else "",
            # PostgreSQL cannot store NUL in text: a model that writes one must not cost the row.
            text=self.text.replace("\x00", ""),
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cost_usd=None if estimate is None else Decimal(str(round(estimate, 8))),
            ttft_ms=(self.ttft - self.started) * 1000 if self.ttft is not None else None,
            duration_ms=(time.perf_counter() - self.started) * 1000,
            request=asdict(facts.request),
            upstream_headers=self.headers,
        )


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot take writes now but will (the row waits in the outbox),
    not that the row is wrong: by the driver's SQLSTATE, else an OperationalError (refused, lost,
    SQLite's read-only or locked database) or an InterfaceError."""
    if isinstance(exc, InterfaceError):  # not a DatabaseError in the DB-API's tree
        return True
    cause = exc.__cause__  # the driver's own exception, which Django's wraps
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if isinstance(exc, DatabaseError) and isinstance(sqlstate, str):
        return sqlstate.startswith(TRANSIENT_SQLSTATES)
    return isinstance(exc, OperationalError)


def _dump(row: Generation, owner: bool) -> bytes:
    """One row as one signed line, ASCII only, so no character in the text can break the line."""
    (record,) = json.loads(serializers.serialize("json", [row], fields=REPLAYED))
    body = json.dumps([record | {"owner": owner}], ensure_ascii=True)
    return Signer(salt=SIGNED_AS).sign(body).encode() + b"\n"


def _load(line: bytes) -> _Row:
    """A line as a new row of its REPLAYED fields only (BadSignature if this site did not sign it)."""
    (record,) = json.loads(Signer(salt=SIGNED_AS).unsign(line.decode().rstrip("\n")))
    fields = {name: value for name, value in record["fields"].items() if name in REPLAYED}
    data = json.dumps([{"model": "quotes.generation", "fields": fields}])
    row = next(serializers.deserialize("json", data)).object
    assert isinstance(row, Generation)
    return row, record.get("owner") is True


def _claim(path: Path) -> tuple[int, os.stat_result] | None:
    """`path` opened and locked, if it is the spool file of a process that is gone; never read
    (and logged) if it is not a regular file of this user's: a link, a FIFO, a device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # gone (another process took it over), or ELOOP: a symbolic link
        if not isinstance(exc, FileNotFoundError):
            logger.error("%s in the outbox is left alone: %s", path, exc)
        return None
    with contextlib.suppress(OSError):
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            logger.error("%s in the outbox is not a file of this user's: it is left alone", path)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its process lives
            info = os.fstat(fd)
            if os.path.samestat(info, os.stat(path)):  # else taken over and deleted meanwhile
                return fd, info
    os.close(fd)
    return None


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _expired(path: Path) -> bool:
    retention_s = settings.QUOTES_LOG_RETENTION_DAYS * 86400
    with contextlib.suppress(OSError):
        return bool(retention_s) and time.time() - path.lstat().st_mtime > retention_s
    return False


class Outbox:
    """This process's spool file of rows waiting for the database, and the take-over of the files
    of processes that are gone. Used by the writer thread only; `depth` may be read anywhere."""

    def __init__(self) -> None:
        self.depth = 0  # rows waiting: in the file, plus any in `_memory`
        self._path: Path | None = None
        self._fd: int | None = None
        self._directory: Path | None = None
        self._memory: list[_Row] = []  # rows the disk would not take either (it is full, say)

    def directory(self) -> Path:
        """QUOTES_OUTBOX_DIR/<the connection>: the files of every process on this database as this
        user (read once, so a database that changes its name under the writer keeps it)."""
        if self._directory is None:
            database = connection.settings_dict
            keys = ("ENGINE", "HOST", "PORT", "NAME", "USER")
            identity = "|".join(str(database.get(key) or "") for key in keys)
            vendor = str(database["ENGINE"]).rpartition(".")[2]
            digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
            self._directory = Path(settings.QUOTES_OUTBOX_DIR) / f"{vendor}-{digest}"
        return self._directory

    def append(self, rows: Sequence[_Row]) -> set[int]:
        """Add `rows`, fsync'd before this returns; returns the indices of those dropped because
        the file is full (QUOTES_OUTBOX_MAX_BYTES). Never raises."""
        lines = [_dump(row, owner) for row, owner in rows]
        kept = bisect.bisect_right(list(itertools.accumulate(map(len, lines))), self._room())
        if kept < len(rows):
            logger.error(
                "the outbox is full (QUOTES_OUTBOX_MAX_BYTES): %d log rows are lost", len(rows) - kept
            )
        try:
            self._add(b"".join(lines[:kept]))
        except Exception:
            logger.exception("could not write %d log rows to the outbox; they wait in memory", kept)
            self._memory.extend(rows[:kept])
        self.depth += kept
        return set(range(kept, len(rows)))

    def rows(self) -> Iterator[_Row]:
        """The rows waiting, oldest first, but for lines that cannot be read back (logged)."""
        if self._path is not None:
            with self._path.open("rb") as file:
                for number, line in enumerate(file, 1):
                    try:
                        yield _load(line)
                    except Exception:
                        logger.exception("outbox %s line %d is no log row of this site's", self._path, number)
                        metrics.log_rows_lost(1)
        yield from self._memory

    def clear(self) -> None:
        """Every row waiting is written: remove the file (and with it, its lock)."""
        if self._path is not None and self._fd is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
                _fsync_directory(self._path.parent)
            os.close(self._fd)
        self._path = self._fd = None
        self._memory = []
        self.depth = 0

    def take_over(self) -> int:
        """Move here the rows of this database's spool files whose process is gone (its lock can be
        taken); delete other databases' files past QUOTES_LOG_RETENTION_DAYS. Returns the rows taken."""
        directory = self._make_directory()
        taken = 0
        for path in sorted(directory.parent.glob("*/*.jsonl")):
            ours = path.parent == directory
            if path == self._path or not (ours or _expired(path)) or (claimed := _claim(path)) is None:
                continue
            fd, info = claimed
            try:
                if ours:
                    taken += self._take(path, fd, info.st_size)
                else:
                    path.unlink()
                    logger.warning("deleted %s: no process took it over in QUOTES_LOG_RETENTION_DAYS", path)
            except OSError:
                logger.exception("could not take over the outbox %s", path)
            finally:
                os.close(fd)
        return taken

    def _take(self, path: Path, fd: int, size: int) -> int:
        room = self._room()
        # Whole lines only: a last line without its end was cut short as it was written.
        lines, _, torn = os.read(fd, max(0, min(size, room))).rpartition(b"\n")
        if size > room:
            logger.error("the outbox %s is over QUOTES_OUTBOX_MAX_BYTES: its rows past that are lost", path)
        elif torn:
            logger.warning("the outbox %s ends in a line cut short; it is left out", path)
        metrics.log_rows_lost(1 if torn or size > room else 0)
        count = lines.count(b"\n") + 1 if lines else 0
        if count:
            self._add(lines + b"\n")
            self.depth += count
        path.unlink()  # its rows are safe in ours: a crash before this replays them twice, once kept
        _fsync_directory(path.parent)
        logger.info("took over %d log rows from %s, left by a process that is gone", count, path.name)
        return count

    def _room(self) -> int:
        used = os.fstat(self._fd).st_size if self._fd is not None else 0
        return int(settings.QUOTES_OUTBOX_MAX_BYTES) - used

    def _make_directory(self) -> Path:
        """Our directory, made or checked at each level (a missing parent too): this user's only,
        0700 (a looser mode is tightened), never a link or another user's (PermissionError)."""
        directory = self.directory()
        levels = [directory, directory.parent]
        while not levels[-1].parent.exists():
            levels.append(levels[-1].parent)
        for level in reversed(levels):
            with contextlib.suppress(FileExistsError):
                level.mkdir(mode=0o700)
            info = level.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                raise PermissionError(f"{level} is not this user's directory: the outbox will not use it")
            if stat.S_IMODE(info.st_mode) != 0o700:
                level.chmod(0o700)
        return directory

    def _add(self, data: bytes) -> None:
        """Append whole lines to our file (made at the first), fsync'd. If it raises, the file is as
        it was: no half line for the next rows to run into."""
        if self._fd is None:
            directory = self._make_directory()
            # Made and locked under a name no take-over looks at, then renamed: a process starting
            # meanwhile must never find it unlocked (it would take it over as a dead process's).
            making = directory / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.new"
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(making, making.with_suffix(".jsonl"))
                _fsync_directory(directory)
            except OSError:
                os.close(fd)
                raise
            self._path, self._fd = making.with_suffix(".jsonl"), fd
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise


class RowWriter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[_Entry] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._connected = False  # `_insert` used the connection since the thread last closed it
        self._close_now = False
        self.wait_s = ROW_WAIT_S  # the test suite waits longer
        self.outbox = Outbox()
        self.failing = ""  # why the database takes no rows now, or ""
        self._retry_at = 0.0
        self._retry_s = RETRY_MIN_S

    async def write(self, row: Generation, *, owner: bool = False) -> None:
        """Queue `row` and wait until it is written (or in the outbox, or lost and logged), at
        most `wait_s`; cancelling the caller does not cancel the write. `owner`: see `_upsert`."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._enqueue((row, owner), done)
        await asyncio.wait([done], timeout=self.wait_s)  # on time-out or cancel, `done` stays

    def submit(self, row: Generation) -> None:
        """Queue `row`, written on a generation's behalf, without waiting for it."""
        self._enqueue((row, False), None)

    def start(self) -> None:
        """Start the writer thread now (at start-up), which takes over dead processes' outboxes."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="quotes-log-writer", daemon=True)
                self._thread.start()

    def flush(self, timeout: float = 30.0, *, outbox: bool = False, close: bool = False) -> bool:
        """Block until every queued row is written or in the outbox; with `outbox`, until the outbox
        is written too (retried now); with `close`, until the connection is closed. True if done."""
        deadline = time.monotonic() + timeout
        if outbox:
            self._retry_at = 0.0
        if close:  # never cleared here: a concurrent flush without `close` must not undo it
            self._close_now = True
        while time.monotonic() < deadline:
            with self._lock:
                held = close and self._connected and self._thread is not None and self._thread.is_alive()
                if not (self._pending or (outbox and self.outbox.depth) or held):
                    return True
            self._wake.set()
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (to the outbox, if the database is down), then end the thread."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _enqueue(self, row: _Row, waiter: asyncio.Future[None] | None) -> None:
        counted = metrics.log_row_queued()
        with self._lock:
            self._pending.append((row, waiter, counted))
        self.start()
        self._wake.set()

    def _run(self) -> None:
        try:
            if self.outbox.take_over():
                metrics.log_outbox_depth(self.outbox.depth)
        except Exception:  # the outbox directory cannot be read: this process's rows still flow
            logger.exception("could not look for the outboxes of processes that are gone")
        while True:
            with self._lock:
                batch = self._pending[:BATCH_SIZE]  # left queued until written: `flush` waits for it
            if self.outbox.depth and not self._closing and time.monotonic() >= self._retry_at:
                self._replay()
            if batch:
                try:
                    self._write(batch)
                finally:  # even if it raised: a batch is tried once
                    with self._lock:
                        del self._pending[: len(batch)]
            elif self._closing:
                close_old_connections()
                return
            else:
                waits = [IDLE_CLOSE_S] if self._connected else []
                if self.outbox.depth:
                    waits.append(max(0.0, self._retry_at - time.monotonic()))
                woken = self._wake.wait(min(waits, default=None))
                self._wake.clear()
                if self._connected and (self._close_now or not woken) and not self._pending:
                    if self._close_now:
                        connection.close()
                    else:
                        close_old_connections()  # idle: like the end of a request (per CONN_MAX_AGE)
                    self._connected = self._close_now = False

    def _write(self, batch: Sequence[_Entry]) -> None:
        """Write a batch to the database, or to the outbox when the database cannot take it (or the
        outbox holds rows, which go first); then wake its waiters, one call per event loop."""
        rows = [row for row, _, _ in batch]
        lost = None
        if not self.outbox.depth:
            try:
                lost = self._insert(rows)
            except (DatabaseError, InterfaceError) as exc:  # `_insert` raises only `unavailable` ones
                self._failed(exc)
        if lost is None:
            lost = self.outbox.append(rows)
            metrics.log_outbox_depth(self.outbox.depth)
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for index, (_, done, counted) in enumerate(batch):
            metrics.log_row_done(counted=counted, lost=index in lost)
            if done is not None:
                by_loop.setdefault(done.get_loop(), []).append(done)
        for loop, waiters in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, waiters)

    def _replay(self) -> None:
        """Write the outbox to the database; it is cleared only when every row went in."""
        try:
            rows = self.outbox.rows()
            while batch := list(itertools.islice(rows, BATCH_SIZE)):
                metrics.log_rows_lost(len(self._insert(batch)))
        except (DatabaseError, InterfaceError, OSError) as exc:  # still out (or the file unreadable)
            self._failed(exc)
            return
        count, was_failing, self.failing = self.outbox.depth, self.failing, ""
        self.outbox.clear()
        metrics.log_outbox_depth(0)  # last: whoever sees 0 sees the writes no longer failing
        if was_failing:
            logger.info("the database takes log rows again: %d written from the outbox", count)

    def _failed(self, exc: BaseException) -> None:
        """Retry the outbox later, twice as late as last time. One WARNING per outage."""
        detail = f"{type(exc).__name__}: {exc}".strip()[:300]
        if not self.failing:
            where = self.outbox.directory()
            logger.warning("the database takes no log rows (%s): they wait in the outbox %s", detail, where)
        self._retry_s = min(self._retry_s * 2, RETRY_MAX_S) if self.failing else RETRY_MIN_S
        self._retry_at = time.monotonic() + self._retry_s
        self.failing = detail
        # The next attempt opens a new connection: an old one may be broken, or held by a server
        # that is read-only for good (a former primary), even where CONN_MAX_AGE would keep it.
        with contextlib.suppress(DatabaseError, InterfaceError):
            connection.close()

    def _insert(self, rows: Sequence[_Row]) -> set[int]:
        """Write `rows` in one transaction or, if the database refuses one, one by one: returns the
        indices of those refused. Raises an `unavailable` error (rows in twice are kept once)."""
        self._connected = True
        try:
            with transaction.atomic():
                _upsert(rows)
        except Exception as exc:
            if unavailable(exc):
                raise
            if len(rows) == 1:
                logger.error("could not write the log row %s", rows[0][0].public_id, exc_info=exc)
                return {0}
            logger.warning("a batch of %d log rows failed; writing them one by one", len(rows), exc_info=exc)
            for row, _ in rows:
                row.pk = None  # as the batch's rollback left it: not in the database
            return {index for index, row in enumerate(rows) if self._insert([row])}
        return set()


def _upsert(rows: Sequence[_Row]) -> None:
    """Write `rows` so that each generation keeps one row, whatever order its writers' rows come
    in: its run's own row (`owner`) overwrites one written on its behalf, which never overwrites
    a row but only raises its `request_count` (a window's refusals counted since its first)."""
    owned = [row for row, owner in rows if owner]
    stand_ins = [row for row, owner in rows if not owner]
    Generation.objects.bulk_create(stand_ins, ignore_conflicts=True)
    Generation.objects.bulk_create(
        owned, update_conflicts=True, unique_fields=["public_id"], update_fields=OWNED
    )
    for row in stand_ins:
        if row.request_count > 1:  # only upward: another process may have written a later count
            Generation.objects.filter(public_id=row.public_id, request_count__lt=row.request_count).update(
                request_count=row.request_count
            )


def _settle(waiters: list[asyncio.Future[None]]) -> None:
    for done in waiters:
        if not done.done():
            done.set_result(None)


writer = RowWriter()
atexit.register(writer.close)
