"""Who may start a stream: one check at the top of the stream view and the WebSocket's start,
before any work.

1. This process's open streams against QUOTES_MAX_OPEN_STREAMS (503 `over_capacity`), or its
   drain (503 `server_draining`), both with Retry-After.
2. The client's rate limit and its network's (an IPv4 /24, an IPv6 /48), moving windows kept by
   the `limits` package in Redis with REDIS_URL (in memory without it, or while Redis is down):
   429 `rate_limited` with Retry-After.
3. The client's concurrent streams (QUOTES_MAX_CONCURRENT_STREAMS) and its network's (six times
   that, and no more than a quarter of this process's streams, but always one client's worth):
   429 `too_many_streams`. With
   Redis the client's and the network's bounds hold across every process (a client that changes
   its cookie to land on each process gets no more); while Redis is down, each process's own.
   The `Slot` taken is held by the generation that starts until it ends, dropped connection or not.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass

import redis.asyncio
from django.conf import settings
from limits import RateLimitItem, parse
from limits.aio.storage import MemoryStorage, RedisStorage
from limits.aio.strategies import MovingWindowRateLimiter
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

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
        self.client: redis.asyncio.Redis | None = None
        self.holds: AsyncScript | None = None
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
            self.client = redis.asyncio.Redis(connection_pool=self.pool)
            self.holds = self.client.register_script(_HOLD)
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
            self._down(exc)
            return await self.hit(item, key)
        if self.shared_down_until and limiter is self.shared:
            self.shared_down_until = 0.0
        return max(1, math.ceil(reset - time.time()))

    async def hold(self, slot: Slot, caps: list[int]) -> int:
        """A place for `slot` under each of its keys' caps across the processes: 0, else the
        number of the key that is full. Without Redis, or while it is down: 0 (this process's own
        counts stand)."""
        if self.holds is None or time.monotonic() < self.shared_down_until:
            return 0
        place = uuid.uuid4().hex
        lease_s = settings.QUOTES_POLICY.total_timeout_s + settings.QUOTES_RESUME_GRACE_S + 30
        keys = [f"quotes:open:{key}" for key in slot.keys]
        try:
            full = int(await self.holds(keys=keys, args=[lease_s, place, *caps]))
        except (RedisError, OSError) as exc:
            self._down(exc)
            return 0
        if not full:
            slot.shared = place
        return full

    async def let_go(self, place: str, keys: list[str]) -> None:
        if self.client is None:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.zrem(f"quotes:open:{key}", place)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # its lease lapses instead
            self._down(exc)

    def _down(self, exc: BaseException) -> None:
        if not self.shared_down_until:
            logger.warning("Redis is unavailable for the limits (%s): counting in this process", exc)
        self.shared_down_until = time.monotonic() + cache.RETRY_S

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


# -- streams open at once ------------------------------------------------------------------------

#: Takes a place for ARGV[2] under each key's cap (ARGV[3..]) unless one is full: 0, else the
#: number of the full key. A place is a member of a sorted set, scored by when its lease ends (a
#: killed process's places lapse).
_HOLD = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= tonumber(ARGV[2 + i]) then return i end
end
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + tonumber(ARGV[1]), ARGV[2])
  redis.call('EXPIRE', key, math.ceil(tonumber(ARGV[1])) + 1)
end
return 0
"""


def network_streams() -> int:
    """A network's streams at most, across the site: six clients' worth."""
    return int(settings.QUOTES_MAX_CONCURRENT_STREAMS) * NETWORK_FACTOR


class Slot:
    """One of this process's open streams, and one of its client's and its network's (here, and
    with Redis, across every process): taken by `admit`, given back by the generation that starts
    with it when it ends (or by the request, if none starts)."""

    def __init__(self, registry: Generations, client: Client) -> None:
        self.registry: Generations | None = registry
        self.keys = [key for key in (client.key, client.network) if key]
        self.shared = ""  # its place in Redis, once taken
        registry.open += 1
        registry.per_client.update(self.keys)

    def release(self) -> None:
        registry, self.registry = self.registry, None
        if registry is None:
            return
        registry.open -= 1
        registry.per_client.subtract(self.keys)
        for key in self.keys:
            if registry.per_client[key] <= 0:
                del registry.per_client[key]
        if self.shared:
            task = asyncio.get_running_loop().create_task(limiter().let_go(self.shared, self.keys))
            _letting_go.add(task)
            task.add_done_callback(_letting_go.discard)


_letting_go: set[asyncio.Task[None]] = set()


def check_capacity() -> None:
    """This process's own refusal, with no I/O: its drain, or its open streams at the cap."""
    registry = generations()
    if registry.draining:
        message = "This server is restarting. Please try again in a moment."
        raise QuoteError(ErrorCode.SERVER_DRAINING, message, 503, retry_after=DRAINING_RETRY_S)
    if registry.open >= settings.QUOTES_MAX_OPEN_STREAMS:
        message = "The site is busy writing other quotes right now. Please try again in a few seconds."
        raise QuoteError(ErrorCode.OVER_CAPACITY, message, 503, retry_after=OVER_CAPACITY_RETRY_S)


def too_many(network: bool) -> QuoteError:
    if network:
        message = (
            f"Your network already has {network_streams()} quotes being written. Wait for one to finish."
        )
    else:
        message = (
            f"You already have {settings.QUOTES_MAX_CONCURRENT_STREAMS} quotes being written. "
            "Wait for one to finish."
        )
    return QuoteError(ErrorCode.TOO_MANY_STREAMS, message, 429, retry_after=TOO_MANY_STREAMS_RETRY_S)


async def admit(client: Client) -> Slot:
    """The stream's admission: capacity, rate limits, then the client's and its network's
    concurrent streams (here first, with no I/O; then across the processes, in Redis)."""
    check_capacity()
    await count_stream(client)
    check_capacity()  # again: other requests came in while this one was counted
    registry = generations()
    if registry.per_client[client.key] >= settings.QUOTES_MAX_CONCURRENT_STREAMS:
        raise too_many(network=False)
    here = min(
        network_streams(), max(settings.QUOTES_MAX_CONCURRENT_STREAMS, settings.QUOTES_MAX_OPEN_STREAMS // 4)
    )
    if client.network and registry.per_client[client.network] >= here:
        raise too_many(network=True)
    slot = Slot(registry, client)
    caps = [settings.QUOTES_MAX_CONCURRENT_STREAMS, network_streams()][: len(slot.keys)]
    try:
        full = await limiter().hold(slot, caps)
    except BaseException:
        slot.release()
        raise
    if full:
        slot.release()
        raise too_many(network=full == 2)
    return slot


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
