"""Per-client rate limits on Django's cache, so they hold across processes when it is Redis.

A fixed window: at most `limit` requests per `window` seconds, counted in a cache key named
after the window, so the count resets when the window does and `Retry-After` is exact.

Counting must be atomic, and Django's async cache API is not: `aincr` is a get followed by a
set. So each check is one sync function built on `add`/`incr` (atomic in LocMem and Redis),
run inline for the in-memory cache (no I/O, microseconds) and with one thread hop otherwise.
django-ratelimit was not used: it is sync-only and shaped as a view decorator, and this check
runs inside the gateway, where the HTTP and WebSocket transports meet.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.core.cache import cache, caches
from django.core.cache.backends.locmem import LocMemCache

# A stream slot outlives a crashed process by at most this long.
STREAM_SLOT_TTL_S = 600

P = ParamSpec("P")
R = TypeVar("R")


async def run_on_cache(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run a sync cache operation without blocking the loop: inline for the in-memory cache,
    in a worker thread (not the request's own) for a networked one such as Redis."""
    if isinstance(caches["default"], LocMemCache):
        return function(*args, **kwargs)
    return await sync_to_async(function, thread_sensitive=False)(*args, **kwargs)


def _increment(key: str, timeout: int) -> int:
    if cache.add(key, 1, timeout=timeout):
        return 1
    try:
        return cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.add(key, 1, timeout=timeout)
        return 1


def count_in_window(key: str, timeout: int) -> int:
    """Add one to the counter `key` (made with `timeout` seconds to live); the count so far."""
    return _increment(key, timeout)


def admit(client_key: str, *, limit: int, window: int, max_streams: int) -> tuple[str, int] | None:
    """Count one request and take a stream slot. None when admitted; else why not, and the
    seconds until trying again makes sense: ("rate_limited", s) or ("too_many_streams", s)."""
    now = time.time()
    index = int(now // window)
    if _increment(f"quotes:rate:{client_key}:{window}:{index}", window + 1) > limit:
        return "rate_limited", max(1, math.ceil((index + 1) * window - now))
    if _increment(f"quotes:streams:{client_key}", STREAM_SLOT_TTL_S) > max_streams:
        release_stream_slot(client_key)
        return "too_many_streams", 5
    return None


def release_stream_slot(client_key: str) -> None:
    with contextlib.suppress(ValueError):  # the slot expired already
        cache.decr(f"quotes:streams:{client_key}")
