"""Rate-limit counters and stream slots on a real Redis (issue 13, point 10), through the stream
endpoint of the real ASGI app; the upstream is the fake Workers AI server.

- a client's stream slot is a lease that expires within seconds unless its process renews it,
  so a killed process's slots come back, and a refusal extends none;
- a request cancelled while its admission is in flight leaves at most a lease nobody renews;
- Redis calls have socket timeouts (REDIS_CONNECT_TIMEOUT / REDIS_SOCKET_TIMEOUT), so a Redis
  that accepts connections and never answers fails requests instead of hanging them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.gateway import admission
from quotes.ai.gateway.generation import Client
from quotes.models import Generation, Persona
from tests.asgi import post_quote, post_stream
from tests.limits import configure
from tests.redis_server import REDIS_CACHE_BACKEND

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture
def shared(settings: Any, redis_server: str) -> Iterator[redis.Redis]:
    """REDIS_URL set (a database of its own, emptied): the client's stream slots are leases in
    Redis (quotes.ai.gateway.admission). Yields a client on that database."""
    settings.REDIS_URL = redis_server.rsplit("/", 1)[0] + "/6"
    store = redis.Redis.from_url(settings.REDIS_URL)
    store.flushdb()
    yield store
    store.flushdb()
    store.close()


def lease_key() -> str:
    """The lease set of the tests' client (127.0.0.1)."""
    return admission.lease_key(Client.from_request("127.0.0.1").key)


def leases(store: redis.Redis) -> dict[bytes, float]:
    return dict(store.zrange(lease_key(), 0, -1, withscores=True))


@pytest.mark.system
async def test_redis_a_stream_slot_is_a_lease_that_expires_within_seconds(
    persona: Persona, fake: FakeWorkersAI, shared: redis.Redis
) -> None:
    fake.script(Scenario(tokens=["tick"] * 50, token_delay_s=0.02))
    stream = post_stream(quote_body())
    assert (await stream.start()).status == 200

    [expiry] = leases(shared).values()
    now_ms = time.time() * 1000
    assert now_ms < expiry <= now_ms + admission.LEASE_TTL_S * 1000  # gone soon after a kill -9
    assert 0 < shared.pttl(lease_key()) <= admission.LEASE_TTL_S * 1000
    await stream.read_all()
    assert not shared.exists(lease_key())  # given back at the end


@pytest.mark.system
async def test_redis_a_dead_process_lease_does_not_count_and_a_refusal_extends_none(
    persona: Persona, fake: FakeWorkersAI, shared: redis.Redis, settings: Any
) -> None:
    configure(settings, max_concurrent_streams=1)
    # A lease of a process killed long ago (expired), and one that still runs for 2 s.
    now_ms = time.time() * 1000
    shared.zadd(lease_key(), {"dead:1": now_ms - 1000})
    response = await post_quote(quote_body())
    assert response.status == 200  # the dead lease held nothing
    shared.zadd(lease_key(), {"dying:1": now_ms + 2000})

    refused = await post_quote(quote_body("again"))

    assert refused.status == 429 and refused.json()["error"]["code"] == "too_many_streams"
    assert leases(shared) == {b"dying:1": now_ms + 2000}  # not extended by the refusal


@pytest.mark.system
async def test_redis_a_request_cancelled_during_admit_leaves_no_lease_renewed(
    persona: Persona, fake: FakeWorkersAI, shared: redis.Redis
) -> None:
    # Scripts wait while Redis is paused: the admission is stuck in flight.
    shared.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    try:
        request = post_stream(quote_body())
        await request.communicator.send_input({"type": "http.request", "body": request.body})
        for _ in range(500):
            if any("b" in client["flags"] for client in shared.client_list()):
                break  # a client blocked by the pause: the admission is waiting
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the request never reached Redis")

        await request.communicator.send_input({"type": "http.disconnect"})  # the visitor leaves
        await request.communicator.wait(10)
    finally:
        shared.execute_command("CLIENT", "UNPAUSE")

    # The admission may complete in Redis after all: its lease is nobody's, and lapses.
    await asyncio.sleep(0.2)
    assert not admission.leases.held
    now_ms = time.time() * 1000
    assert all(expiry <= now_ms + admission.LEASE_TTL_S * 1000 for expiry in leases(shared).values())
    row = await Generation.objects.aget()
    assert row.status == Generation.Status.CANCELLED
    assert fake.requests == []


@pytest.mark.system
def test_redis_socket_timeouts_come_from_the_settings(hung_redis: str, tmp_path: Path) -> None:
    """A fresh interpreter configured from the environment, as production starts: the Redis
    clients behind the cache and the admission have the configured timeouts (redis-py's own
    default is 5 s), and an admission against a Redis that never answers gives up on it after
    that timeout and admits on this process's own counts (issue 21: Redis is not the truth)."""
    code = (
        "import asyncio, django, json, time; django.setup()\n"
        "from django.conf import settings\n"
        "from django.core.cache import cache\n"
        "from quotes.ai import limits\n"
        "from quotes.ai.gateway import admission, redis_clients\n"
        "limiter = limits.redis_client().connection_pool.connection_kwargs\n"
        "cached = cache._cache.get_client('x', write=True).connection_pool.connection_kwargs\n"
        "async def main():\n"
        "    pool = redis_clients.client().connection_pool.connection_kwargs\n"
        "    started = time.monotonic()\n"
        "    try:\n"
        "        ticket = await admission.admit('ip:x', settings.QUOTES_GATEWAY)\n"
        "        error = type(ticket).__name__\n"
        "    except Exception as exc:\n"
        "        error = type(exc).__name__\n"
        "    from quotes.ai.redis_health import breaker\n"
        "    return {'error': error, 'seconds': round(time.monotonic() - started, 2),\n"
        "        'socket_timeout': pool.get('socket_timeout'), 'connect_timeout': pool.get('socket_connect_timeout'),\n"
        "        'cache': [cached.get('socket_timeout'), cached.get('socket_connect_timeout')],\n"
        "        'limiter': [limiter.get('socket_timeout'), limiter.get('socket_connect_timeout')],\n"
        "        'redis_failing': breaker.failing}\n"
        "print(json.dumps(asyncio.run(main())))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "AI_", "REDIS_", "QUOTES_"))}
    env.update(
        DJANGO_DEBUG="true",
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
    assert found["cache"] == [0.5, 0.25], found
    assert found["limiter"] == [0.5, 0.25], found
    assert found["error"] == "Ticket", found
    assert found["redis_failing"] is True, found
    assert found["seconds"] < 5, found  # the configured timeout, not redis-py's default


@pytest.mark.integration
async def test_redis_that_hangs_costs_one_timeout_and_the_quotes_are_served(
    persona: Persona, fake: FakeWorkersAI, settings: Any, hung_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared cache on a Redis that never answers (issue 21): the first request waits one
    socket timeout, then the process serves on its own (no answer cache, its own counts), with
    one WARNING for the outage, not one per request and no traceback."""
    settings.CACHES = {
        "default": {
            "BACKEND": REDIS_CACHE_BACKEND,
            "LOCATION": hung_redis,
            "OPTIONS": {**settings.REDIS_OPTIONS, "socket_timeout": 0.3},
        }
    }

    answers = [await post_quote(quote_body(topic)) for topic in ("rain", "snow", "hail")]

    assert [answer.status for answer in answers] == [200, 200, 200]
    assert all(answer.body.endswith(b"data: [DONE]\n\n") for answer in answers)
    rows = [row async for row in Generation.objects.order_by("id")]
    assert [row.status for row in rows] == [Generation.Status.OK] * 3
    warnings = [r for r in caplog.records if r.name == "quotes.ai.redis_health" and r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]


@contextlib.contextmanager
def logged(*names: str) -> Iterator[list[logging.LogRecord]]:
    """The records the named loggers handle meanwhile (whatever their propagation)."""
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


@pytest.mark.integration
async def test_redis_url_down_streams_are_served_by_the_process_alone(
    persona: Persona, fake: FakeWorkersAI, settings: Any, closed_port: int
) -> None:
    """REDIS_URL names a Redis that refuses connections (stopped, or absent at start): quotes are
    served all the same, on this process's own limits, with one WARNING for the outage."""
    url = f"redis://127.0.0.1:{closed_port}/0"
    settings.REDIS_URL = url
    settings.CACHES = {
        "default": {"BACKEND": REDIS_CACHE_BACKEND, "LOCATION": url, "OPTIONS": settings.REDIS_OPTIONS}
    }
    configure(settings, max_concurrent_streams=1)

    with logged("quotes", "django") as records:
        answers = [await post_quote(quote_body(topic)) for topic in ("rain", "snow")]

    assert [answer.status for answer in answers] == [200, 200], answers[0].body[:300]
    assert all(answer.body.endswith(b"data: [DONE]\n\n") for answer in answers)
    warnings = [r for r in records if r.name == "quotes.ai.redis_health" and r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert not [r for r in records if r.levelname == "ERROR" or r.exc_info], [r.getMessage() for r in records]


@pytest.mark.integration
async def test_redis_down_when_a_slot_is_given_back_logs_no_traceback(settings: Any, tmp_path: Path) -> None:
    """A slot taken in Redis, given back once Redis is gone (issue 21's fault suite found one
    WARNING with a traceback per Redis outage, from this release): the lease expires by itself,
    the outage is the breaker's one WARNING, and nothing is logged with a traceback."""
    from harness.services import redis_server
    from quotes.ai.redis_health import breaker

    with redis_server(tmp_path) as server:
        settings.REDIS_URL = server.url
        ticket = await admission.admit("ip:gone", settings.QUOTES_GATEWAY)
        assert isinstance(ticket, admission.Ticket) and not ticket.lease.startswith(admission.LOCAL)
        server.stop()
        with logged("quotes") as records:
            await ticket.release()

    assert breaker.failing  # the next callers skip Redis at once
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    assert [(r.name, r.levelname) for r in records if r.levelno >= logging.WARNING] == [
        ("quotes.ai.redis_health", "WARNING")
    ], [r.getMessage() for r in records]
