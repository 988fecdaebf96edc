"""The daily spend ceilings: the site's (QUOTES_DAILY_SPEND_LIMIT_USD) and each persona's.

A paid generation reserves the most it can cost before it starts (`reserve`: the 503
`budget_exhausted` when that would pass a ceiling) and settles what it cost when it ends
(`Reservation.settle`). The counters, in nano-dollars, one per ceiling and UTC day, are Redis's
with REDIS_URL, shared by every process (each change one atomic script: a change sent is done
whole or not at all), else this process's own (the `counters` cache, in memory).

While Redis cannot be reached, this process counts on from the last total it knew, and keeps what
it owes the shared counter; it pays that back, before anything else it sends, as soon as Redis
answers again (and retries every few seconds meanwhile). A change whose fate is unknown (sent, but
no answer came: a timeout, or Redis stopped with the command in its socket) is taken at its worst
for the ceiling: a reservation as not counted (it is sent again), a release as counted. So an
outage never leaves the shared counter under what the rows cost, nor below zero; it can leave it
over, by the reservations whose answer was lost. docs/deployment.md says what the ceiling
guarantees in each failure case.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from dataclasses import dataclass
from decimal import Decimal

import redis.asyncio
from django.conf import settings
from django.core.cache import BaseCache
from redis.exceptions import RedisError

from . import cache, state
from .errors import ErrorCode, QuoteError

logger = logging.getLogger(__name__)

UNIT = 10**9  # nano-dollars: the rows keep costs to 1e-8
#: A day's counter outlives its day by this much (a generation that ends after midnight).
KEEP_S = 2 * 86400
#: After a failure, Redis is left alone this long (a hung Redis costs one timeout, not one a call).
RETRY_S = 2.0

#: INCRBY, EXPIRE, in one step; a counter that lost its data (Redis restarted empty) and would go
#: below zero starts again at zero.
_ADD = """
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
if total < 0 then
  redis.call('SET', KEYS[1], 0)
  total = 0
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return total
"""


def day_key(persona_id: int | None = None) -> str:
    day = dt.datetime.now(dt.UTC).date().isoformat()
    return f"quotes:spend:{day}" + (f":{persona_id}" if persona_id is not None else "")


def until_tomorrow() -> int:
    now = dt.datetime.now(dt.UTC)
    tomorrow = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), tzinfo=dt.UTC)
    return max(1, math.ceil((tomorrow - now).total_seconds()))


class Unreachable(Exception):
    """Redis did not answer; `sent`: the change may have reached it all the same."""

    def __init__(self, *, sent: bool) -> None:
        super().__init__("the spend counters cannot be reached")
        self.sent = sent


def _add_here(counters: BaseCache, key: str, units: int) -> int:
    counters.add(key, 0, timeout=KEEP_S)
    return max(0, int(counters.incr(key, units)))


class Counters:
    """This process's view of the counters: the last total it knew of each (`known`), and what it
    owes the shared ones (`owed`), paid back in order."""

    def __init__(self) -> None:
        self.known: dict[str, int] = {}
        self.owed: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._retry: asyncio.Task[None] | None = None
        self._down_until = 0.0
        self._redis: redis.asyncio.Redis | None = None
        if settings.REDIS_URL:
            self._redis = redis.asyncio.Redis.from_url(
                settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2
            )
            self._script = self._redis.register_script(_ADD)

    async def add(self, key: str, units: int) -> int:
        """Add `units` to `key`'s counter: its total, as the shared counter says it or, while that
        cannot be reached, as this process knows it."""
        async with self._lock:
            sent = False
            try:
                await self._pay_back()  # first: the counter takes this process's changes in order
                sent = True
                total = await self._send(key, units)
            except Unreachable as failure:
                self._owe(key, units, sent=sent and failure.sent)
                total = self.known.get(key, 0) + units
            self.known[key] = total
            return total

    async def total(self, key: str) -> int:
        """`key`'s total, with what this process still owes it."""
        if self._redis is None:
            return int(await cache.call(cache.store("counters").get, key, 0) or 0)
        try:
            value = await self._redis.get(key)
        except (RedisError, OSError):
            return self.known.get(key, 0)
        return int(value or 0) + self.owed.get(key, 0)

    async def aclose(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._redis is not None:
            await self._redis.aclose()

    async def _send(self, key: str, units: int) -> int:
        if self._redis is None:  # this process's memory: it cannot fail
            return _add_here(cache.store("counters"), key, units)
        if time.monotonic() < self._down_until:
            raise Unreachable(sent=False)
        try:
            total = int(await self._script(keys=[key], args=[units, KEEP_S]))
        except (RedisError, OSError) as exc:
            if not self._down_until:
                logger.warning("the spend counters cannot be reached (%s): counting here", type(exc).__name__)
            self._down_until = time.monotonic() + RETRY_S
            raise Unreachable(sent=True) from exc
        if self._down_until:
            self._down_until = 0.0
            logger.info("the spend counters answer again")
        return total

    def _owe(self, key: str, units: int, *, sent: bool) -> None:
        if sent and units < 0:
            return  # a release that may have been counted: taken as counted
        self.owed[key] = self.owed.get(key, 0) + units
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._retry_pay_back())

    async def _pay_back(self) -> None:
        """What is owed, key by key (the lock held): `Unreachable` at the first that fails."""
        while self.owed:
            key, units = next(iter(self.owed.items()))
            del self.owed[key]
            try:
                self.known[key] = await self._send(key, units)
            except Unreachable as failure:
                self._owe(key, units, sent=failure.sent)
                raise
            logger.info("spend counter %s: %+d nano-dollars counted here meanwhile, paid back", key, units)

    async def _retry_pay_back(self) -> None:
        while self.owed:
            await asyncio.sleep(RETRY_S)
            async with self._lock:
                try:
                    await self._pay_back()
                except Unreachable:
                    continue


def counters() -> Counters:
    """The running event loop's counters (a part of quotes.state)."""
    return state.of(Counters)


@dataclass(slots=True)
class Reservation:
    """A generation's reservation against the ceilings that apply to it."""

    keys: list[str]
    units: int

    async def settle(self, cost_usd: Decimal | None) -> None:
        """What the generation cost replaces the reservation (once: a second call is a no-op)."""
        delta = math.ceil((cost_usd or 0) * UNIT) - self.units
        keys, self.keys = self.keys, []
        if delta:
            for key in keys:
                await counters().add(key, delta)


async def reserve(persona_id: int, persona_limit: Decimal | None, most_usd: float) -> Reservation:
    """Reserve `most_usd` (the most this generation can cost) against today's ceilings; the 503
    `budget_exhausted` QuoteError when that would pass one. With no ceiling set, nothing."""
    ceilings = [(day_key(), settings.QUOTES_DAILY_SPEND_LIMIT_USD), (day_key(persona_id), persona_limit)]
    units = math.ceil(most_usd * UNIT)
    reservation = Reservation([], units)
    for key, ceiling in ceilings:
        if ceiling is None:
            continue
        reservation.keys.append(key)
        if await counters().add(key, units) > ceiling * UNIT:
            for taken in reservation.keys:
                await counters().add(taken, -units)
            message = "Today's budget for new quotes from this model is spent. Cached quotes still work."
            raise QuoteError(ErrorCode.BUDGET_EXHAUSTED, message, 503, retry_after=until_tomorrow())
    return reservation


async def spent_today() -> Decimal:
    """Today's spend (reserved or settled) as the site's ceiling counts it."""
    return Decimal(await counters().total(day_key())) / UNIT
