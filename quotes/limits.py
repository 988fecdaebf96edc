"""Who may start a stream, and how much the site may spend: one check at the top of the stream
view and the WebSocket's start, before any work.

1. This process's open streams against QUOTES_MAX_OPEN_STREAMS (503 `over_capacity`), or its
   drain (503 `server_draining`), both with Retry-After.
2. The client's rate limit and its network's (an IPv4 /24, an IPv6 /48), moving windows kept by
   the `limits` package in Redis with REDIS_URL (in memory without it, or while Redis is down):
   429 `rate_limited` with Retry-After.
3. The client's concurrent streams (429 `too_many_streams`): a `Slot`, held by the generation
   that starts until it ends, dropped connection or not.

"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
import weakref
from collections import Counter
from dataclasses import dataclass

import redis.asyncio
from django.conf import settings
from limits import RateLimitItem, parse
from limits.aio.storage import MemoryStorage, RedisStorage
from limits.aio.strategies import MovingWindowRateLimiter

from streaming.generation import Generations, generations

from . import cache
from .errors import ErrorCode, QuoteError
from .security import client_address, client_network

logger = logging.getLogger(__name__)

OVER_CAPACITY_RETRY_S = 2
DRAINING_RETRY_S = 1
TOO_MANY_STREAMS_RETRY_S = 5


@dataclass(frozen=True, slots=True)
class Client:
    """Who asks: the user when logged in, else a salted hash of the address (an IPv6 address by
    its /64); `network` is the salted hash of its /24 or /48, for the coarser limit."""

    key: str
    ip_hash: str = ""
    network: str = ""

    @classmethod
    def of(cls, ip: str, user_id: int | None = None) -> Client:
        ip_hash = _salted(client_address(ip))
        network = client_network(ip)
        return cls(
            key=f"user:{user_id}" if user_id else f"ip:{ip_hash}",
            ip_hash=ip_hash,
            network=f"net:{_salted(network)}" if network else "",
        )


def _salted(text: str) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), text.encode(), hashlib.sha256).hexdigest()[:32]


# -- rate limits -------------------------------------------------------------------------------


class Limiter:
    """This event loop's moving windows: in Redis (shared by every process) or in memory."""

    def __init__(self) -> None:
        self.memory = MovingWindowRateLimiter(MemoryStorage())
        self.shared: MovingWindowRateLimiter | None = None
        self.pool: redis.asyncio.ConnectionPool | None = None
        if settings.REDIS_URL:
            self.pool = redis.asyncio.ConnectionPool.from_url(
                settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2
            )
            # Its options go to redis.asyncio.Redis(): a pool of ours, closed with this loop.
            storage = RedisStorage(
                "async+" + settings.REDIS_URL,
                implementation="redispy",
                connection_pool=self.pool,  # type: ignore[arg-type]  # typed narrower than it is
            )
            self.shared = MovingWindowRateLimiter(storage)
        self.shared_down_until = 0.0

    async def hit(self, item: RateLimitItem, key: str) -> int | None:
        """Count one request against `item` for `key`: None while within it, else the seconds
        until one more is allowed."""
        limiter = self.memory
        if self.shared is not None and time.monotonic() >= self.shared_down_until:
            limiter = self.shared
        try:
            if await limiter.hit(item, key):
                return None
            reset = (await limiter.get_window_stats(item, key)).reset_time
        except Exception as exc:
            if limiter is self.memory:
                raise
            if not self.shared_down_until:
                logger.warning("Redis is unavailable for rate limits (%s): counting in this process", exc)
            self.shared_down_until = time.monotonic() + cache.RETRY_S
            return await self.hit(item, key)
        if self.shared_down_until and limiter is self.shared:
            self.shared_down_until = 0.0
        return max(1, math.ceil(reset - time.time()))

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()


_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Limiter] = weakref.WeakKeyDictionary()


async def close() -> None:
    """Close this event loop's connections to Redis (the end of a test's loop)."""
    if (running := _limiters.pop(asyncio.get_running_loop(), None)) is not None:
        await running.close()


def limiter() -> Limiter:
    loop = asyncio.get_running_loop()
    if loop not in _limiters:
        _limiters[loop] = Limiter()
    return _limiters[loop]


#: A network may ask this many times what one client may: a household or an office shares one.
NETWORK_FACTOR = 6


async def count(client: Client, *, bucket: str, limit: str, network_factor: int = NETWORK_FACTOR) -> None:
    """Count one request of `client` in `bucket` against `limit` (e.g. "20/minute"), and its
    network's against `network_factor` times that: the 429 QuoteError once over either."""
    item = parse(limit)
    network_item = type(item)(item.amount * network_factor, item.multiples)
    for each, key in ((item, client.key), (network_item, client.network)):
        if not key:
            continue
        retry_after = await limiter().hit(each, f"{bucket}:{key}")
        if retry_after is not None:
            whose = "You have" if key == client.key else "Your network has"
            raise QuoteError(
                ErrorCode.RATE_LIMITED,
                f"{whose} asked for too much in a short while. Try again in {retry_after} s.",
                429,
                retry_after=retry_after,
            )


async def count_stream(client: Client) -> None:
    await count(client, bucket="quotes", limit=settings.QUOTES_RATE_LIMIT)


async def count_action(action: str, client: Client) -> None:
    """A rating, share or a stop that stops nothing: each in a budget of its own, per client, and
    per network six times it (a household or an office shares one)."""
    await count(client, bucket=action, limit=settings.QUOTES_FEEDBACK_RATE_LIMIT)


#: Votes on one quote from one network, in a day: an IPv6 /48 holds 65,536 clients (/64s), whose
#: votes must not add up to a quote's verdict.
VOTES_PER_NETWORK = f"{NETWORK_FACTOR}/day"


async def count_vote(client: Client, quote_id: str) -> None:
    """One more vote on `quote_id` from `client`'s network: the 429 QuoteError past VOTES_PER_NETWORK."""
    if not client.network:
        return
    retry_after = await limiter().hit(parse(VOTES_PER_NETWORK), f"vote:{quote_id}:{client.network}")
    if retry_after is not None:
        message = "Your network has rated this quote as often as it may. Thank you: it counted."
        raise QuoteError(ErrorCode.RATE_LIMITED, message, 429, retry_after=retry_after)


# -- this process's streams --------------------------------------------------------------------


class Slot:
    """One of this process's open streams and one of its client's: taken by `admit`, given back
    by the generation that starts with it when it ends (or by the request, if none starts)."""

    def __init__(self, registry: Generations, client_key: str) -> None:
        self.registry: Generations | None = registry
        self.client_key = client_key
        registry.open += 1
        registry.per_client[client_key] += 1

    def release(self) -> None:
        registry, self.registry = self.registry, None
        if registry is not None:
            registry.open -= 1
            registry.per_client[self.client_key] -= 1
            if registry.per_client[self.client_key] <= 0:
                del registry.per_client[self.client_key]


def check_capacity() -> None:
    """This process's own refusal, with no I/O: its drain, or its open streams at the cap."""
    registry = generations()
    if registry.draining:
        message = "This server is restarting. Please try again in a moment."
        raise QuoteError(ErrorCode.SERVER_DRAINING, message, 503, retry_after=DRAINING_RETRY_S)
    if registry.open >= settings.QUOTES_MAX_OPEN_STREAMS:
        message = "The site is busy writing other quotes right now. Please try again in a few seconds."
        raise QuoteError(ErrorCode.OVER_CAPACITY, message, 503, retry_after=OVER_CAPACITY_RETRY_S)


async def admit(client: Client) -> Slot:
    """The stream's admission: capacity, rate limits, then the client's concurrent streams."""
    check_capacity()
    await count_stream(client)
    check_capacity()  # again: other requests came in while this one was counted
    registry = generations()
    if registry.per_client[client.key] >= settings.QUOTES_MAX_CONCURRENT_STREAMS:
        message = (
            f"You already have {settings.QUOTES_MAX_CONCURRENT_STREAMS} quotes being written. "
            "Wait for one to finish."
        )
        raise QuoteError(ErrorCode.TOO_MANY_STREAMS, message, 429, retry_after=TOO_MANY_STREAMS_RETRY_S)
    return Slot(registry, client.key)


# -- WebSockets --------------------------------------------------------------------------------

sockets: Counter[str] = Counter()


def open_socket(client: Client) -> bool:
    """Whether `client` (and its network) may hold one more socket here; counted if so."""
    if sockets[client.key] >= settings.QUOTES_MAX_SOCKETS or (
        client.network and sockets[client.network] >= settings.QUOTES_MAX_SOCKETS * NETWORK_FACTOR
    ):
        return False
    sockets.update(filter(None, (client.key, client.network)))
    return True


def close_socket(client: Client) -> None:
    sockets.subtract(filter(None, (client.key, client.network)))
    for key in (client.key, client.network):
        if sockets[key] <= 0:
            sockets.pop(key, None)
