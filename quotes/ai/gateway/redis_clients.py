"""This process's Redis clients for the stream core, bound to the running event loop. Short calls
wait for one of a few connections rather than fail; blocking reads (XREAD BLOCK) have a pool of
their own, so that they never starve the short calls."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

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
    return enabled() and breaker.available()


def failed(error: BaseException) -> None:
    """A call to Redis failed: the breaker opens. Not on the breaker's own refusal: re-opened by
    each, it would never close for a caller that only retries."""
    if not isinstance(error, RedisUnavailable):
        breaker.failed(error)


#: The clients of the running loop, and the task that closes them with it.
_clients: tuple[aioredis.Redis, aioredis.Redis, asyncio.Task[None]] | None = None


def _pools() -> tuple[aioredis.Redis, aioredis.Redis]:
    global _clients
    if _clients is None or _clients[2].get_loop() is not asyncio.get_running_loop():
        timeout = settings.REDIS_OPTIONS["socket_timeout"]
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": settings.REDIS_OPTIONS["socket_connect_timeout"],
            "timeout": timeout,  # the wait for a free connection
        }
        short, blocking = (
            aioredis.Redis.from_pool(
                aioredis.BlockingConnectionPool.from_url(settings.REDIS_URL, max_connections=size, **options)
            )
            for size in (SHORT_CONNECTIONS, BLOCKING_CONNECTIONS)
        )
        _clients = (short, blocking, asyncio.ensure_future(_close_with_the_loop(short, blocking)))
    return _clients[0], _clients[1]


async def _close_with_the_loop(*clients: aioredis.Redis) -> None:
    """Waits until cancelled, by `close()` or by the end of its loop (asyncio.run, which
    asgiref's async_to_sync and `manage.py quote` use, cancels the tasks left): the clients
    close in their own loop, the only one that can close their sockets."""
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        for redis in clients:
            await redis.aclose()


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
    """Drop the clients of a loop that has ended (closed as it did)."""
    global _clients
    _clients = None


async def close() -> None:
    """Close the clients now (the end of a test's loop, or of the process)."""
    global _clients
    clients, _clients = _clients, None
    if clients is not None and clients[2].get_loop() is asyncio.get_running_loop():
        clients[2].cancel()
        await asyncio.wait([clients[2]])
