"""A real Redis for the tests (register with `pytest_plugins = ["tests.redis_server"]`).

- `redis_server`: a `redis-server` subprocess on a free 127.0.0.1 port (harness.services), one
  per test session; yields its URL, redis://127.0.0.1:<port>/0. No persistence.
- `redis_cache`: Django's default cache pointed at that server (RedisCache, with the app's
  OPTIONS: its JSON serializer and timeouts), emptied before and after the test; yields a
  redis-py client on the same database, to look at the keys.

redis-server comes from the Debian package (`apt-get install -y redis-server`). When it is
missing the fixture FAILS: a test that asked for Redis must not pass without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from harness import services


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(services.redis_server(tmp_path_factory.mktemp("redis")))
        except services.ServiceError as exc:
            pytest.fail(f"these tests need a real Redis: {exc}", pytrace=False)
        yield server.url


@pytest.fixture
def redis_cache(settings: Any, redis_server: str) -> Iterator[Any]:
    """The site on the real Redis (REDIS_URL: the caches and the rate limits), emptied before
    and after; yields a redis-py client on the same database, to look at the keys."""
    import redis
    from django.core.cache import close_caches

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    shared = {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": redis_server,
        "OPTIONS": {
            "serializer": "quotes.cache.JSONSerializer",
            "socket_connect_timeout": 2,
            "socket_timeout": 2,
        },
    }
    settings.CACHES = {"default": shared, "counters": shared}
    settings.REDIS_URL = redis_server
    try:
        yield client
    finally:
        client.flushdb()
        client.close()
        with contextlib.suppress(Exception):
            close_caches()
