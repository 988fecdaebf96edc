"""Per-client rate limits on Django's cache, so they hold across processes when it is Redis.

A fixed window: at most `limit` requests per `window` seconds, counted in a cache key named
after the window, so the count resets when the window does and `Retry-After` is exact. It is a
few lines on Django's async cache API (atomic `incr` on LocMem and Redis): django-ratelimit is
sync-only and shaped as a view decorator, and this check must run inside the gateway, where the
HTTP and WebSocket transports meet.
"""

from __future__ import annotations

import contextlib
import math
import time

from django.core.cache import cache

# A stream slot outlives a crashed process by at most this long.
STREAM_SLOT_TTL_S = 600


async def count_request(client_key: str, *, limit: int, window: int) -> int | None:
    """Count one request. None when it is allowed, else the seconds until the window resets."""
    now = time.time()
    index = int(now // window)
    key = f"quotes:rate:{client_key}:{window}:{index}"
    if await cache.aadd(key, 1, timeout=window + 1):
        count = 1
    else:
        try:
            count = await cache.aincr(key)
        except ValueError:  # expired between add and incr: a new window has begun
            await cache.aadd(key, 1, timeout=window + 1)
            count = 1
    if count <= limit:
        return None
    return max(1, math.ceil((index + 1) * window - now))


async def acquire_stream_slot(client_key: str, *, limit: int) -> bool:
    """Take one of the client's concurrent-stream slots; False when all are taken."""
    key = f"quotes:streams:{client_key}"
    await cache.aadd(key, 0, timeout=STREAM_SLOT_TTL_S)
    try:
        taken = await cache.aincr(key)
    except ValueError:
        await cache.aadd(key, 1, timeout=STREAM_SLOT_TTL_S)
        taken = 1
    if taken > limit:
        await release_stream_slot(client_key)
        return False
    return True


async def release_stream_slot(client_key: str) -> None:
    with contextlib.suppress(ValueError):  # the slot expired already
        await cache.adecr(f"quotes:streams:{client_key}")
