"""The request log: what each stream gathers for its `Generation` row (`Record`), and the writer
that group-commits every stream's row from one thread (`RowWriter`), with an outbox on disk for
the rows the database cannot take.

A row per stream used to be one `asave()` on the request's own thread, with a transaction (and,
on SQLite, an fsync) of its own: at a few hundred streams that is a commit and a thread per
stream. Here the rows of every stream in the process go through one queue to one writer thread,
which inserts whatever has queued up in one transaction (`bulk_create`): while it commits, the
next batch gathers. A batch the database refuses because of one row (its persona was deleted) is
written again row by row, so only that row is lost (logged, and counted in
quotes_log_rows_lost).

A stream waits for its row at most ROW_WAIT_S before it sends its terminal event: ordinarily the
row is in by then, so a client that has seen `[DONE]` (or an error) can count on it; when the
database is slow or down, `[DONE]` goes out all the same and the row follows. The row is queued
before that wait begins, so a stream cancelled while waiting (its client left) still has its row.

The outbox. A batch the database cannot take now (it is down, unreachable or read-only: see
`unavailable`) is not retried on the streams' time: it is appended to this process's spool file
(one JSON line per row, fsync'd) under QUOTES_OUTBOX_DIR, and its streams go on. While the
outbox holds rows, new rows join it (in order, without knocking on a database that is down) and
the writer replays it with backoff (RETRY_MIN_S, doubling up to RETRY_MAX_S); once a replay goes
through, the file is removed and rows go straight to the database again. /healthz reports the
writes failing and /metrics the outbox's depth. Rows are idempotent by generation id
(`public_id` is unique), so a row replayed twice (a replay cut short, a process killed after its
insert) is kept once.

Which row a generation keeps, whatever the order its writers' rows come in: its run's own row
(`owner`, written at its close) overwrites a row written on its behalf, and a row written on its
behalf (`lost_row`, by a resume or the sweep that found its process gone; `refusal_row`, by
quotes.ai.refusals) is inserted only if none is there, and then only raises its `request_count`.
This module is the one place `Generation` rows are made.

Each process holds an exclusive lock (flock) on its spool file for as long as it lives; the
kernel drops it when the process ends, however it ends. When the writer thread starts (the first
row, or quotes.server's start-up), it takes over the spool file of every process that is gone:
under that file's lock, it appends the file's rows to its own outbox and deletes the file, so two
live processes never replay the same file. The files are kept per database (a subdirectory named
after the whole connection: engine, host, port, name and user), so a row is only ever replayed
into the database it was meant for.

What the outbox trusts: only what this user wrote. Every level is 0700 and this user's (a looser
one is tightened; a link, or another user's, is refused); only regular files of this user's are
read, without following links or blocking; each line is signed with SECRET_KEY and holds only the
REPLAYED fields, so a planted line is logged and never replayed. A file holds at most
QUOTES_OUTBOX_MAX_BYTES (past it, rows are dropped with an ERROR); other connections' files left
for QUOTES_LOG_RETENTION_DAYS are deleted at a take-over.

The writer thread opens its database connection on demand and keeps it while rows keep coming:
once nothing has come for IDLE_CLOSE_S it closes it like a request would (per CONN_MAX_AGE), so
an idle process holds no connection. (Closing it after every batch cost a connect per row: on
SQLite, Django's connection set-up is about a third of the daphne's CPU per quote on the TTFT
bench; on PostgreSQL, a round trip or three.) At interpreter exit the queue is drained (to the
outbox, if the database is down) before the process ends.
"""

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
import secrets
import stat
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.core import serializers
from django.core.signing import Signer
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
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
#: The longest a stream waits for its row before it sends its terminal event: `[DONE]` never
#: waits on a slow or absent database (the row stays queued, or goes to the outbox).
ROW_WAIT_S = 0.5
#: While the database cannot take rows, the outbox is replayed after RETRY_MIN_S, then after
#: twice as long each time it fails again, up to RETRY_MAX_S.
RETRY_MIN_S = 0.25
RETRY_MAX_S = 5.0
#: How long the writer keeps its database connection with nothing to write.
IDLE_CLOSE_S = 1.0
#: PostgreSQL SQLSTATEs, and classes of them, that say the database cannot take writes now but
#: will: a connection exception (08), a read-only transaction (25006: a hot standby, or
#: default_transaction_read_only), a serialization failure or deadlock (40001, 40P01),
#: insufficient resources (53: disk full, too many connections), a lock not available (55P03),
#: a statement cancelled or timed out (57014), the server shutting down or starting (57P01-03),
#: a system error (58). Any other SQLSTATE is about the row (or the query) itself.
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
#: Each line of the outbox is signed (Django's Signer: SECRET_KEY, and SECRET_KEY_FALLBACKS).
SIGNED_AS = "quotes.ai.gateway.log.outbox"  # the module's old name: lines already written stay readable

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]
#: a row, and whether its own run wrote it (its `owner`)
_Row = tuple[Generation, bool]
_Entry = tuple[_Row, _Waiter | None, bool]


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


#: `RowFacts.fields`' names and JSON types: what a run's facts read back from Redis must be.
FACT_TYPES: dict[str, tuple[type, ...]] = dict.fromkeys(("backend", "model", "topic", "client_hash"), (str,))
FACT_TYPES |= {"persona_id": (int,), "persona_version_id": (int, type(None)), "is_preview": (bool,)}


async def write_row(record: Record, facts: RowFacts) -> None:
    """Write one generation's row, once its outcome is in `record` (the one place rows of
    generations are made: quotes.ai.gateway.runs.Run at its end, or stream_generation for a
    request that ended before its run existed)."""
    row = record.row(facts)
    metrics.stream_finished(row, transport=facts.transport)
    await writer.write(row, owner=True)  # queued at once; waited for at most ROW_WAIT_S; never raises


def lost_row(public_id: str | uuid.UUID, facts: dict[str, object], text: str, message: str) -> Generation:
    """The `generation_lost` row of a generation whose process went away, from the facts and text
    Redis held: written on its behalf (by a resume in quotes.ai.gateway.runs, or the sweep in
    shared_runs), so its own row wins if its process writes one after all."""
    status, code = Generation.Status.ERROR, ErrorCode.GENERATION_LOST
    text = text.replace("\x00", "")  # as in Record.row
    return Generation(
        **facts, public_id=public_id, status=status, error_code=code, error_message=message, text=text
    )


def refusal_row(
    public_id: str | uuid.UUID, facts: dict[str, object], *, status: str, code: str, message: str
) -> Generation:
    """The row of a window's refused requests (quotes.ai.refusals): `facts` as RowFacts.fields
    (without the topic), no request, no text; its `request_count` is raised as they are counted."""
    return Generation(**facts, public_id=public_id, status=status, error_code=code, error_message=message)


@dataclass(slots=True)
class Record:
    """What the log row needs, gathered while the stream flows (one append per token)."""

    started: float
    #: the generation's text (set at its end, from its run's event log)
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


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot take writes now (and will later), rather than that
    the row is wrong: such a row goes to the outbox, not to the lost ones.

    By SQLSTATE where the driver has the server's (psycopg's `sqlstate`, psycopg2's `pgcode`):
    TRANSIENT_SQLSTATES, among them PostgreSQL's read-only transaction, an InternalError. Else by
    class: an OperationalError (the DB-API's "errors related to the database's operation": a
    connection refused or lost before any answer, SQLite's "unable to open database file",
    "attempt to write a readonly database", "database is locked") or an InterfaceError (a
    connection closed under us). An IntegrityError or a DataError is about the row itself, and
    writing it again would fail again."""
    if isinstance(exc, InterfaceError):  # not a DatabaseError in the DB-API's tree
        return True
    if not isinstance(exc, DatabaseError):
        return False
    cause = exc.__cause__  # the driver's own exception, which Django's wraps
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(TRANSIENT_SQLSTATES)
    return isinstance(exc, OperationalError)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:300]


def _dump(row: Generation, owner: bool) -> bytes:
    """One row as one signed line: Django's JSON serialization of its REPLAYED fields (their
    types, foreign keys as ids) and its `owner`, ASCII only, so no character in the text can be
    read as a line break."""
    (record,) = json.loads(serializers.serialize("json", [row], fields=REPLAYED))
    body = json.dumps([record | {"owner": owner}], ensure_ascii=True)
    return Signer(salt=SIGNED_AS).sign(body).encode() + b"\n"


def _load(line: bytes) -> _Row:
    """A line as a new row of its REPLAYED fields, and its `owner` (a line written before owners
    were kept has none: it is written as every row was then, only where none is). Raises
    BadSignature if this site did not write it."""
    (record,) = json.loads(Signer(salt=SIGNED_AS).unsign(line.decode().rstrip("\n")))
    fields = {name: value for name, value in record["fields"].items() if name in REPLAYED}
    (deserialized,) = serializers.deserialize(
        "json", json.dumps([{"model": "quotes.generation", "fields": fields}])
    )
    row = deserialized.object
    assert isinstance(row, Generation)
    return row, record.get("owner") is True


def _private_directory(path: Path) -> None:
    """Make `path` a directory only this user may enter (0700; a missing parent too), or check
    that it is one: a looser mode (an older version's, under UMask=0007) is tightened; a link, or
    another user's directory, is refused (PermissionError)."""
    if not path.parent.exists():
        _private_directory(path.parent)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of this user's: the outbox will not use it")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def _claim(path: Path) -> tuple[int, os.stat_result] | None:
    """`path` opened and locked, if it is the spool file of a process that is gone. None if it
    went meanwhile or its process lives, and (logged, never read) if it is not a regular file of
    this user's: a link, a FIFO (opened without blocking), a device, another user's file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None  # another process took it over meanwhile
    except OSError as exc:  # ELOOP: a symbolic link
        logger.error("%s in the outbox is left alone: %s", path, exc)
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            logger.error("%s in the outbox is not a file of this user's: it is left alone", path)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its process lives
            info = os.fstat(fd)  # as its process left it
            if os.path.samestat(info, os.stat(path)):  # else taken over and deleted meanwhile
                return fd, info
    except OSError:
        pass
    os.close(fd)
    return None


def _expired(path: Path) -> bool:
    """Whether `path` was last written longer than QUOTES_LOG_RETENTION_DAYS ago (never, at 0)."""
    retention_s = settings.QUOTES_LOG_RETENTION_DAYS * 86400
    with contextlib.suppress(OSError):
        return bool(retention_s) and time.time() - path.lstat().st_mtime > retention_s
    return False


def _fsync_directory(path: Path) -> None:
    """Make a file's creation, rename or removal in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Outbox:
    """This process's spool file of log rows waiting for the database (created on the first,
    removed once they are written), and the takeover of the files of processes that are gone.
    Used by the writer thread only; `depth` may be read from anywhere."""

    def __init__(self) -> None:
        #: rows waiting: in the file, plus any kept in `_memory`
        self.depth = 0
        self._path: Path | None = None
        self._fd: int | None = None
        self._directory: Path | None = None
        #: rows that could not be written to the disk either (it is full, say): kept here until
        #: the database takes them
        self._memory: list[_Row] = []

    def directory(self) -> Path:
        """QUOTES_OUTBOX_DIR/<the connection>: the files of every process on this database as this
        user (read once, so a database that changes its name under the writer, as a test's fault
        does, keeps it)."""
        if self._directory is None:
            database = connections[DEFAULT_DB_ALIAS].settings_dict
            keys = ("ENGINE", "HOST", "PORT", "NAME", "USER")
            identity = "|".join(str(database.get(key) or "") for key in keys)
            vendor = str(database["ENGINE"]).rpartition(".")[2]
            digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
            self._directory = Path(settings.QUOTES_OUTBOX_DIR) / f"{vendor}-{digest}"
        return self._directory

    def append(self, rows: Sequence[_Row]) -> set[int]:
        """Add `rows`, on the disk (fsync'd) before this returns; returns the indices of those
        dropped because the file is full (QUOTES_OUTBOX_MAX_BYTES; logged). Never raises: rows
        the disk will not take either are kept in memory (and logged), to be written with the rest."""
        lines = [_dump(row, owner) for row, owner in rows]
        kept = bisect.bisect_right(list(itertools.accumulate(map(len, lines))), self._room())
        if kept < len(rows):
            logger.error(
                "the outbox %s is full (QUOTES_OUTBOX_MAX_BYTES): %d log rows are lost",
                self.directory(),
                len(rows) - kept,
            )
        try:
            self._add(b"".join(lines[:kept]))
        except Exception:  # a disk that is full or read-only too: the rows must not be lost to it
            logger.exception("could not write %d log rows to the outbox; they wait in memory", kept)
            self._memory.extend(rows[:kept])
        self.depth += kept
        return set(range(kept, len(rows)))

    def batches(self) -> Iterator[list[_Row]]:
        """The rows waiting, oldest first, BATCH_SIZE at a time. A line that cannot be read back
        (cut short by a crash as it was written) is logged and left out."""
        batch: list[_Row] = []
        if self._path is not None:
            with self._path.open("rb") as file:
                for number, line in enumerate(file, 1):
                    try:
                        batch.append(_load(line))
                    except Exception:
                        logger.exception(
                            "line %d of the outbox %s is no log row of this site's", number, self._path
                        )
                        metrics.log_rows_lost(1)
                    if len(batch) >= BATCH_SIZE:
                        yield batch
                        batch = []
        for row in self._memory:
            batch.append(row)
            if len(batch) >= BATCH_SIZE:
                yield batch
                batch = []
        if batch:
            yield batch

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
        """Append to this outbox the rows of every spool file of this database's whose process is
        gone (its lock can be taken), and delete those files; delete the files of other databases'
        that nobody took over within QUOTES_LOG_RETENTION_DAYS. Returns how many rows were taken."""
        directory = self._make_directory()
        taken = 0
        for path in sorted(directory.parent.glob("*/*.jsonl")):
            ours = path.parent == directory
            if path == self._path or not (ours or _expired(path)):
                continue
            claimed = _claim(path)
            if claimed is None:
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
        """How many more bytes this process's file may take (QUOTES_OUTBOX_MAX_BYTES)."""
        used = os.fstat(self._fd).st_size if self._fd is not None else 0
        return int(settings.QUOTES_OUTBOX_MAX_BYTES) - used

    def _make_directory(self) -> Path:
        directory = self.directory()
        for level in (directory.parent, directory):
            _private_directory(level)
        return directory

    def _add(self, data: bytes) -> None:
        """Append whole lines to our file, on the disk when this returns. If it raises, the file
        is as it was: no half line for the next rows to run into."""
        fd = self._open()
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise

    def _open(self) -> int:
        if self._fd is not None:
            return self._fd
        directory = self._make_directory()
        # Made and locked under a name no takeover looks at, then renamed: a process starting
        # meanwhile must never find it unlocked (it would take it over as a dead process's).
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        making = directory / f"{name}.new"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = directory / f"{name}.jsonl"
            os.rename(making, path)
            _fsync_directory(directory)
        except OSError:
            os.close(fd)
            raise
        self._path, self._fd = path, fd
        return fd


class RowWriter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[_Entry] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._busy = False  # a batch is being written
        #: the writer thread has written since it last closed its connection
        self._connected = False
        self._close_now = False
        #: rows written since the process started
        self.written = 0
        #: how long a stream waits for its row (ROW_WAIT_S; the test suite waits longer)
        self.wait_s = ROW_WAIT_S
        self.outbox = Outbox()
        #: why the database takes no rows now (the last attempt's error), or "" when it does
        self.failing = ""
        self._retry_at = 0.0
        self._retry_s = RETRY_MIN_S

    async def write(self, row: Generation, *, owner: bool = False) -> None:
        """Queue `row` and wait until it is written (or in the outbox, or lost and logged), at
        most `wait_s`. The row is queued before the wait, so cancelling the caller does not
        cancel the write; and a wait that times out leaves it queued. `owner`: the generation's
        own run wrote it, and it overwrites any row written on its behalf (see `_upsert`)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._enqueue((row, owner), (loop, done))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.wait_s):
                await asyncio.shield(done)

    def submit(self, row: Generation) -> None:
        """Queue `row`, written on a generation's behalf, without waiting for it (a caller that
        has nothing to send after it)."""
        self._enqueue((row, False), None)

    def start(self) -> None:
        """Start the writer thread now rather than at the first row (quotes.server, at start-up):
        it takes over the outboxes of processes that are gone, and writes them."""
        with self._lock:
            self._ensure_thread()

    def flush(self, timeout: float = 30.0, *, outbox: bool = False, close: bool = False) -> bool:
        """Block until every queued row is written or in the outbox (tests, shutdown); with
        `outbox`, until the outbox is written too, retrying it now; with `close`, until the
        writer has closed its database connection too (a test's database is about to go). True
        if done in time."""
        deadline = time.monotonic() + timeout
        if outbox:
            self._retry_at = 0.0
        if close:  # never cleared here: a concurrent flush without `close` must not undo it
            self._close_now = True
        while time.monotonic() < deadline:
            with self._lock:
                if (
                    not self._pending
                    and not self._busy
                    and not (outbox and self.outbox.depth)
                    and not (
                        close and self._connected and self._thread is not None and self._thread.is_alive()
                    )
                ):
                    return True
            self._wake.set()
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (to the outbox, if the database is down), then end the thread."""
        self._closing = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._wake.set()
            thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------

    def _enqueue(self, row: _Row, waiter: _Waiter | None) -> None:
        counted = metrics.log_row_queued()  # the queue depth gauge, when metrics are on
        with self._lock:
            self._pending.append((row, waiter, counted))
            self._ensure_thread()
        self._wake.set()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="quotes-log-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._take_over()
        while True:
            if not self._closing:
                wait = self._until_retry()
                if self._connected:
                    wait = IDLE_CLOSE_S if wait is None else min(wait, IDLE_CLOSE_S)
                woken = self._wake.wait(wait)
                if self._connected and (self._close_now or not woken) and not self._pending:
                    if self._close_now:
                        connections[DEFAULT_DB_ALIAS].close()
                    else:
                        close_old_connections()  # idle: like the end of a request (per CONN_MAX_AGE)
                    self._connected = self._close_now = False
            with self._lock:
                self._wake.clear()
                batch, self._pending = self._pending[:BATCH_SIZE], self._pending[BATCH_SIZE:]
                self._busy = bool(batch)
                if self._pending:
                    self._wake.set()
            if self.outbox.depth and not self._closing and time.monotonic() >= self._retry_at:
                self._replay()
                self._connected = True
            if batch:
                lost = self._write(batch)
                self._connected = True
                self._resolve(batch, lost)
                with self._lock:
                    self._busy = False
            elif self._closing:
                close_old_connections()
                return

    def _until_retry(self) -> float | None:
        """How long to sleep when nothing is queued: until the next retry of the outbox."""
        if not self.outbox.depth:
            return None
        return max(0.0, self._retry_at - time.monotonic())

    def _take_over(self) -> None:
        try:
            taken = self.outbox.take_over()
        except Exception:  # the outbox directory cannot be read: this process's rows still flow
            logger.exception("could not look for the outboxes of processes that are gone")
            return
        if taken:
            metrics.log_outbox_depth(self.outbox.depth)

    def _write(self, batch: Sequence[_Entry]) -> set[int]:
        """Write a batch: to the database, or to the outbox when the database cannot take it (or
        the outbox already holds rows, which go first). Returns the indices of the rows lost."""
        rows = [row for row, _, _ in batch]
        if not self.outbox.depth:
            try:
                return self._insert(rows)
            except (DatabaseError, InterfaceError) as exc:  # `_insert` raises only `unavailable` ones
                self._failed(exc)
        lost = self.outbox.append(rows)
        metrics.log_outbox_depth(self.outbox.depth)
        return lost

    def _replay(self) -> None:
        """Write the outbox to the database; it is cleared only when every row went in."""
        try:
            for rows in self.outbox.batches():
                lost = self._insert(rows)
                metrics.log_rows_lost(len(lost))
        except (
            DatabaseError,
            InterfaceError,
            OSError,
        ) as exc:  # the database still out (or the file unreadable)
            self._failed(exc)
            return
        count, was_failing, self.failing = self.outbox.depth, self.failing, ""
        self.outbox.clear()
        metrics.log_outbox_depth(0)  # last: whoever sees 0 sees the writes no longer failing
        if was_failing:
            logger.info("the database takes log rows again: %d written from the outbox", count)

    def _failed(self, exc: BaseException) -> None:
        """The database took no rows: retry the outbox later, twice as late as last time. One
        WARNING per outage, not per attempt."""
        if self.failing:
            self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
        else:
            logger.warning(
                "the database takes no log rows (%s): they wait in the outbox %s",
                _describe(exc),
                self.outbox.directory(),
            )
            self._retry_s = RETRY_MIN_S
        self._retry_at = time.monotonic() + self._retry_s
        self.failing = _describe(exc)
        # The next attempt opens a new connection: an old one may be broken, or held by a server
        # that is read-only for good (a former primary), even where CONN_MAX_AGE would keep it.
        with contextlib.suppress(DatabaseError, InterfaceError):
            connections[DEFAULT_DB_ALIAS].close()

    def _insert(self, rows: Sequence[_Row]) -> set[int]:
        """Write `rows` in one transaction, or, if the database refuses one of them, one by one.
        Returns the indices of the rows refused for good (logged). Raises the error of a database
        that cannot take rows now (`unavailable`): then some of them may be in, which is fine, as
        writing them again keeps them once."""
        try:
            with transaction.atomic():
                _upsert(rows)
        except Exception as exc:
            if unavailable(exc):
                raise
            logger.warning("a batch of %d log rows failed; writing them one by one", len(rows), exc_info=True)
        else:
            self.written += len(rows)
            return set()
        lost: set[int] = set()
        for index, (row, owner) in enumerate(rows):
            row.pk = None  # as the batch's rollback left it: not in the database
            try:
                with transaction.atomic():
                    _upsert([(row, owner)])
            except Exception as exc:
                if unavailable(exc):
                    raise
                logger.exception("could not write the log row %s", row.public_id)
                lost.add(index)
            else:
                self.written += 1
        return lost

    def _resolve(self, batch: Sequence[_Entry], lost: set[int]) -> None:
        # One wake-up per event loop for the whole batch, not one per row.
        by_loop: defaultdict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = defaultdict(list)
        for index, (_, waiter, counted) in enumerate(batch):
            metrics.log_row_done(counted=counted, lost=index in lost)
            if waiter is not None:
                loop, done = waiter
                by_loop[loop].append(done)
        for loop, waiters in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, waiters)


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
