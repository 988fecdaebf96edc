"""The daily spend ceilings: the site's (QUOTES_DAILY_SPEND_LIMIT_USD) and each persona's.

A paid generation reserves the most it can cost before it starts (`reserve`: the 503
`budget_exhausted` when that would pass a ceiling) and settles what it cost when it ends
(`Reservation.settle`). The counters are the shared cache's (Redis with REDIS_URL, so every process
counts against one total), in nano-dollars, one per ceiling and UTC day.

While the shared counters cannot be reached, this process counts on from the last total it knew,
and keeps what it owes them; it pays that back, before anything else it sends, as soon as they
answer again (and retries every few seconds meanwhile). A change whose fate is unknown (the
command was sent but no answer came: a timeout, or Redis stopped with the command in its socket)
is taken at its worst for the ceiling: a reservation as not counted (it is sent again), a release
as counted. So an outage never leaves the shared counter under what the rows cost, nor below
zero; it can leave it over, by at most the reservations in flight when it began. docs/deployment.md
says what the ceiling guarantees in each failure case.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import weakref
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.core.cache import BaseCache

from . import cache
from .errors import ErrorCode, QuoteError

logger = logging.getLogger(__name__)

UNIT = 10**9  # nano-dollars: the rows keep costs to 1e-8
#: A day's counter outlives its day by this much (a generation that ends after midnight).
KEEP_S = 2 * 86400


def day_key(persona_id: int | None = None) -> str:
    day = dt.datetime.now(dt.UTC).date().isoformat()
    return f"quotes:spend:{day}" + (f":{persona_id}" if persona_id is not None else "")


def until_tomorrow() -> int:
    now = dt.datetime.now(dt.UTC)
    tomorrow = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), tzinfo=dt.UTC)
    return max(1, math.ceil((tomorrow - now).total_seconds()))


def _incr(counters: BaseCache, key: str, units: int) -> int:
    counters.add(key, 0, timeout=KEEP_S)
    total = int(counters.incr(key, units))
    if total < 0:  # a counter that lost its data (Redis restarted empty) starts again at zero
        total = int(counters.incr(key, -total))
    return total


class Counters:
    """This process's view of the shared counters: the last total it knew of each (`known`), and
    what it owes them (`owed`), paid back in order."""

    def __init__(self) -> None:
        self.known: dict[str, int] = {}
        self.owed: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._retry: asyncio.Task[None] | None = None

    async def add(self, key: str, units: int) -> int:
        """Add `units` to `key`'s counter: its total, as the shared counter says it or, while that
        cannot be reached, as this process knows it."""
        async with self._lock:
            sent = False
            try:
                await self._pay_back()  # first: the counter takes this process's changes in order
                sent = True
                total = await cache.attempt(_incr, cache.store("counters"), key, units)
            except cache.Unavailable as failure:
                self._owe({key: units}, attempted=sent and failure.attempted)
                total = self.known.get(key, 0) + units
            self.known[key] = total
            return total

    async def total(self, key: str) -> int:
        """`key`'s total, with what this process still owes it."""
        try:
            value = await cache.attempt(cache.store("counters").get, key, 0)
        except cache.Unavailable:
            return self.known.get(key, 0)
        return int(value) + self.owed.get(key, 0)

    def _owe(self, changes: dict[str, int], *, attempted: bool) -> None:
        for key, units in changes.items():
            if attempted and units < 0:
                continue  # a release that may have been counted: taken as counted
            self.owed[key] = self.owed.get(key, 0) + units
        if self.owed and (self._retry is None or self._retry.done()):
            self._retry = asyncio.get_running_loop().create_task(self._retry_pay_back())

    async def _pay_back(self) -> None:
        """What is owed, key by key (the lock held): `Unavailable` at the first that fails."""
        while self.owed:
            key, units = next(iter(self.owed.items()))
            del self.owed[key]
            try:
                self.known[key] = await cache.attempt(_incr, cache.store("counters"), key, units)
            except cache.Unavailable as failure:
                self._owe({key: units}, attempted=failure.attempted)
                raise
            logger.info("spend counter %s: paid back %d nano-dollars counted here meanwhile", key, units)

    async def _retry_pay_back(self) -> None:
        while self.owed:
            await asyncio.sleep(cache.RETRY_S)
            async with self._lock:
                try:
                    await self._pay_back()
                except cache.Unavailable:
                    continue


_counters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Counters] = weakref.WeakKeyDictionary()


def counters() -> Counters:
    """The running event loop's counters (one loop per server process)."""
    loop = asyncio.get_running_loop()
    if loop not in _counters:
        _counters[loop] = Counters()
    return _counters[loop]


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
