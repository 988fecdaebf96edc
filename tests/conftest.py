from __future__ import annotations

import contextlib
import inspect
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import caches
from django.db import connections
from streaming import Token

from quotes.backends import get_backend
from quotes.backends.local import LocalBackend
from quotes.models import Persona
from quotes.services import persona_save

pytest_plugins = ["tests.fixtures", "tests.llama_server", "tests.redis_server"]

#: Each test is in exactly one layer (README.md, "Contributing", says which command runs which).
LAYERS = {"unit", "integration", "system"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test in no layer (or two), or a unit test on the database; run the browser
    tests last (Playwright's sync API keeps an event loop running in the main thread)."""
    unplaced = [
        item.nodeid
        for item in items
        if len({m.name for m in item.iter_markers() if m.name in LAYERS}) != 1
        or (item.get_closest_marker("unit") and item.get_closest_marker("django_db"))
    ]
    if unplaced:
        raise pytest.UsageError(
            "each test needs exactly one layer marker (unit, integration, system):\n  "
            + "\n  ".join(unplaced)
        )
    items.sort(key=lambda item: "browser" in item.path.parts)
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.function):
            item.fixturenames.append("_end_of_async_test")


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that opens a socket or starts a process fails, saying where it belongs."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            "a unit test opens no socket and starts no process: mark it integration or system"
        )

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(autouse=True)
def _test_settings(settings: Any) -> None:
    """The embedded model unless a test asks for another backend; a dropped connection stops
    its generation at once (tests of a resume set a grace of their own)."""
    settings.AI_BACKEND = "local"
    settings.QUOTES_RESUME_GRACE_S = 0


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    for alias in ("default", "counters"):
        caches[alias].clear()
    yield
    for alias in ("default", "counters"):
        with contextlib.suppress(Exception):  # a test may have stopped the Redis behind it
            caches[alias].clear()


@pytest.fixture
async def _end_of_async_test() -> AsyncIterator[None]:
    """An async test's generations end, and their rows are written, in its own loop while its
    database is there."""
    yield
    from quotes import state

    await state.reset()  # its streams ended, its rows written, its connections closed
    await sync_to_async(connections.close_all)()


@pytest.fixture
def unlimited(settings: Any) -> Any:
    """Many requests from one client in a row: the per-client limits out of the way."""
    settings.QUOTES_RATE_LIMIT = "1000000/minute"
    settings.QUOTES_MAX_CONCURRENT_STREAMS = 1000
    return settings


@pytest.fixture
def local_backend() -> Iterator[LocalBackend]:
    """The process's embedded model (loaded once for the session)."""
    backend = get_backend("local")
    assert isinstance(backend, LocalBackend)
    queue_timeout = backend.queue_timeout_s
    yield backend
    backend.queue_timeout_s = queue_timeout


@pytest.fixture
def persona(transactional_db: None) -> Persona:
    """A persona with greedy sampling and a small max_tokens: fast and repeatable, saved as an
    editor would save it (so it has its first version)."""
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


#: A completion that keeps its slot for seconds: no stop strings, the end of text ignored.
LONG_COMPLETION = {
    "prompt": "Once upon a time",
    "max_tokens": 800,
    "stream": True,
    "ignore_eos": True,
    "stop": [],
}


@contextlib.asynccontextmanager
async def slots_held(backend: LocalBackend, count: int) -> AsyncIterator[None]:
    """Keep `count` of the embedded model's slots busy until exit."""
    streams = [backend.stream_completion(LONG_COMPLETION) for _ in range(count)]
    try:
        for stream in streams:
            assert isinstance(await anext(stream), Token)
        yield
    finally:
        for stream in streams:
            await stream.aclose()
