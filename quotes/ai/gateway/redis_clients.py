"""This process's Redis clients for the stream core (only when REDIS_URL is set): admission's
leases and the shared runs. Two pools: a small blocking one for short calls, which wait for a
free connection rather than fail when every run publishes at once; and one for blocking reads
(XREAD BLOCK holds its connection), so that those never starve the short calls.

The clients are bound to the running event loop: daphne has one for its life; a test has its
own, and `close()` (in the test's loop) or `forget()` (after it) ends them.
"""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis
from django.conf import settings

from ... import forks
from ..redis_health import RedisUnavailable, breaker

#: This process, as the keys it holds name it (heartbeats, leases, its stop list).
PROCESS = uuid.uuid4().hex

SHORT_CONNECTIONS = 16
#: Admission bounds the readers; this bounds what a fault could still open.
BLOCKING_CONNECTIONS = 1_000


def enabled() -> bool:
    return bool(settings.REDIS_URL)


def usable() -> bool:
    """REDIS_URL is set, and Redis has not failed a moment ago (quotes.ai.redis_health)."""
    return bool(settings.REDIS_URL) and breaker.available()


def failed(error: BaseException) -> None:
    """A call to Redis failed: the breaker opens. Not on the breaker's own refusal: re-opened by
    each, it would never close for a caller that only retries."""
    if not isinstance(error, RedisUnavailable):
        breaker.failed(error)


_clients: tuple[asyncio.AbstractEventLoop, aioredis.Redis, aioredis.Redis] | None = None


def _pools() -> tuple[aioredis.Redis, aioredis.Redis]:
    global _clients
    loop = asyncio.get_running_loop()
    if _clients is None or _clients[0] is not loop:
        forget()
        timeout = settings.REDIS_OPTIONS["socket_timeout"]
        options = {
            "socket_timeout": timeout,
            "socket_connect_timeout": settings.REDIS_OPTIONS["socket_connect_timeout"],
            "timeout": timeout,  # the wait for a free connection
        }
        short = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, max_connections=SHORT_CONNECTIONS, **options
        )
        blocking = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, max_connections=BLOCKING_CONNECTIONS, **options
        )
        _clients = (loop, aioredis.Redis.from_pool(short), aioredis.Redis.from_pool(blocking))
    return _clients[1], _clients[2]


def client() -> aioredis.Redis:
    """For short calls."""
    return _pools()[0]


def reader() -> aioredis.Redis:
    """For blocking reads (XREAD BLOCK)."""
    return _pools()[1]


def block_ms() -> int:
    """How long one XREAD waits: well within the socket timeout, so a quiet stream is no error."""
    return max(1, min(1000, int(settings.REDIS_OPTIONS["socket_timeout"] * 500)))


def forget() -> None:
    """Drop clients whose loop is gone (a finished test's), closing their sockets without it."""
    global _clients
    if _clients is not None:
        _, *redis_clients = _clients
        _clients = None
        forks.close_redis_clients_without_their_loop(redis_clients)


async def close() -> None:
    """Close the clients (the end of a test's loop, or of the process)."""
    global _clients
    if _clients is None:
        return
    loop, *redis_clients = _clients
    _clients = None
    if loop is asyncio.get_running_loop():
        for redis in redis_clients:
            await redis.aclose()
    elif loop.is_closed():
        forks.close_redis_clients_without_their_loop(redis_clients)
