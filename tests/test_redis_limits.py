"""Rate-limit counters and stream slots on a real Redis (issue 13, point 10), through the stream
endpoint of the real ASGI app; the upstream is the fake Workers AI server.

- a count is one atomic INCR + EXPIRE, so a key never lives without a TTL, and each admit
  refreshes the stream slot's TTL;
- a request cancelled while its admission is in flight gives its slot back;
- Redis calls have socket timeouts (REDIS_CONNECT_TIMEOUT / REDIS_SOCKET_TIMEOUT), so a Redis
  that accepts connections and never answers fails requests instead of hanging them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import cache

from quotes.ai.backends import reset_backends
from quotes.ai.gateway import Client
from quotes.models import Generation, Persona
from tests.asgi import post_quote, post_stream
from tests.fakes.workers_ai import FakeWorkersAI, Scenario
from tests.redis_server import REDIS_CACHE_BACKEND

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[1]
STREAM_URL = "/api/quotes/stream"


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    yield fake_workers_ai
    await reset_backends()


@pytest.fixture
def hung_redis() -> Iterator[str]:
    """A TCP port that completes connections (the kernel's backlog) and never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


def quote_body(topic: str = "rain") -> dict[str, str]:
    return {"persona": "test-watts", "topic": topic}


def slot_key() -> str:
    """The stream-slot key of the tests' client (127.0.0.1), as Django names it in Redis."""
    return cache.make_and_validate_key(f"quotes:streams:{Client.from_request('127.0.0.1').key}")


async def test_redis_a_slot_key_without_a_ttl_gets_one_on_the_next_admit(
    persona: Persona, fake: FakeWorkersAI, redis_cache: Any
) -> None:
    """What Django's EXISTS-then-INCRBY left behind when the key expired between the two: a
    count with no TTL, a slot held forever. The next count must give it a TTL again."""
    redis_cache.set(slot_key(), 1)
    assert redis_cache.ttl(slot_key()) == -1

    response = await post_quote(quote_body())

    assert response.status == 200 and response.body.endswith(b"data: [DONE]\n\n")
    assert int(redis_cache.get(slot_key())) == 1  # the leaked slot, no longer everlasting
    assert 0 < redis_cache.ttl(slot_key()) <= 600


async def test_redis_each_admit_refreshes_the_slot_ttl(
    persona: Persona, fake: FakeWorkersAI, redis_cache: Any
) -> None:
    fake.script(Scenario(tokens=["tick"] * 100, token_delay_s=0.02), Scenario())
    first = post_stream(quote_body("one"))
    assert (await first.start()).status == 200
    assert int(redis_cache.get(slot_key())) == 1
    redis_cache.expire(slot_key(), 5)  # as if the first stream had been open for ten minutes

    second = await post_quote(quote_body("two"))

    assert second.status == 200
    assert int(redis_cache.get(slot_key())) == 1  # the second stream's slot is released
    assert redis_cache.ttl(slot_key()) > 500  # and the first one's is no longer about to vanish
    await first.read_all()
    assert redis_cache.get(slot_key()) is None  # all released: the key is gone, not left at 0


async def test_redis_a_request_cancelled_during_admit_gives_its_slot_back(
    persona: Persona, fake: FakeWorkersAI, redis_cache: Any
) -> None:
    # Writes wait while Redis is paused: the admission (INCR + EXPIRE) is stuck in flight.
    redis_cache.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    try:
        request = post_stream(quote_body())
        await request.communicator.send_input({"type": "http.request", "body": request.body})
        for _ in range(500):
            if any("b" in client["flags"] for client in redis_cache.client_list()):
                break  # a client blocked by the pause: the admission is waiting
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the request never reached Redis")

        await request.communicator.send_input({"type": "http.disconnect"})  # the visitor leaves
        await request.communicator.wait(10)
    finally:
        redis_cache.execute_command("CLIENT", "UNPAUSE")

    for _ in range(250):  # the admission now completes, and takes a slot
        if redis_cache.get(slot_key()) is None and not redis_cache.keys("*quotes:streams:*"):
            break
        await asyncio.sleep(0.02)
    assert redis_cache.get(slot_key()) is None, "the cancelled request's slot was never released"
    row = await Generation.objects.aget()
    assert row.status == Generation.Status.CANCELLED
    assert fake.requests == []


def test_redis_socket_timeouts_come_from_the_settings(hung_redis: str, tmp_path: Path) -> None:
    """A fresh interpreter configured from the environment, as production starts: the Redis
    client behind the cache and the limiter has the configured timeouts (redis-py's own default
    is 5 s), and its first call to a Redis that never answers fails with a timeout."""
    code = (
        "import django, json, time; django.setup()\n"
        "from django.core.cache import cache\n"
        "from quotes.ai import limits\n"
        "pool = cache._cache.get_client('x', write=True).connection_pool.connection_kwargs\n"
        "limiter = limits.redis_client().connection_pool.connection_kwargs\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    limits.admit('ip:x', limit=5, window=60, max_streams=3)\n"
        "    error = None\n"
        "except Exception as exc:\n"
        "    error = type(exc).__name__\n"
        "print(json.dumps({'error': error, 'seconds': round(time.monotonic() - started, 2),\n"
        "    'socket_timeout': pool.get('socket_timeout'), 'connect_timeout': pool.get('socket_connect_timeout'),\n"
        "    'limiter': [limiter.get('socket_timeout'), limiter.get('socket_connect_timeout')]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "AI_", "REDIS_", "QUOTES_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        REDIS_URL=hung_redis,
        REDIS_SOCKET_TIMEOUT="0.5",
        REDIS_CONNECT_TIMEOUT="0.25",
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert (found["socket_timeout"], found["connect_timeout"]) == (0.5, 0.25), found
    assert found["limiter"] == [0.5, 0.25], found
    assert found["error"] == "TimeoutError", found


async def test_redis_that_hangs_fails_the_request_instead_of_holding_it(
    persona: Persona, fake: FakeWorkersAI, settings: Any, hung_redis: str
) -> None:
    settings.CACHES = {
        "default": {
            "BACKEND": REDIS_CACHE_BACKEND,
            "LOCATION": hung_redis,
            "OPTIONS": {**settings.REDIS_OPTIONS, "socket_timeout": 0.3},
        }
    }

    response = await post_quote(quote_body())  # would wait forever without a socket timeout (the test: 30 s)

    assert response.status == 500, response.body
    assert response.json()["error"]["code"] == "internal_error"
    row = await Generation.objects.aget()
    assert row.status == Generation.Status.ERROR
    assert fake.requests == []
