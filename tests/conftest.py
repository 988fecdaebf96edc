from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.db import connections

from quotes.ai.backends import get_backend
from quotes.ai.backends.local import LocalBackend
from quotes.ai.events import Token
from quotes.models import Persona
from quotes.services import persona_save
from tests.limits import configure

pytest_plugins = ["tests.fixtures", "tests.llama_server", "tests.redis_server"]


#: The suite's layers (pyproject.toml registers them; README.md, "Contributing", says which
#: command runs which). Each test is in exactly one.
LAYERS = {"unit", "integration", "system"}
UNPLACED = pytest.StashKey[list[str]]()


def pytest_itemcollected(item: pytest.Item) -> None:
    """Note every test without exactly one layer marker, before `-m` deselects any."""
    layers = {mark.name for mark in item.iter_markers() if mark.name in LAYERS}
    if len(layers) != 1 or ("unit" in layers and item.get_closest_marker("django_db")):
        item.config.stash.setdefault(UNPLACED, []).append(f"{item.nodeid}: {sorted(layers) or 'none'}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test that is in no layer (or two), or a unit test on the database. Then run the
    browser tests last: Playwright's sync API keeps an event loop running in the main thread for
    the rest of the session, and async tests cannot start while it does."""
    if unplaced := config.stash.get(UNPLACED, []):
        raise pytest.UsageError(
            "each test needs exactly one layer marker, unit, integration or system, by what it really "
            "uses (a unit test no database): pyproject.toml, README.md 'Contributing'.\n  "
            + "\n  ".join(unplaced)
        )
    items.sort(key=lambda item: "browser" in item.path.parts)
    for item in items:
        # An async test's Redis pool (quotes.ai.gateway.shared_runs) is closed in the test's own loop,
        # and its ORM thread's database connection closed.
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.function):
            item.fixturenames.append("_end_of_async_test")


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that connects a socket or starts a process fails, saying where it belongs."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            "a unit test opens no socket and starts no process: mark it integration or system"
        )

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(autouse=True)
def _local_backend_by_default(settings: pytest.FixtureRequest) -> None:
    """Tests run on the embedded model unless they ask for another backend."""
    settings.AI_BACKEND = "local"  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_resume_grace(settings: pytest.FixtureRequest) -> None:
    """A client that drops stops its generation at once (QUOTES_RESUME_GRACE_S=0), as the tests
    of a disconnect expect; tests/stream/test_resume.py sets a grace of its own."""
    settings.QUOTES_GATEWAY = dataclasses.replace(settings.QUOTES_GATEWAY, resume_grace_s=0)  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_adaptive_admission(settings: pytest.FixtureRequest) -> Iterator[None]:
    """Admission by the static ceiling only (QUOTES_LOOP_LAG_TARGET_MS=0): a loaded test machine's
    event loop lags for reasons of its own, and a test refused for that would fail by chance.
    tests/stream/test_capacity.py turns the adaptive limit on; each test starts it afresh."""
    settings.QUOTES_GATEWAY = dataclasses.replace(settings.QUOTES_GATEWAY, loop_lag_target_ms=0)  # type: ignore[attr-defined]
    yield
    from quotes.ai.gateway import capacity

    capacity.reset()


@pytest.fixture
def unlimited(settings: Any) -> Any:
    """Many requests from one client in a row: raise the per-client limits out of the way."""
    configure(settings, rate_limit=(1_000_000, 60), max_concurrent_streams=1_000)
    return settings


@pytest.fixture(scope="session")
def django_db_modify_db_settings(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A file, not SQLite's shared in-memory database: concurrent streams write their log rows
    at once, and in-memory SQLite fails a locked write at once instead of waiting for it."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] == "django.db.backends.sqlite3":
        database.setdefault("TEST", {})["NAME"] = str(tmp_path_factory.mktemp("db") / "test.sqlite3")


@pytest.fixture(scope="session", autouse=True)
def _outbox_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The log writer's outbox (rows the database could not take) in a directory of the test
    session's own, never in a developer's QUOTES_CACHE_DIR."""
    from django.conf import settings

    settings.QUOTES_OUTBOX_DIR = tmp_path_factory.mktemp("outbox")


@pytest.fixture(autouse=True)
def _rows_before_the_end(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A stream's terminal event waits for its log row at most log.ROW_WAIT_S, then goes out with
    the row still on its way. Tests read the row as soon as they have the event, and a busy test
    machine may take longer than that to commit it: here the event waits for the row.
    tests/log/test_log_outbox.py puts the production bound back."""
    from quotes.ai.gateway.rows import writer

    monkeypatch.setattr(writer, "wait_s", 60.0)
    yield
    # The writer keeps its connection while rows keep coming: the test's database may go now.
    assert writer.flush(10.0, close=True)
    # A test that sent rows to the outbox (its database down) writes them before it ends: the
    # next test's rows would queue behind them, and not be in its database when it reads them.
    assert not writer.outbox.depth, "the test left rows in the log writer's outbox"


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    """Each test starts with no cached answers and no rate-limit counts, in whichever cache is
    the default and in every in-memory one (a test may have pointed the default elsewhere)."""
    from django.core.cache.backends.locmem import _caches

    cache.clear()
    for store in _caches.values():
        store.clear()
    yield
    cache.clear()
    for store in _caches.values():
        store.clear()


@pytest.fixture
async def _end_of_async_test() -> AsyncIterator[None]:
    yield
    from quotes.ai.gateway import admission, runs, tasks
    from quotes.ai.gateway.rows import writer

    # Generations the test left going (a run in its resume grace, a follower waiting on Redis)
    # end now, in the test's loop and while its database is there: their rows are written before
    # the next test (or the end of the session) flushes or drops the database under the writer.
    await runs.end_for_drain()
    await asyncio.to_thread(writer.flush, 10.0)
    await runs.close()
    await admission.leases.close()
    # An async test's ORM calls run on asgiref's thread, whose connection outlives the test (and,
    # on PostgreSQL, kept the test database from being dropped at the end of the session).
    await sync_to_async(connections.close_all)()
    await asyncio.wrap_future(tasks.detached_thread.submit(connections.close_all))  # detached tasks'


@pytest.fixture(autouse=True)
def _no_relay_left() -> Iterator[None]:
    """With REDIS_URL, runs publish to Redis (quotes.ai.gateway.shared_runs) from a pool bound to the
    test's loop: it goes with the test."""
    yield
    from quotes.ai.gateway import admission, runs, shared_runs
    from quotes.ai.redis_health import breaker

    runs.reset()
    shared_runs.reset()
    admission.leases.reset()
    breaker.reset()  # a test's Redis outage is not the next one's


@pytest.fixture
def local_backend() -> Iterator[LocalBackend]:
    """The process-wide embedded model (loaded once for the whole test session)."""
    backend = get_backend("local")
    assert isinstance(backend, LocalBackend)
    queue_timeout = backend.queue_timeout_s
    yield backend
    backend.queue_timeout_s = queue_timeout


@pytest.fixture
def persona(transactional_db: None) -> Persona:
    """A persona with greedy sampling (temperature 0) and a small max_tokens: fast and repeatable,
    saved as an editor would save it (so it has its first version)."""
    persona = Persona(
        slug="test-watts",
        name="Alan Watts",
        system_prompt="You are Alan Watts",
        user_prompt_template="Write 1 inspiring quote that is less than 50 words about {topic} as if you were Alan Watts",
        default_topic="hard honest work",
        max_tokens=16,
        temperature=0.0,
    )
    persona_save(persona=persona)
    return persona


#: A completion that keeps its slot for seconds: no stop strings, and the end of text ignored.
LONG_COMPLETION = {
    "prompt": "Once upon a time",
    "max_tokens": 800,
    "stream": True,
    "ignore_eos": True,
    "stop": [],
}


@contextlib.asynccontextmanager
async def slots_held(backend: LocalBackend, count: int) -> AsyncIterator[None]:
    """Keep `count` of the embedded model's slots busy (each writing 800 tokens, no stop strings,
    end of text ignored) until exit: a test of what happens when every slot is taken leaves one
    for itself to fill."""
    streams = [backend.stream_completion(LONG_COMPLETION) for _ in range(count)]
    try:
        for stream in streams:
            assert isinstance(await anext(stream), Token)  # this one has its slot
        yield
    finally:
        for stream in streams:
            await stream.aclose()
