"""Who may open a stream, decided once before any work is done for it: the drain, the process's
open-stream limit (capacity.py: 503 before any header, so the streams held keep their pace), then
the client's rate limits and stream cap, shared across processes (429). See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from ...conf import GatewaySettings
from .. import limits
from ..errors import ErrorCode
from ..events import Error
from . import capacity, redis_clients
from .capacity import open_streams
from .tasks import detached_task

logger = logging.getLogger(__name__)

#: Retry-After of a draining process's refusal: the other processes take it now (nginx retries
#: there at once); a client of this one process alone finds it restarted.
DRAINING_RETRY_AFTER_S = 1
TOO_MANY_STREAMS_RETRY_AFTER_S = 5
#: Where StreamAdmissionGate puts its decision (`enter`) in the scope it passes on to Django.
DECIDED = "quotes.admission"


@dataclass(slots=True, eq=False)
class Entry:
    """A stream request let in by `enter`, counted in `open_streams.entering` until `admit` opens
    its stream or it ends (`close`): in a burst, the gate itself refuses those beyond the limit."""

    waiting: bool = True

    def open(self) -> int:
        self.waiting = False
        return open_streams.open()

    def close(self) -> None:
        if self.waiting:
            self.waiting = False
            open_streams.entering -= 1


def enter(options: GatewaySettings, *, while_draining: bool = False) -> Entry | Error:
    """Whether this process takes one more stream: an Entry, or the 503 Error that refuses it.
    `while_draining`: a resume of a run this process holds, which the drain spares."""
    if drain.draining and not while_draining:
        return server_draining()
    limit = capacity.limit_now(options)
    if not open_streams.try_enter(limit):
        message = "The site is busy writing other quotes right now. Please try again in a few seconds."
        return Error(ErrorCode.OVER_CAPACITY, message, 503, retry_after=open_streams.retry_after_s(limit))
    return Entry()


def server_draining() -> Error:
    message = "This server is restarting. Please try again in a moment."
    return Error(ErrorCode.SERVER_DRAINING, message, 503, retry_after=DRAINING_RETRY_AFTER_S)


# With REDIS_URL a client's slots are leases in one sorted set per client (members lease ids,
# scores their expiry), taken in one atomic script with the rate counts. This process renews the
# leases it holds every LEASE_RENEW_S, so a lease whose process dies lapses within LEASE_TTL_S;
# a refusal extends nothing. Without Redis (or while it is down) they live in this process.

#: How long a client's slot outlives the process that holds it (kill -9).
LEASE_TTL_S = 10.0
LEASE_RENEW_S = 3.0
#: The prefix of a slot held in this process's memory, not in Redis.
LOCAL = "here:"

# Returns 0 (admitted), 1 (the client's rate limit), 2 (its stream cap), 3 (its network's rate limit).
_ADMIT = """
if ARGV[7] == '1' then
  local n = redis.call('INCR', KEYS[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  if n > tonumber(ARGV[1]) then return 1 end
  if KEYS[3] ~= '' then
    n = redis.call('INCR', KEYS[3])
    redis.call('EXPIRE', KEYS[3], ARGV[9])
    if n > tonumber(ARGV[8]) then return 3 end
  end
end
if ARGV[6] == '' then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then return 2 end
redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + tonumber(ARGV[5]), ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 0
"""


def lease_key(client_key: str) -> str:
    return f"quotes:slots:{client_key}"


class Leases:
    """The client slots this process holds (lease ids by client key), and the task that renews
    those in Redis while there are any."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}
        self._keeper: asyncio.Task[None] | None = None

    def add(self, client_key: str, lease: str) -> None:
        self.held.setdefault(client_key, set()).add(lease)
        keeper = self._keeper
        if lease.startswith(LOCAL):
            return  # dies with the process: nothing to renew
        if keeper is None or keeper.done() or keeper.get_loop() is not asyncio.get_running_loop():
            self._keeper = detached_task(self._renew())

    def discard(self, client_key: str, lease: str) -> None:
        mine = self.held.get(client_key, set())
        mine.discard(lease)
        if not mine:
            self.held.pop(client_key, None)

    async def close(self) -> None:
        """Stop renewing (the end of a test's loop)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None and not keeper.done() and keeper.get_loop() is asyncio.get_running_loop():
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    def reset(self) -> None:
        """Forget the slots of a loop that is gone (a finished test's)."""
        self._keeper = None
        self.held.clear()
        limits.counts_here.clear()

    async def _renew(self) -> None:
        while self.held:
            await asyncio.sleep(LEASE_RENEW_S)
            if not redis_clients.usable():
                continue  # a lease that lapses meanwhile costs its client a slot's count, briefly
            expiry = time.time() * 1000 + LEASE_TTL_S * 1000
            pipe = redis_clients.client().pipeline(transaction=False)
            for client_key, held in list(self.held.items()):
                shared = [lease for lease in held if not lease.startswith(LOCAL)]
                if shared:
                    pipe.zadd(lease_key(client_key), dict.fromkeys(shared, expiry), xx=True)
                    pipe.pexpire(lease_key(client_key), int(LEASE_TTL_S * 1000))
            try:
                await pipe.execute()
            except Exception as exc:
                redis_clients.failed(exc)


leases = Leases()


@dataclass(slots=True)
class Ticket:
    client_key: str
    #: the lease id of the client's slot this connection holds ("" once given back)
    lease: str
    #: its slot of this process's open streams (capacity.OpenStreams.open; 0 once given back)
    process_slot: int

    async def release_client_slot(self) -> None:
        """Give the client's slot back (before the client hears "done" and asks again). A lease in
        Redis that cannot be given back now (Redis down) expires by itself."""
        lease, self.lease = self.lease, ""
        if not lease:
            return
        leases.discard(self.client_key, lease)
        if lease.startswith(LOCAL) or not redis_clients.usable():
            return
        try:  # shielded: given back even if this task is cancelled meanwhile
            await asyncio.shield(redis_clients.client().zrem(lease_key(self.client_key), lease))
        except (RedisError, OSError) as exc:
            redis_clients.failed(exc)  # the breaker's one WARNING per outage, no traceback per stream
            logger.debug("could not give a stream slot back (it expires by itself): %r", exc)
        except Exception:
            logger.warning("could not give a stream slot back (it expires by itself)", exc_info=True)

    async def release(self) -> None:
        slot, self.process_slot = self.process_slot, 0
        if slot:
            open_streams.close(slot)
        await self.release_client_slot()


async def admit(
    client_key: str,
    options: GatewaySettings,
    *,
    admitted: Entry | Error | None = None,
    network_key: str = "",
    new: bool = True,
) -> Ticket | Error:
    """Admit one connection for `client_key`: a Ticket, or the Error (503 draining or over
    capacity, 429 rate limited or too many streams) that refuses it. `admitted`: `enter`'s
    answer, when decided before. `new`: it starts a generation, and counts against the rate
    limits (a resume does not). `network_key`: the client's network, with a coarser limit."""
    decided = enter(options) if admitted is None else admitted
    if isinstance(decided, Error):
        return decided
    slot = decided.open()
    try:
        taken = await _take_slot(client_key, slot, options, network_key=network_key, new=new)
    except BaseException:
        open_streams.close(slot)
        raise
    if isinstance(taken, Error):
        open_streams.close(slot)
        return taken
    return Ticket(client_key, taken, slot)


async def count(client_key: str, options: GatewaySettings, *, network_key: str = "") -> Error | None:
    """Count a request refused before admission (invalid, its socket busy) as `admit` counts a
    new stream, taking no slot: the 429 Error once over the client's or the network's limit."""
    refused = await _take_slot(client_key, 0, options, network_key=network_key, new=True)
    return refused if isinstance(refused, Error) else None


def _window(bucket: str, key: str, limit: tuple[int, int], now: float) -> tuple[str, int, int, int]:
    """`key`'s rate limit (count, seconds) now: its window's counter, the count allowed, the
    counter's TTL, and the whole seconds until the next window."""
    allowed, window = limit
    index = int(now // window)
    retry_after = max(1, math.ceil((index + 1) * window - now))
    return limits.rate_key(bucket, key, window, index), allowed, window + 1, retry_after


async def _take_slot(
    client_key: str, slot: int, options: GatewaySettings, *, network_key: str, new: bool
) -> Error | str:
    """Count the request (when `new`: against the client's limit, then its network's) and take a
    client slot named after the process's `slot` (none for 0): the Error that refuses it, or the
    lease held. On Redis, one atomic script (cancelled meanwhile, it leaves at most a lease nobody
    renews); else in this process's memory (LOCAL + the lease), no await between check and take."""
    lease = f"{redis_clients.PROCESS}:{slot}" if slot else ""
    now = time.time()
    rate_key, limit, ttl, retry_after = _window("rate", client_key, options.rate_limit, now)
    net_key, net_limit, net_ttl, net_retry_after = _window(
        "netrate", network_key, options.network_rate_limit, now
    )
    answer: int | None = None
    if redis_clients.usable():
        try:
            answer = await redis_clients.client().eval(
                _ADMIT,
                3,
                limits.cache_key(rate_key),
                lease_key(client_key),
                limits.cache_key(net_key) if network_key else "",
                limit,
                ttl,
                options.max_concurrent_streams,
                int(now * 1000),
                int(LEASE_TTL_S * 1000),
                lease,
                "1" if new else "0",
                net_limit,
                net_ttl,
            )
        except (RedisError, OSError) as exc:
            redis_clients.failed(exc)  # served on this process's own counts meanwhile
        else:
            redis_clients.breaker.succeeded()
    if answer is None:
        lease = lease and LOCAL + lease
        # Without REDIS_URL, counted in the cache; with it (down: the breaker is open), here alone.
        if new and await limits.count(rate_key, ttl) > limit:
            answer = 1
        elif new and network_key and await limits.count(net_key, net_ttl) > net_limit:
            answer = 3
        elif lease and len(leases.held.get(client_key, ())) >= options.max_concurrent_streams:
            answer = 2
    if answer in (1, 3):
        who = f"You have asked for {limit}" if answer == 1 else "Your network has asked for many"
        wait = retry_after if answer == 1 else net_retry_after
        message = f"{who} quotes in a short while. Try again in {wait} s."
        return Error(ErrorCode.RATE_LIMITED, message, 429, retry_after=wait)
    if answer == 2:
        message = "You already have quotes being written. Wait for one to finish."
        return Error(ErrorCode.TOO_MANY_STREAMS, message, 429, retry_after=TOO_MANY_STREAMS_RETRY_AFTER_S)
    if lease:
        leases.add(client_key, lease)
    return lease


#: After the cut, how long the cut streams get to send their last event and write their rows.
CUT_GRACE_S = 5.0


class Drain:
    """This process's drain (on SIGTERM, quotes.server): new streams are refused, the open ones run
    on until they end or the deadline, where the runs cut theirs (runs.end_for_drain)."""

    def __init__(self) -> None:
        self.draining = False
        #: the deadline has passed: what still reads a generation is told to resume elsewhere
        self.cut = False

    async def run(self, timeout_s: float) -> None:
        self.draining = True
        logger.info("draining: %d open streams, deadline in %g s", open_streams.count, timeout_s)
        await self.settle(timeout_s)
        self.cut = True

    async def settle(self, timeout_s: float) -> None:
        emptied = open_streams.emptied = asyncio.Event()
        if open_streams.count or open_streams.runs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(emptied.wait(), timeout_s)


def reconnect_retry_ms() -> int:
    """How long the client of a cut stream waits before it resumes (EventSource's `retry`): random,
    so the streams of a whole process do not all land on the next one at once."""
    return random.randint(250, 1500)


drain = Drain()
