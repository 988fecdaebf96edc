"""What Redis holds is data, never code, and Redis is never the truth (issues 13 and 29), through
the real ASGI app on a real Redis (tests/redis_server.py); the upstream is the fake Workers AI.

- Django's cache keeps JSON, not pickle (quotes.cache.JSONSerializer): a pickle written at the
  app's keys runs nothing, and a value of the wrong shape is a miss (logged), never a 500.
- The rate-limit counters live in Redis, so every process counts the same client.
- Redis refusing connections, or accepting them and never answering (socket timeouts): quotes
  and their 4xx are served all the same, on this process's own counts, with one WARNING each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import socket
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.workers_ai import FakeWorkersAI
from quotes import cache as quotes_cache
from quotes import state
from quotes.models import Persona
from tests.asgi import StreamedResponse, post_quote, request

pytestmark = pytest.mark.django_db(transaction=True)

DONE = b"data: [DONE]\n\n"


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    return fake


class Exploit:
    """A pickle that, loaded, runs a shell command (creates `marker`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@contextlib.contextmanager
def logged(*names: str) -> Iterator[list[logging.LogRecord]]:
    """The records the named loggers handle meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        yield records
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)


def troubles(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR or r.exc_info]


async def answer_keys(store: redis.Redis) -> list[bytes]:
    for _ in range(100):  # the answer is kept as the generation ends
        if keys := list(store.scan_iter(match="*quotes:answer:*")):
            return keys
        await asyncio.sleep(0.02)
    raise AssertionError("no answer was kept in Redis")


@pytest.mark.system
async def test_pickles_at_the_apps_keys_run_nothing_and_the_requests_are_served(
    fake: FakeWorkersAI, redis_cache: redis.Redis, tmp_path: Path
) -> None:
    """Every string the app wrote to Redis replaced by a pickle whose __reduce__ runs a command,
    then a persona page and a quote: the command never runs, each request is answered."""
    assert (await post_quote()).status == 200
    await answer_keys(redis_cache)
    keys = {
        key: redis_cache.get(key) for key in redis_cache.scan_iter() if redis_cache.type(key) == b"string"
    }
    assert all(json.loads(value) is not None for value in keys.values()), keys  # as written: JSON
    marker = tmp_path / "ran"
    for key in keys:
        redis_cache.set(key, pickle.dumps(Exploit(marker)))

    with logged("quotes", "django") as records:
        page = await request("GET", "/personas/test-watts/")
        again = await post_quote()

    assert not marker.exists()
    assert page.status == 200 and b"Alan Watts" in page.body
    assert again.status == 200 and again.body.endswith(DONE)
    assert len(fake.requests) == 2  # the kept answer read as a miss: asked again
    warnings = {r.getMessage() for r in records if r.levelno == logging.WARNING and r.name == "quotes.cache"}
    assert warnings == {"a value in the cache is not JSON: read as a miss"}
    assert troubles(records) == []


@pytest.mark.system
async def test_an_answer_of_the_wrong_shape_is_a_miss(fake: FakeWorkersAI, redis_cache: redis.Redis) -> None:
    assert (await post_quote()).status == 200
    [key] = await answer_keys(redis_cache)
    redis_cache.set(key, json.dumps([{"meta": {"model": "m\r\nSet-Cookie: a=b", "headers": {}, "step": 0}}]))

    with logged("quotes", "django") as records:
        again = await post_quote()

    assert again.status == 200 and again.body.endswith(DONE)
    assert "set-cookie" not in again.headers and len(fake.requests) == 2
    assert [r.getMessage() for r in records if r.levelno == logging.WARNING] == [
        "an answer in the cache has an unexpected shape: read as a miss"
    ]
    assert troubles(records) == []


async def in_another_process(asked: Awaitable[StreamedResponse]) -> StreamedResponse:
    try:
        return await asked
    finally:
        await state.reset()  # this loop's connections to Redis


@pytest.mark.system
async def test_rate_limits_are_counted_in_redis_for_every_process(
    fake: FakeWorkersAI, redis_cache: redis.Redis, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "2/minute"
    here = [(await post_quote({"persona": "nobody"})).status for _ in range(2)]
    # Another event loop is another process to the app: its own limiter, its own memory.
    elsewhere = await asyncio.to_thread(asyncio.run, in_another_process(post_quote({"persona": "nobody"})))

    assert here == [404, 404]
    assert (elsewhere.status, elsewhere.json()["error"]["code"]) == (429, "rate_limited")
    assert list(redis_cache.scan_iter(match="LIMITS*"))


@pytest.fixture(params=["refusing", "hanging"])
def down_redis(request: pytest.FixtureRequest, closed_port: int) -> Iterator[str]:
    """A Redis that refuses connections, or a TCP port that completes them (the kernel's backlog)
    and never answers a byte."""
    if request.param == "refusing":
        yield f"redis://127.0.0.1:{closed_port}/0"
        return
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"


@pytest.mark.integration
async def test_redis_down_quotes_and_their_4xx_are_served_on_this_process_alone(
    fake: FakeWorkersAI, settings: Any, monkeypatch: pytest.MonkeyPatch, down_redis: str
) -> None:
    url = down_redis
    shared = {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": url,
        "OPTIONS": {
            "serializer": "quotes.cache.JSONSerializer",
            "socket_connect_timeout": 0.5,
            "socket_timeout": 0.5,
        },
    }
    settings.REDIS_URL, settings.CACHES = url, {"default": shared, "counters": shared}
    settings.QUOTES_RATE_LIMIT = "2/minute"
    for name in ("down_until", "failing"):  # the cache's outage ends with this test
        monkeypatch.setattr(quotes_cache.shared, name, getattr(quotes_cache.shared, name))

    with logged("quotes", "django") as records:
        unknown = [(await post_quote({"persona": "nobody"})).status for _ in range(3)]
        broken = await post_quote(b"{not json", client=("198.51.100.1", 1))
        feedback = await request("POST", f"/api/quotes/{uuid.uuid4()}/feedback", json_body={"value": 1})
        quote = await post_quote(client=("198.51.100.2", 1))

    assert unknown == [404, 404, 429]  # counted all the same, in this process
    assert (broken.status, feedback.status) == (400, 404)
    assert quote.status == 200 and quote.body.endswith(DONE)
    warnings = sorted(r.name for r in records if r.levelno == logging.WARNING and r.name.startswith("quotes"))
    assert warnings == ["quotes.cache", "quotes.rate_limits"], [r.getMessage() for r in records]
    assert troubles(records) == []
