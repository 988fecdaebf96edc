"""Per-client rate limits on Django's cache, so they hold across processes when it is Redis.

A fixed window: at most `limit` requests per `window` seconds, counted in a cache key named
after the window, so the count resets when the window does and `Retry-After` is exact.

Counting must be atomic, and Django's cache API is not, on Redis: `incr` is EXISTS then INCRBY,
so a key that expires between the two is recreated with no TTL (a stream slot leaked that way
is held forever), and `aincr` is a get followed by a set. So on Redis each count is one atomic
round trip through a redis-py client of this module's own on the cache's Redis (INCR + EXPIRE in
a MULTI transaction, and a small Lua script to release a slot; Django's RedisCache keeps its own
client private); on the in-memory cache it is `add` /
`incr` under LocMem's own lock, run inline (no I/O, microseconds). Redis calls run in a worker
thread, bounded by REDIS_SOCKET_TIMEOUT (config/settings.py).

django-ratelimit was not used: it is sync-only and shaped as a view decorator, and this check
runs inside the gateway, where the HTTP and WebSocket transports meet.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from .errors import ErrorCode

logger = logging.getLogger(__name__)

# A stream slot outlives a crashed process by at most this long. Every admit refreshes it, so
# it never expires under a client whose streams keep overlapping.
STREAM_SLOT_TTL_S = 600

P = ParamSpec("P")
R = TypeVar("R")

# Release a stream slot only if it still exists (DECR on a missing key would create it at -1,
# with no TTL), and drop it once it reaches zero.
_RELEASE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local left = redis.call('DECR', KEYS[1])
if left <= 0 then redis.call('DEL', KEYS[1]) end
return left
"""


async def run_on_cache(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run a sync cache operation without blocking the loop: inline for the in-memory cache,
    in a worker thread (not the request's own) for a networked one such as Redis."""
    if isinstance(caches["default"], LocMemCache):
        return function(*args, **kwargs)
    return await sync_to_async(function, thread_sensitive=False)(*args, **kwargs)


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


def count_request(bucket: str, client_key: str, *, limit: int, window: int) -> int | None:
    """Count one request of `client_key` in `bucket`'s current window. None while within
    `limit`; else the seconds until the window ends."""
    now = time.time()
    index = int(now // window)
    if _increment(f"quotes:{bucket}:{client_key}:{window}:{index}", window + 1) > limit:
        return max(1, math.ceil((index + 1) * window - now))
    return None


def count_in_window(key: str, timeout: int) -> int:
    """Add one to the counter `key` (made with `timeout` seconds to live); the count so far."""
    return _increment(key, timeout)


def admit(client_key: str, *, limit: int, window: int, max_streams: int) -> tuple[ErrorCode, int] | None:
    """Count one request and take a stream slot. None when admitted; else why not, and the
    seconds until trying again makes sense: ("rate_limited", s) or ("too_many_streams", s)."""
    retry_after = count_request("rate", client_key, limit=limit, window=window)
    if retry_after is not None:
        return ErrorCode.RATE_LIMITED, retry_after
    if _increment(f"quotes:streams:{client_key}", STREAM_SLOT_TTL_S) > max_streams:
        release_stream_slot(client_key)
        return ErrorCode.TOO_MANY_STREAMS, 5
    return None


def release_stream_slot(client_key: str) -> None:
    key = f"quotes:streams:{client_key}"
    store = caches["default"]
    if isinstance(store, RedisCache):
        client, full_key = _redis(store, key)
        client.eval(_RELEASE_SCRIPT, 1, full_key)
        return
    with contextlib.suppress(ValueError):  # the slot expired already
        if store.decr(key) <= 0:
            store.delete(key)


#: Work that outlives the request that started it, referenced until it is done.
_background: set[asyncio.Future[Any]] = set()


def _keep(future: asyncio.Future[Any]) -> None:
    _background.add(future)
    future.add_done_callback(_background.discard)


async def admit_stream(
    client_key: str, *, limit: int, window: int, max_streams: int
) -> tuple[ErrorCode, int] | None:
    """`admit`, safe against cancellation. On Redis it runs in a thread, which goes on if the
    request is cancelled meanwhile (the visitor left): the slot it then takes would never be
    released by the request. So it is shielded, and a cancelled request's slot is given back
    as soon as the admission finishes."""
    if isinstance(caches["default"], LocMemCache):
        return admit(client_key, limit=limit, window=window, max_streams=max_streams)  # no await: atomic
    admission = asyncio.ensure_future(
        run_on_cache(admit, client_key, limit=limit, window=window, max_streams=max_streams)
    )
    try:
        return await asyncio.shield(admission)
    except asyncio.CancelledError:
        _keep(admission)
        admission.add_done_callback(functools.partial(_give_back, client_key=client_key))
        raise


def _give_back(admission: asyncio.Future[tuple[str, int] | None], *, client_key: str) -> None:
    """Release the slot a cancelled request's admission took, if it took one."""
    if admission.cancelled():
        return
    if (error := admission.exception()) is not None:
        logger.warning("a cancelled request's admission failed: %r", error)
        return
    if admission.result() is None:
        release = asyncio.ensure_future(run_on_cache(release_stream_slot, client_key))
        _keep(release)
        release.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        logger.warning("could not release a cancelled request's stream slot: %r", error)
