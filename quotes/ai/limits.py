"""Per-client rate limits on Django's cache, so they hold across processes when it is Redis.

A fixed window: at most `limit` requests per `window` seconds, counted in a cache key named
after the window, so the count resets when the window does and `Retry-After` is exact.

Counting must be atomic, and Django's cache API is not, on Redis: `incr` is EXISTS then INCRBY,
so a key that expires between the two is recreated with no TTL, and `aincr` is a get followed
by a set. So on Redis each count is one atomic round trip through a redis-py client of this
module's own on the cache's Redis (INCR + EXPIRE in a MULTI transaction; Django's RedisCache
keeps its own client private); on the in-memory cache it is `add` /
`incr` under LocMem's own lock, run inline (no I/O, microseconds). Redis calls run in a worker
thread, bounded by REDIS_SOCKET_TIMEOUT (config/settings.py).

django-ratelimit was not used: it is sync-only and shaped as a view decorator, and this check
runs inside the gateway, where the HTTP and WebSocket transports meet.

A stream's admission (its rate count and the client's concurrent-stream slot, as leases) is
quotes.ai.gateway.admission's: it counts in the same keys (`rate_key`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache
from redis.exceptions import RedisError

from .redis_health import breaker

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


async def run_on_cache(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run a sync cache operation without blocking the loop: inline for the in-memory cache,
    in a worker thread (not the request's own) for a networked one such as Redis. A Redis that
    failed a moment ago is not asked (RedisUnavailable at once: quotes.ai.redis_health)."""
    if isinstance(caches["default"], LocMemCache):
        return function(*args, **kwargs)
    breaker.check()
    try:
        result = await sync_to_async(function, thread_sensitive=False)(*args, **kwargs)
    except (RedisError, OSError) as exc:
        breaker.failed(exc)
        raise
    breaker.succeeded()
    return result


#: Django's own options for its RedisCache, not redis-py's.
_DJANGO_ONLY_OPTIONS = ("parser_class", "pool_class", "serializer")


@functools.cache
def _client(url: str, options: tuple[tuple[str, Any], ...]) -> redis.Redis:
    return redis.Redis.from_url(url, **dict(options))


def redis_client() -> redis.Redis:
    """A redis-py client on the server Django's default cache writes to (the first of its
    LOCATION, as RedisCache picks for a write), with the cache's OPTIONS (the socket timeouts)."""
    cache: dict[str, Any] = settings.CACHES["default"]
    location = cache["LOCATION"]
    servers = location.split(",") if isinstance(location, str) else location
    options = {k: v for k, v in cache.get("OPTIONS", {}).items() if k not in _DJANGO_ONLY_OPTIONS}
    return _client(servers[0], tuple(sorted(options.items())))


def _redis(store: RedisCache, key: str) -> tuple[redis.Redis, str]:
    """The client for `key`, and the key as Django's cache names it (its prefix and version)."""
    return redis_client(), store.make_and_validate_key(key)


def _increment(key: str, timeout: int) -> int:
    """Add one to `key` and (re)set its TTL, atomically; the new count."""
    store = caches["default"]
    if isinstance(store, RedisCache):
        client, full_key = _redis(store, key)
        pipeline = client.pipeline(transaction=True)
        pipeline.incr(full_key)
        pipeline.expire(full_key, timeout)
        count, _ = pipeline.execute()
        return int(count)
    if store.add(key, 1, timeout=timeout):
        return 1
    try:
        count = store.incr(key)
    except ValueError:  # expired between add and incr
        store.add(key, 1, timeout=timeout)
        return 1
    store.touch(key, timeout)
    return int(count)


def rate_key(bucket: str, client_key: str, window: int, index: int) -> str:
    """The counter of `client_key`'s requests in `bucket` in window number `index`."""
    return f"quotes:{bucket}:{client_key}:{window}:{index}"


def cache_key(key: str) -> str:
    """`key` as the default cache names it in its store (Django's `make_key`): a script run on
    Redis itself counts in the same key as the cache does."""
    return caches["default"].make_key(key)


async def count_request(bucket: str, client_key: str, *, limit: int, window: int) -> int | None:
    """Count one request of `client_key` in `bucket`'s current window. None while within
    `limit`; else the seconds until the window ends. While Redis is down, counted in this
    process alone (`count_here`): the limit then holds per process, not across them."""
    now = time.time()
    index = int(now // window)
    if await count(rate_key(bucket, client_key, window, index), window + 1) > limit:
        return max(1, math.ceil((index + 1) * window - now))
    return None


async def count(key: str, ttl: int) -> int:
    """Add one to the counter `key` (made with `ttl` seconds to live) in the cache, or while
    Redis is down in this process's memory; the count so far."""
    try:
        return await run_on_cache(_increment, key, ttl)
    except (RedisError, OSError):
        return count_here(key, ttl)


#: Counts kept in this process while Redis is down: key -> (count, expiry on the monotonic clock).
counts_here: dict[str, tuple[int, float]] = {}


def count_here(key: str, timeout: int) -> int:
    """Add one to `key` in this process's memory (made with `timeout` seconds to live)."""
    now = time.monotonic()
    if len(counts_here) > 100_000:  # bounded: expired windows go
        for old in [k for k, (_, expiry) in counts_here.items() if expiry <= now]:
            del counts_here[old]
    total, expiry = counts_here.get(key, (0, 0.0))
    if expiry <= now:
        total, expiry = 0, now + timeout
    counts_here[key] = (total + 1, expiry)
    return total + 1


def count_in_window(key: str, timeout: int) -> int:
    """Add one to the counter `key` (made with `timeout` seconds to live); the count so far."""
    return _increment(key, timeout)
