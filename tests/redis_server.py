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

REDIS_CACHE_BACKEND = "django.core.cache.backends.redis.RedisCache"


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
    """Django's default cache on the real Redis; yields a redis-py client on the same database."""
    import redis
    from django.core.cache import close_caches

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    settings.CACHES = {
        "default": {
            "BACKEND": REDIS_CACHE_BACKEND,
            "LOCATION": redis_server,
            "OPTIONS": settings.REDIS_OPTIONS,
        }
    }
    if settings.REDIS_URL:
        # As deployed, REDIS_URL names the cache's Redis: the admission's counts and slots, and
        # the runs shared across processes, go to the same server as the cache.
        settings.REDIS_URL = redis_server
    try:
        yield client
    finally:
        client.flushdb()
        client.close()
        with contextlib.suppress(Exception):
            close_caches()
