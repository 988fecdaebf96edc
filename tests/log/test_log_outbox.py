"""The log writer's outbox (quotes/ai/gateway/rows.py): no log row is lost while the database
cannot take it, and no stream's `[DONE]` waits for it.

Faults through the real drivers: the writer's database made read-only (SQLite opened with
`mode=ro`; PostgreSQL with `default_transaction_read_only`), unreachable (SQLite in a directory
that does not exist; PostgreSQL on a port nothing listens on), or hung (another connection holds
the table's write lock). Streams go through the real ASGI app and the fake Workers AI upstream;
/healthz and /metrics are read the same way. A process that dies with rows in its outbox is a
real subprocess, and the processes that take its file over are real daphnes (harness/daphne.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core import serializers
from django.db import connection, connections
from prometheus_client.parser import text_string_to_metric_families

from harness.daphne import environment, migrate, start_daphne, wait_until_healthy
from harness.services import free_port, stop_process, tail
from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai import refusals
from quotes.ai.backends import reset_backends
from quotes.ai.gateway import rows as rows_module
from quotes.ai.gateway.rows import IDLE_CLOSE_S, ROW_WAIT_S, Outbox, RowWriter, lost_row, refusal_row, writer
from quotes.models import Generation, Persona
from tests.asgi import AsgiStream, post_stream, request

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
DONE = b"data: [DONE]\n\n"
TOKEN = "outbox-metrics-token-81c2"
#: The longest the lock holder of the hung-database test holds on: long after any [DONE] that
#: does not wait for the database, and well short of SQLite's 20 s busy timeout.
LOCK_HELD_AT_MOST_S = 15.0


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    fake_workers_ai.default = Scenario(tokens=["a", "b", "c"])
    yield fake_workers_ai
    await reset_backends()


@pytest.fixture(autouse=True)
def _production_wait(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """The bound a stream waits for its row in production (tests/conftest.py lifts it), roomy
    limits for one client's many streams, and /metrics open to the test's token."""
    monkeypatch.setattr(writer, "wait_s", ROW_WAIT_S)
    settings.QUOTES_GATEWAY = replace(
        settings.QUOTES_GATEWAY,
        rate_limit=(100_000, 60),
        network_rate_limit=(1_000_000, 60),
        max_concurrent_streams=100_000,
        cache_ttl=0,
    )
    settings.QUOTES_METRICS_ENABLED = True
    settings.QUOTES_METRICS_TOKEN = TOKEN
    settings.QUOTES_METRICS_ALLOW = ()


@pytest.fixture
async def outbox_left_empty() -> AsyncIterator[None]:
    """After the test, whatever happened in it, the outbox is written (the database is back):
    nothing of this test's is replayed into the next one's database."""
    writer.outbox.directory()  # named after the database as it is, before any fault
    yield
    assert await asyncio.to_thread(writer.flush, 30.0, outbox=True)


@contextlib.contextmanager
def database_fault(kind: str, tmp_path: Path) -> Iterator[None]:
    """Every connection opened from now on (the log writer's, the ORM's) finds the database
    read-only or unreachable, until the block ends. Django's connections of all threads share
    one settings dict: it is changed in place, and put back as it was. The log writer's own
    connection (kept while rows keep coming) is closed first: it opens its next one with the
    fault."""
    assert writer.flush(30.0, close=True)
    database = connection.settings_dict
    saved = copy.deepcopy(database)
    sqlite = database["ENGINE"] == "django.db.backends.sqlite3"
    if kind == "read-only" and sqlite:
        database["NAME"] = f"file:{saved['NAME']}?mode=ro"  # SQLite's own read-only open (uri=True)
    elif kind == "read-only":
        database["OPTIONS"] = {**saved["OPTIONS"], "options": "-c default_transaction_read_only=on"}
    elif sqlite:
        database["NAME"] = str(tmp_path / "no such directory" / "db.sqlite3")
    else:
        database["PORT"] = str(free_port())  # nothing listens there: connection refused
    try:
        yield
    finally:
        database.clear()
        database.update(saved)


async def close_orm_connections() -> None:
    """The ORM's thread opens a fresh connection at its next query (with the fault, or without)."""
    await sync_to_async(connections.close_all)()


def stream(topic: str) -> AsgiStream:
    return post_stream({"persona": "test-watts", "topic": topic})


async def quote(topic: str) -> bytes:
    s = stream(topic)
    response = await s.start()
    assert response.status == 200, response
    return (await s.read_all()).body


async def scrape() -> dict[str, float]:
    response = await request("GET", "/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.body.decode())
        for sample in family.samples
        if not sample.labels
    }


async def until(predicate: Any, *, timeout_s: float = 30.0) -> None:
    """Poll `predicate` (async) until it holds or the time runs out (the caller asserts after)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        if await predicate() or asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.05)


async def rows() -> list[Generation]:
    return [row async for row in Generation.objects.order_by("id")]


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize("fault", ["read-only", "unreachable"])
async def test_log_rows_of_streams_during_a_database_fault_are_written_once_it_is_back(
    persona: Persona, fake: FakeWorkersAI, tmp_path: Path, outbox_left_empty: None, fault: str
) -> None:
    """Streams that end while the database takes no writes still end with [DONE]; their rows
    wait in the outbox (/metrics has its depth, /healthz says the writes fail), and are written
    exactly once when the database is back. The old writer retried each row on the stream's time,
    then dropped it."""
    assert (await quote("before")).endswith(DONE)  # the persona is in the process's memory now
    before = await scrape()
    await close_orm_connections()

    with database_fault(fault, tmp_path):
        bodies = await asyncio.gather(*(quote(f"during {index}") for index in range(5)))

        async def all_in_the_outbox() -> bool:
            return (await scrape())["quotes_log_outbox_depth"] == 5

        await until(all_in_the_outbox)
        during = await scrape()
        health = await request("GET", "/healthz")
        if fault == "read-only":
            assert [row.topic for row in await rows()] == ["before"]  # reads still work

    assert all(body.endswith(DONE) for body in bodies)
    assert during["quotes_log_outbox_depth"] == 5
    assert health.json()["checks"]["log"] == {"status": "failing"}
    if fault == "read-only":
        # Only the log writes fail: the process still serves, so it stays in rotation.
        assert health.status == 200
        assert health.json()["status"] == "degraded"

    await close_orm_connections()

    async def outbox_written() -> bool:
        return (await scrape())["quotes_log_outbox_depth"] == 0

    await until(outbox_written)  # the writer's own retry, with backoff: nothing nudges it
    written = await rows()
    assert sorted(row.topic for row in written) == ["before"] + [f"during {index}" for index in range(5)]
    assert len({row.public_id for row in written}) == 6
    assert all(row.status == Generation.Status.OK and row.text == "abc" for row in written)

    after = await scrape()
    assert after["quotes_log_outbox_depth"] == 0
    assert after["quotes_log_rows_lost_total"] == before["quotes_log_rows_lost_total"]
    health = await request("GET", "/healthz")
    assert health.status == 200
    assert health.json()["status"] == "ok" and health.json()["checks"]["log"] == {"status": "ok"}
    assert not list(writer.outbox.directory().glob("*.jsonl"))  # the written outbox is gone


def hold_the_write_lock(locked: threading.Event, release: threading.Event, gave_up: threading.Event) -> None:
    """Another connection holds the log table's write lock until `release`, or for
    LOCK_HELD_AT_MOST_S if nobody releases it (then `gave_up`): the database hangs, not fails."""
    try:
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("BEGIN EXCLUSIVE")
            else:
                cursor.execute("BEGIN")
                cursor.execute("LOCK TABLE quotes_generation IN EXCLUSIVE MODE")
            locked.set()
            if not release.wait(LOCK_HELD_AT_MOST_S):
                gave_up.set()
            cursor.execute("COMMIT")
    finally:
        connections.close_all()


@pytest.mark.integration
@pytest.mark.services
async def test_done_does_not_wait_for_a_database_that_hangs(
    persona: Persona, fake: FakeWorkersAI, outbox_left_empty: None
) -> None:
    """The log table is locked by another connection (the database hangs rather than fails):
    a stream that ends meanwhile sends [DONE] while the lock is still held, and its row is
    written once the lock goes. The old writer held [DONE] until the row was in."""
    assert (await quote("before")).endswith(DONE)  # the persona is in the process's memory now
    locked, release, gave_up = threading.Event(), threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_the_write_lock, args=(locked, release, gave_up))
    holder.start()
    try:
        assert await asyncio.to_thread(locked.wait, 10)
        body = await quote("while locked")
        held_until_done = not gave_up.is_set()
    finally:
        release.set()
        await asyncio.to_thread(holder.join, 30)

    assert body.endswith(DONE)
    assert held_until_done  # [DONE] came while the lock was held, not after the holder gave up

    async def written() -> bool:
        return len(await rows()) >= 2

    await until(written)
    assert [row.topic for row in await rows()] == ["before", "while locked"]


#: A process that logs rows while its database is away, and exits: its outbox is left behind.
DEAD_PROCESS = """
import sys, uuid
import django

django.setup()
from quotes.ai.gateway.rows import writer
from quotes.models import Generation

persona_id, public_ids = int(sys.argv[1]), sys.argv[2:]
for public_id in public_ids:
    writer.submit(Generation(public_id=uuid.UUID(public_id), persona_id=persona_id, backend="local",
                             model="m", status="ok", text="logged while the database was away"))
assert writer.flush(30)
assert writer.outbox.depth == len(public_ids), writer.outbox.depth
"""


@pytest.mark.system
def test_the_outbox_of_a_process_that_is_gone_is_written_once_by_the_next_to_start(tmp_path: Path) -> None:
    """A process logs five rows while its database is away (its directory moved), and exits:
    they wait in its spool file (and in a copy of it). The database comes back, and two daphnes
    start on it at once: at start-up, with no request, each file is taken over by one of them,
    the rows are written, each exactly once, and the files are gone. The old writer had no
    outbox: the rows were lost."""
    home, away = tmp_path / "db", tmp_path / "db-away"
    home.mkdir()
    database, outbox = home / "db.sqlite3", tmp_path / "outbox"
    env = environment(
        DATABASE_URL=f"sqlite:///{database}",
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DJANGO_SETTINGS_MODULE="config.settings",
        QUOTES_OUTBOX_DIR=str(outbox),
    )
    migrate(env)
    with sqlite3.connect(database) as db:
        (persona_id,) = db.execute("SELECT id FROM quotes_persona ORDER BY id LIMIT 1").fetchone()

    home.rename(away)  # the database is unreachable
    public_ids = [str(uuid.uuid4()) for _ in range(5)]
    subprocess.run(
        [sys.executable, "-c", DEAD_PROCESS, str(persona_id), *public_ids], cwd=ROOT, env=env, check=True
    )
    (spooled,) = outbox.rglob("*.jsonl")
    assert len(spooled.read_bytes().splitlines()) == 5
    # A copy, as a process that took the file over and was killed before deleting it leaves:
    # the same rows replayed twice must be kept once.
    (spooled.parent / "4000000-0badc0de.jsonl").write_bytes(spooled.read_bytes())
    away.rename(home)  # the database is back; the process that logged the rows is gone

    daphnes = []
    try:
        for index in range(2):
            log = tmp_path / f"daphne-{index}.log"
            port = free_port()
            daphnes.append((f"http://127.0.0.1:{port}", start_daphne(port, env, log), log))
        for url, process, log in daphnes:
            wait_until_healthy(url, process, log)
        deadline_polls = 600
        found: list[str] = []
        for _ in range(deadline_polls):  # the take-over runs on the writer's thread, at start-up
            with sqlite3.connect(database) as db:
                found = [public_id for (public_id,) in db.execute("SELECT public_id FROM quotes_generation")]
            if len(found) >= 5:
                break
            time.sleep(0.05)
    finally:
        for _, process, _ in daphnes:
            stop_process(process)

    assert sorted(found) == sorted(uuid.UUID(public_id).hex for public_id in public_ids)
    assert not list(outbox.rglob("*.jsonl"))
    logs = "".join(log.read_text() for _, _, log in daphnes)
    assert logs.count("took over 5 log rows") == 2, "\n".join(tail(log) for _, _, log in daphnes)


def _open_database_connections() -> int:
    """Connections of this process to the test database: on SQLite, its file descriptors open on
    the database file; on PostgreSQL, the server's sessions on the database but this one's."""
    database = connection.settings_dict
    if database["ENGINE"] == "django.db.backends.sqlite3":
        target = os.path.realpath(database["NAME"])
        fds = Path("/proc/self/fd")
        return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == target)
    import psycopg

    with psycopg.connect(
        dbname=database["NAME"],
        user=database["USER"],
        password=database["PASSWORD"],
        host=database["HOST"],
        port=database["PORT"] or None,
    ) as admin:
        [(count,)] = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [database["NAME"]],
        ).fetchall()
    return int(count)


@pytest.mark.integration
@pytest.mark.services
async def test_the_log_writer_keeps_its_connection_while_rows_come_and_closes_it_when_idle(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """A connect per row cost a third of a daphne's CPU per quote (docs/benchmarks.md): the
    writer keeps its connection between rows, and an idle process still holds none."""
    await close_orm_connections()
    before = await asyncio.to_thread(_open_database_connections)  # the test thread's own
    for topic in ("one", "two"):
        assert (await quote(topic)).endswith(DONE)
    await close_orm_connections()  # the test's own queries' connection

    kept = await asyncio.to_thread(_open_database_connections)
    for _ in range(int(10 * IDLE_CLOSE_S / 0.1)):
        left = await asyncio.to_thread(_open_database_connections)
        if left == before:
            break
        await asyncio.sleep(0.1)

    assert kept >= before + 1  # the writer's, between the rows
    assert left == before  # closed once idle
    assert [row.topic for row in await rows()] == ["one", "two"]


@pytest.mark.integration
async def test_a_flush_without_close_does_not_undo_a_pending_close(
    persona: Persona, fake: FakeWorkersAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One caller waits for the writer to close its connection (a test's database is about to
    go) while the writer is busy; another flushes meanwhile, without `close`. The close still
    happens: it was overwritten, and the first caller waited in vain while the writer kept its
    connection. SQLite's own lock keeps the writer busy for as long as the test needs."""
    monkeypatch.setattr(rows_module, "IDLE_CLOSE_S", 60.0)  # no idle close during the test
    assert (await quote("one")).endswith(DONE)  # the writer holds its connection now
    lock = sqlite3.connect(connection.settings_dict["NAME"], timeout=0, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    writer.submit(Generation(persona=persona, backend="workers-ai", model="m", status="ok", topic="two"))
    closing = asyncio.ensure_future(asyncio.to_thread(writer.flush, 10.0, close=True))
    await asyncio.sleep(0.3)  # the writer waits on the lock; the first caller on the writer

    assert await asyncio.to_thread(writer.flush, 0) is False  # another caller's flush
    lock.rollback()
    lock.close()

    assert await closing
    assert [row.topic for row in await rows()] == ["one", "two"]


# -- one generation, one row: which one (issue 28) -------------------------------------------------

FACTS: dict[str, object] = {"persona_version_id": None, "backend": "local", "model": "m", "topic": "t"}
FACTS |= {"client_hash": "c", "is_preview": False}


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize("owner_first", [False, True], ids=["lost-then-owner", "owner-then-lost"])
@pytest.mark.parametrize("together", [False, True], ids=["apart", "one-outbox-batch"])
async def test_a_runs_own_row_wins_over_a_lost_row_whatever_the_order(
    persona: Persona, tmp_path: Path, outbox_left_empty: None, owner_first: bool, together: bool
) -> None:
    """A drained owner's `cancelled` row and a resume's (or the sweep's) `generation_lost` row of
    one generation: the owner's is kept, written first or last, in batches of their own or (both
    replayed from the outbox after a fault) in one. The old writer kept whichever came first."""
    public_id = str(uuid.uuid4())
    lost = lost_row(public_id, {"persona_id": persona.pk, **FACTS}, "half a", "The process died.")
    own = logged_row(persona.pk, "half a quote", public_id=public_id, status=Generation.Status.CANCELLED)
    order = [(own, True), (lost, False)] if owner_first else [(lost, False), (own, True)]

    with database_fault("unreachable", tmp_path) if together else contextlib.nullcontext():
        for row, owner in order:
            await writer.write(row, owner=owner)
            assert await asyncio.to_thread(writer.flush, 30.0)
    assert await asyncio.to_thread(writer.flush, 30.0, outbox=True)

    [kept] = await rows()
    assert (str(kept.public_id), kept.status, kept.error_code, kept.text) == (
        public_id,
        Generation.Status.CANCELLED,
        "",
        "half a quote",
    )


@pytest.mark.integration
@pytest.mark.services
async def test_refusals_while_the_database_is_down_are_all_counted_once_it_is_back(
    persona: Persona, tmp_path: Path, outbox_left_empty: None
) -> None:
    """A window's refusals while the database takes no writes: the row of the first and the
    count of the rest wait in the outbox with the streams' rows, and the sum of `request_count`
    is every refusal once it is back. The old refusals wrote to the database themselves, and lost
    both (the row after five tries, the count at once)."""
    client_key = f"ip:{uuid.uuid4().hex}"
    with database_fault("unreachable", tmp_path):
        for _ in range(7):
            await refusals.record_refusal(
                **{"persona": persona, "version": None, "backend": "local", "model": "m"},
                **{"client_key": client_key, "client_hash": "c", "preview": False, "window": 60},
                **{"code": "too_many_streams", "message": "Busy.", "status": "busy", "local": True},
            )
        await refusals.flush_now()  # as a draining process does last
        assert await asyncio.to_thread(writer.flush, 30.0)
        assert writer.outbox.depth == 2
    assert await asyncio.to_thread(writer.flush, 30.0, outbox=True)

    assert [(row.status, row.request_count) for row in await rows()] == [(Generation.Status.BUSY, 7)]


@pytest.mark.integration
@pytest.mark.services
async def test_a_refusal_count_that_overtakes_its_row_inserts_it_and_counts_only_upward(
    persona: Persona,
) -> None:
    """Processes sharing Redis count one window's refusals into one row: a count may reach the
    database before the window's first row (still in another process's outbox), and a lower
    count after a higher one. The row is kept once, with the highest count."""
    public_id = uuid.uuid4()
    facts = {"persona_id": persona.pk, **FACTS}
    for count in (3, 1, 7, 5):  # a count first, its row late, a higher count, a lower
        row = refusal_row(
            public_id, facts, status=Generation.Status.RATE_LIMITED, code="rate_limited", message=""
        )
        row.request_count = count
        writer.submit(row)
        assert await asyncio.to_thread(writer.flush, 30.0)

    assert [(row.public_id, row.request_count) for row in await rows()] == [(public_id, 7)]


# -- what the outbox trusts (issue 29) ------------------------------------------------------------


def logged_row(persona_id: int, text: str, **fields: Any) -> Generation:
    fields = {"public_id": uuid.uuid4(), "backend": "local", "model": "m", "status": "ok", **fields}
    return Generation(persona_id=persona_id, text=text, **fields)


def dead_process_file(rows: list[Generation], name: str = "4000000-0badc0de.jsonl") -> Path:
    """The spool file a process that is gone left with `rows`, written as the writer writes them:
    a copy of a live outbox's file (unlocked), whose own file is then removed."""
    outbox = Outbox()
    outbox.append([(row, True) for row in rows])
    (spooled,) = outbox.directory().glob("*.jsonl")
    dead = spooled.with_name(name)
    shutil.copyfile(spooled, dead)
    outbox.clear()
    return dead


@pytest.mark.integration
async def test_a_line_planted_in_the_outbox_is_never_replayed(
    persona: Persona, settings: Any, tmp_path: Path
) -> None:
    """A process that is gone left one row; someone who could write to its file added a copy of
    that line with other text (its signature no longer matches) and a line of their own (no
    signature) that claims an `ok`, shared quote. The next writer replays the row and neither
    of theirs: no row, no permalink page. The old writer replayed whatever it found."""
    settings.QUOTES_OUTBOX_DIR = tmp_path / "outbox"
    genuine = logged_row(persona.pk, "genuine")
    dead = dead_process_file([genuine])
    line = dead.read_bytes()
    forged_id, planted_id = uuid.uuid4(), uuid.uuid4()
    forged = line.replace(str(genuine.public_id).encode(), str(forged_id).encode()).replace(
        b"genuine", b"forged"
    )
    planted = logged_row(persona.pk, "planted", public_id=planted_id, shared_at=datetime.now(UTC))
    with dead.open("ab") as file:
        file.write(forged + serializers.serialize("json", [planted]).encode() + b"\n")

    fresh = RowWriter()
    fresh.start()  # takes the file over at once, then replays it
    try:
        await until(lambda: asyncio.to_thread(lambda: not dead.exists()))
        assert await asyncio.to_thread(fresh.flush, 30.0, outbox=True, close=True)
    finally:
        await asyncio.to_thread(fresh.close)

    assert [(row.public_id, row.text) async for row in Generation.objects.all()] == [
        (genuine.public_id, "genuine")
    ]
    assert (await request("GET", f"/q/{genuine.public_id}/")).status == 200
    for public_id in (forged_id, planted_id):
        assert (await request("GET", f"/q/{public_id}/")).status == 404


#: Plants, in a process's outbox directory, what a take-over must never read (a FIFO, links, a
#: file of another user's) beside a dead process's file, and takes them over: the count taken.
#: Its own process, with its address space capped: the old take-over read /dev/zero until memory
#: ran out (and blocked on the FIFO first).
PLANTED = """
import os, resource, shutil
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import django

django.setup()
from quotes.ai.gateway.rows import Outbox
from quotes.models import Generation

outbox = Outbox()
outbox.append([(Generation(persona_id=1, backend="local", model="m", status="ok", text="genuine"), True)])
(spooled,) = outbox.directory().glob("*.jsonl")
shutil.copyfile(spooled, spooled.with_name("9-dead.jsonl"))
shutil.copyfile(spooled, spooled.parent.parent / "elsewhere.jsonl")
outbox.clear()
os.mkfifo(spooled.with_name("1-fifo.jsonl"))
os.symlink("/dev/zero", spooled.with_name("2-zero.jsonl"))
os.symlink(spooled.parent.parent / "elsewhere.jsonl", spooled.with_name("3-link.jsonl"))
if os.geteuid() == 0:  # as root, a file of another user's too
    shutil.copyfile(spooled.with_name("9-dead.jsonl"), spooled.with_name("4-nobody.jsonl"))
    os.chown(spooled.with_name("4-nobody.jsonl"), 65534, 65534)
print(Outbox().take_over())
"""


@pytest.mark.system
def test_a_fifo_a_link_or_another_users_file_in_the_outbox_is_left_alone(tmp_path: Path) -> None:
    """A FIFO, a link to /dev/zero, a link to a file of rows and (as root) another user's file
    of rows, beside a dead process's file: only that file is taken over, at once, and the rest is
    left as it was. The old take-over followed links, opened the FIFO blocking (the writer hung)
    and read /dev/zero whole."""
    env = environment(
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DJANGO_SETTINGS_MODULE="config.settings",
        QUOTES_OUTBOX_DIR=str(tmp_path / "outbox"),
    )
    done = subprocess.run(
        [sys.executable, "-c", PLANTED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1"]
    left = sorted(path.name for path in (tmp_path / "outbox").glob("*/*.jsonl"))
    planted = ["1-fifo.jsonl", "2-zero.jsonl", "3-link.jsonl"] + (
        ["4-nobody.jsonl"] if os.geteuid() == 0 else []
    )
    assert set(planted) < set(left) and len(left) == len(planted) + 1  # and the taker's own file
    assert "in the outbox is left alone" in done.stderr


@pytest.mark.integration
def test_the_outbox_is_0700_at_every_level_and_refuses_a_folder_that_is_a_link(
    tmp_path: Path, settings: Any
) -> None:
    """Under the units' UMask=0007 a new outbox, its parent and its folder are 0700, and an
    older version's 0770 levels are tightened: the group (nginx's www-data) may not enter. A
    folder replaced by a link is not written through. The old outbox made its levels 0770 and
    followed the link."""
    old = os.umask(0o007)
    try:
        settings.QUOTES_OUTBOX_DIR = tmp_path / "state" / "outbox"
        fresh = Outbox()
        fresh.append([(logged_row(1, "new"), True)])
        older = tmp_path / "older"
        settings.QUOTES_OUTBOX_DIR = older
        (older / Outbox().directory().name).mkdir(mode=0o770, parents=True)
        older.chmod(0o770)
        tightened = Outbox()
        tightened.append([(logged_row(1, "older"), True)])
    finally:
        os.umask(old)
    levels = [tmp_path / "state", *(tightened.directory(), tightened.directory().parent)]
    levels += [fresh.directory(), fresh.directory().parent]
    assert {oct(level.stat().st_mode & 0o777) for level in levels} == {"0o700"}
    assert {oct(path.stat().st_mode & 0o777) for path in tmp_path.rglob("*.jsonl")} == {"0o600"}

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    settings.QUOTES_OUTBOX_DIR = tmp_path / "linked"
    linked = Outbox()
    linked.directory().parent.mkdir(mode=0o700)
    linked.directory().symlink_to(elsewhere)
    linked.append([(logged_row(1, "through the link"), True)])
    assert not list(elsewhere.iterdir())
    for outbox in (fresh, tightened, linked):
        outbox.clear()


@pytest.mark.integration
def test_two_connections_that_differ_only_by_user_have_outboxes_of_their_own() -> None:
    """Two deployments on one host, one database name, two database users: each replays only
    its own rows. The old folder name left the user out."""
    database = connection.settings_dict
    saved = database.get("USER")
    try:
        database["USER"] = "alice"
        alice = Outbox().directory()
        database["USER"] = "bob"
        bob = Outbox().directory()
    finally:
        database["USER"] = saved
    assert alice != bob


@pytest.mark.integration
def test_the_outbox_holds_at_most_its_cap(tmp_path: Path, settings: Any) -> None:
    """With room for five rows, a sixth and more are dropped (their indices returned: the writer
    counts them lost), and a dead process's file of ten rows is taken over five rows deep. The
    old outbox grew without end and read a file whole, however large."""
    settings.QUOTES_OUTBOX_DIR = tmp_path / "outbox"
    rows = [logged_row(1, f"row {index:02}") for index in range(10)]
    dead = dead_process_file(rows)
    line = len(dead.read_bytes()) // 10  # the rows' lines are of one length
    settings.QUOTES_OUTBOX_MAX_BYTES = line * 5 + line // 2

    writing = Outbox()
    lost = writing.append([(logged_row(1, f"new {index:02}"), True) for index in range(10)])
    writing.clear()
    taking = Outbox()
    taken = taking.take_over()
    (own,) = taking.directory().glob("*.jsonl")

    assert lost == set(range(5, 10)) and writing.depth == 0
    assert taken == 5 and own.stat().st_size == line * 5 and not dead.exists()
    taking.clear()


@pytest.mark.integration
def test_take_over_deletes_the_files_of_other_databases_past_the_log_retention(
    tmp_path: Path, settings: Any
) -> None:
    """A file in another connection's folder (a database since dropped) that nobody took over
    within QUOTES_LOG_RETENTION_DAYS is deleted; a younger one is kept for its database. The old
    take-over never looked at them."""
    settings.QUOTES_OUTBOX_DIR = tmp_path / "outbox"
    settings.QUOTES_LOG_RETENTION_DAYS = 90
    other = tmp_path / "outbox" / "sqlite3-0123456789abcdef"
    other.mkdir(mode=0o700, parents=True)
    old, young = other / "1-old.jsonl", other / "2-young.jsonl"
    for path, days in ((old, 91), (young, 89)):
        path.write_bytes(b"")
        stamp = time.time() - days * 86400
        os.utime(path, (stamp, stamp))
    Outbox().take_over()
    assert not old.exists() and young.exists()
