"""Rate limits: moving windows kept by the `limits` package, in Redis with REDIS_URL (shared by
every process) or in memory (without it, or while Redis is down): a stream request per client and
per network (an IPv4 /24, an IPv6 /48; six times a client's), the actions on a quote (ratings,
shares, stops that stop nothing), and votes on one quote per network. Past one: 429
`rate_limited` with Retry-After. The same Redis connection holds the places of the streams open
at once (`Limiter.hold`, quotes.admission).
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import redis.asyncio
from django.conf import settings
from limits import RateLimitItem, parse
from limits.aio.storage import MemoryStorage, RedisStorage
from limits.aio.strategies import MovingWindowRateLimiter
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from . import cache, state
from .clients import Client
from .errors import ErrorCode, QuoteError

logger = logging.getLogger(__name__)

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

    async def hold(self, keys: list[str], caps: list[int]) -> tuple[int, str]:
        """A place under each of `keys`' caps across the processes: (0, the place), else (the
        number of the key that is full, ""). Without Redis, or while it is down: (0, "") (this
        process's own counts stand)."""
        if self.holds is None or time.monotonic() < self.shared_down_until:
            return 0, ""
        place = uuid.uuid4().hex
        lease_s = settings.QUOTES_POLICY.total_timeout_s + settings.QUOTES_RESUME_GRACE_S + 30
        try:
            full = int(
                await self.holds(keys=[f"quotes:open:{key}" for key in keys], args=[lease_s, place, *caps])
            )
        except (RedisError, OSError) as exc:
            self._down(exc)
            return 0, ""
        return (full, "") if full else (0, place)

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

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()


def limiter() -> Limiter:
    """This event loop's (a part of quotes.state)."""
    return state.of(Limiter)


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
