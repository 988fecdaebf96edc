"""The log writer's outbox (quotes/ai/gateway/log.py): no log row is lost while the database
cannot take it, and no stream's `[DONE]` waits for it.

Faults through the real drivers: the writer's database made read-only (SQLite opened with
`mode=ro`; PostgreSQL with `default_transaction_read_only`), unreachable (SQLite in a directory
that does not exist; PostgreSQL on a port nothing listens on), or hung (another connection holds
the table's write lock). Streams go through the real ASGI app and the fake Workers AI upstream;
/healthz and /metrics are read the same way. A process that dies with rows in its outbox is a
real subprocess, and the processes that take its file over are real daphnes (tests/deployed.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections
from prometheus_client.parser import text_string_to_metric_families

from quotes.ai.backends import reset_backends
from quotes.ai.gateway.log import IDLE_CLOSE_S, ROW_WAIT_S, writer
from quotes.models import Generation, Persona
from tests.asgi import AsgiStream, post_stream, request
from tests.deployed import environment, start_daphne, wait_until_healthy
from tests.fakes.workers_ai import FakeWorkersAI, Scenario
from tests.scaleout.services import free_port, stop_process, tail

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[1]
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
from quotes.ai.gateway.log import writer
from quotes.models import Generation

persona_id, public_ids = int(sys.argv[1]), sys.argv[2:]
for public_id in public_ids:
    writer.submit(Generation(public_id=uuid.UUID(public_id), persona_id=persona_id, backend="local",
                             model="m", status="ok", text="logged while the database was away"))
assert writer.flush(30)
assert writer.outbox.depth == len(public_ids), writer.outbox.depth
"""


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
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True
    )
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
