"""Who may open a stream, checked before any work is done for it:

1. the process's open-stream limit (quotes.ai.gateway.capacity): a count in this process's
   memory, whoever asks, against a limit that follows the event loop's lag (within the static
   ceiling QUOTES_MAX_OPEN_STREAMS, when set). Past it the answer is an immediate 503 with
   Retry-After (when the open streams are likely to have made room), before any header of a
   stream is sent, so the streams the process already holds keep their pace instead of every
   stream slowing down together;
2. the client's rate limit and concurrent-stream cap (quotes.ai.limits, in the shared cache, so
   they hold across processes): 429 with Retry-After.

An admitted stream holds a `Ticket` until it ends; `release()` gives back what it holds.

And whether this process still takes streams at all: once it drains (`drain`, begun on SIGTERM by
quotes.server) every new stream is refused at once (503 server_draining, with Retry-After, so
nginx or the client goes to another process) and /healthz answers 503 "draining"; the open ones
run on until they end or the drain's deadline (QUOTES_DRAIN_TIMEOUT_S), where each is cut: its
transport tells the client to resume elsewhere (quotes.transports) and its log row says
server_draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from ...conf import GatewaySettings
from .. import limits
from ..errors import ErrorCode
from ..events import Error
from . import capacity, redis_clients
from .capacity import open_streams
from .tasks import detached_task

logger = logging.getLogger(__name__)

#: Seconds a client refused by a draining process is told to wait: the other processes take it
#: now (nginx retries there at once); a client of this one process alone finds it restarted.
DRAINING_RETRY_AFTER_S = 1


@dataclass(slots=True, eq=False)
class Entry:
    """A stream request let in (`enter`), counted in `open_streams.entering` until `admit` opens
    its stream, deciding nothing again, or its request ends (`close`). At a burst, dozens pass the
    gate under the limit in the same moment and would each wait behind the admitted streams'
    set-up before the view refused them (a refusal p99 of 200-350 ms): counted, the gate refuses
    those beyond the limit itself, in a few milliseconds."""

    waiting: bool = True

    def open(self) -> int:
        """Its stream's slot of the open streams (capacity.OpenStreams.open)."""
        self.waiting = False
        return open_streams.open()

    def close(self) -> None:
        if self.waiting:
            self.waiting = False
            open_streams.entering -= 1


#: Where StreamAdmissionGate puts its decision (`enter`) in the scope it passes on to Django.
DECIDED = "quotes.admission"


def enter(options: GatewaySettings, *, while_draining: bool = False) -> Entry | Error:
    """Whether this process takes one more stream, decided once per request where it comes in
    (StreamAdmissionGate, the WebSocket consumer), before anything else is done for it: an Entry,
    or the Error that refuses it (503 draining, or at its limit). `while_draining`: a resume of a
    run this process holds, which the drain spares."""
    if drain.draining and not while_draining:
        return server_draining()
    limit = capacity.limit_now(options)
    if not open_streams.try_enter(limit):
        return over_capacity(open_streams.retry_after_s(limit))
    return Entry()


def server_draining() -> Error:
    return Error(
        ErrorCode.SERVER_DRAINING,
        "This server is restarting. Please try again in a moment.",
        503,
        retry_after=DRAINING_RETRY_AFTER_S,
    )


def over_capacity(retry_after: int = capacity.DEFAULT_RETRY_AFTER_S) -> Error:
    return Error(
        ErrorCode.OVER_CAPACITY,
        "The site is busy writing other quotes right now. Please try again in a few seconds.",
        503,
        retry_after=retry_after,
    )


# -- the one admission -------------------------------------------------------------------------
#
# Every connection that reads a generation (a new stream, a resume, a WebSocket start or resume)
# is admitted here, once, before any work is done for it, and holds a Ticket until it ends: a
# slot of the process's open-stream count and a lease on one of the client's concurrent-stream
# slots. With REDIS_URL the client's slots are leases in one sorted set per client (members are
# lease ids, scores their expiry), taken in one atomic script with the rate count: a lease
# whose process dies expires LEASE_TTL_S later at most, for this process renews the leases it
# holds every LEASE_RENEW_S, and a refusal extends nothing. Without Redis they live in this
# process's memory, which dies with it.

#: How long a client's slot outlives the process that holds it (kill -9).
LEASE_TTL_S = 10.0
LEASE_RENEW_S = 3.0

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


#: The prefix of a slot taken in this process's memory (no Redis, or Redis down), not in Redis.
LOCAL = "here:"


def lease_key(client_key: str) -> str:
    return f"quotes:slots:{client_key}"


class Leases:
    """The client slots this process holds (lease ids by key), and the task that renews them
    in Redis while there are any. Without Redis, the slots themselves (no expiry needed: they
    die with the process)."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}
        self._serial = 0
        self._keeper: asyncio.Task[None] | None = None

    def new_id(self) -> str:
        self._serial += 1
        return f"{redis_clients.PROCESS}:{self._serial}"

    def count(self, client_key: str) -> int:
        return len(self.held.get(client_key, ()))

    def add(self, client_key: str, lease: str) -> None:
        self.held.setdefault(client_key, set()).add(lease)

    def discard(self, client_key: str, lease: str) -> None:
        mine = self.held.get(client_key)
        if mine is not None:
            mine.discard(lease)
            if not mine:
                del self.held[client_key]

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

    def keep_renewed(self) -> None:
        keeper = self._keeper
        if keeper is None or keeper.done() or keeper.get_loop() is not asyncio.get_running_loop():
            self._keeper = detached_task(self._renew())

    async def _renew(self) -> None:
        while self.held:
            await asyncio.sleep(LEASE_RENEW_S)
            if not redis_clients.usable():
                continue  # a lease that lapses meanwhile costs its client a slot's count, briefly
            expiry = time.time() * 1000 + LEASE_TTL_S * 1000
            pipe = redis_clients.client().pipeline(transaction=False)
            for client_key, leases in list(self.held.items()):
                shared = [lease for lease in leases if not lease.startswith(LOCAL)]
                if shared:
                    key = lease_key(client_key)
                    pipe.zadd(key, dict.fromkeys(shared, expiry), xx=True)
                    pipe.pexpire(key, int(LEASE_TTL_S * 1000))
            try:
                await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                redis_clients.failed(exc)


leases = Leases()


@dataclass(slots=True)
class Ticket:
    client_key: str
    #: the lease id of the client's slot this connection holds ("" once given back)
    lease: str
    #: the slot of this process's open streams it holds (capacity.OpenStreams.open; 0 once
    #: given back)
    process_slot: int

    async def release_client_slot(self) -> None:
        """Give the client's slot back (before the client hears "done" and asks again). A
        lease in Redis that cannot be given back now (Redis down) expires by itself."""
        lease, self.lease = self.lease, ""
        if not lease:
            return
        leases.discard(self.client_key, lease)
        if not lease.startswith(LOCAL) and redis_clients.usable():
            await _shielded(redis_clients.client().zrem(lease_key(self.client_key), lease))

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
    capacity, 429 rate limited or too many streams) that refuses it. `admitted`: the process's
    decision on it (`enter`), when made before; else it is made here. `new`: it starts a
    generation, and counts against the client's rate limit (a resume does not).
    `network_key`: the client's network, counted against the coarser network limit too."""
    decided = enter(options) if admitted is None else admitted
    if isinstance(decided, Error):
        return decided
    slot = decided.open()
    limit, window = options.rate_limit
    lease = leases.new_id()
    try:
        refused, shared = await _take_slot(
            client_key, lease, network_key=network_key, limit=limit, window=window, options=options, new=new
        )
    except BaseException:
        open_streams.close(slot)
        raise
    if refused is None:
        if not shared:
            lease = LOCAL + lease
        leases.add(client_key, lease)
        if shared:
            leases.keep_renewed()
        return Ticket(client_key, lease, slot)
    open_streams.close(slot)
    reason, retry_after, network = refused
    return _refused(reason, retry_after, network, limit)


async def count(client_key: str, options: GatewaySettings, *, network_key: str = "") -> Error | None:
    """Count a request refused before admission (invalid, its socket busy) as `admit` counts a
    new stream, taking no slot: the 429 Error once over the client's or the network's limit."""
    limit, window = options.rate_limit
    refused, _ = await _take_slot(
        client_key, "", network_key=network_key, limit=limit, window=window, options=options, new=True
    )
    return None if refused is None else _refused(*refused, limit)


def _refused(reason: ErrorCode, retry_after: int, network: bool, limit: int) -> Error:
    if reason == ErrorCode.RATE_LIMITED and network:
        message = f"Your network has asked for many quotes in a short while. Try again in {retry_after} s."
    elif reason == ErrorCode.RATE_LIMITED:
        message = f"You have asked for {limit} quotes in a short while. Try again in {retry_after} s."
    else:
        message = "You already have quotes being written. Wait for one to finish."
    return Error(reason, message, 429, retry_after=retry_after)


#: Seconds a client at its concurrent-stream cap is told to wait.
TOO_MANY_STREAMS_RETRY_AFTER_S = 5


async def _take_slot(
    client_key: str,
    lease: str,
    *,
    network_key: str,
    limit: int,
    window: int,
    options: GatewaySettings,
    new: bool,
) -> tuple[tuple[ErrorCode, int, bool] | None, bool]:
    """Count the request (when `new`: against the client's limit, then its network's) and take
    a slot unless `lease` is "": (None, or why not, when to try again, and whether the network's
    limit refused it; whether the slot is a lease in Redis). On Redis, one atomic script (a request cancelled
    while it runs leaves at most a lease that nobody renews: it expires). While Redis is down,
    or without it, in this process's memory, with no await: atomic by itself."""
    now = time.time()
    index = int(now // window)
    rate_key = limits.rate_key("rate", client_key, window, index)
    retry_after = max(1, math.ceil((index + 1) * window - now))
    net_limit, net_window = options.network_rate_limit
    net_index = int(now // net_window)
    net_key = limits.rate_key("netrate", network_key, net_window, net_index) if network_key else ""
    net_retry_after = max(1, math.ceil((net_index + 1) * net_window - now))
    if redis_clients.usable():
        try:
            answer = await _take_shared(
                client_key, lease, rate_key, net_key, limit=limit, window=window, options=options, new=new
            )
        except (RedisError, OSError) as exc:
            redis_clients.failed(exc)  # served on this process's own counts meanwhile
        else:
            redis_clients.breaker.succeeded()
            if answer == 1:
                return (ErrorCode.RATE_LIMITED, retry_after, False), True
            if answer == 2:
                return (ErrorCode.TOO_MANY_STREAMS, TOO_MANY_STREAMS_RETRY_AFTER_S, False), True
            if answer == 3:
                return (ErrorCode.RATE_LIMITED, net_retry_after, True), True
            return None, True
    if new and await _count(rate_key, window + 1) > limit:
        return (ErrorCode.RATE_LIMITED, retry_after, False), False
    if new and net_key and await _count(net_key, net_window + 1) > net_limit:
        return (ErrorCode.RATE_LIMITED, net_retry_after, True), False
    if lease and leases.count(client_key) >= options.max_concurrent_streams:
        return (ErrorCode.TOO_MANY_STREAMS, TOO_MANY_STREAMS_RETRY_AFTER_S, False), False
    return None, False


async def _count(key: str, ttl: int) -> int:
    """Without REDIS_URL the counts are the cache's, shared with the WebSocket's count of refused
    starts; while Redis is down (or the cache is a Redis that is down), this process's own."""
    return limits.count_here(key, ttl) if redis_clients.enabled() else await limits.count(key, ttl)


async def _take_shared(
    client_key: str,
    lease: str,
    rate_key: str,
    net_key: str,
    *,
    limit: int,
    window: int,
    options: GatewaySettings,
    new: bool,
) -> int:
    net_limit, net_window = options.network_rate_limit
    answer: int = await redis_clients.client().eval(
        _ADMIT,
        3,
        limits.cache_key(rate_key),
        lease_key(client_key),
        limits.cache_key(net_key) if net_key else "",
        limit,
        window + 1,
        options.max_concurrent_streams,
        int(time.time() * 1000),
        int(LEASE_TTL_S * 1000),
        lease,
        "1" if new else "0",
        net_limit,
        net_window + 1,
    )
    return answer


async def _shielded(awaitable: Any) -> None:
    """Finish `awaitable` even if this task is cancelled meanwhile."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        raise  # the task goes on by itself
    except (RedisError, OSError) as exc:
        # An outage: the breaker says so once (not once per stream, and with no traceback), and
        # the lease expires by itself within LEASE_TTL_S.
        redis_clients.failed(exc)
        logger.debug("could not give a stream slot back (it expires by itself): %r", exc)
    except Exception:
        logger.warning("could not give a stream slot back (it expires by itself)", exc_info=True)


# -- draining -------------------------------------------------------------------------------------

#: How long the client of a cut stream waits before it resumes (EventSource's `retry`), in ms: a
#: random pick in this range, so the streams of a whole process do not all land on the next one
#: in the same instant.
RECONNECT_RETRY_MS = (250, 1500)
#: After the cut, how long the cut streams get to send their last event and write their rows.
CUT_GRACE_S = 5.0


class Drain:
    """This process's drain (one per process: `drain`). It knows no connection: at its deadline
    the runs end theirs (quotes.ai.gateway.runs.end_for_drain)."""

    def __init__(self) -> None:
        self.draining = False
        #: the deadline has passed: what still reads a generation is told to resume elsewhere
        self.cut = False

    async def run(self, timeout_s: float) -> None:
        """Refuse new streams from now on; let the open ones run for up to `timeout_s`."""
        self.draining = True
        logger.info("draining: %d open streams, deadline in %g s", open_streams.count, timeout_s)
        await self.settle(timeout_s)
        self.cut = True

    async def settle(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until no stream is open and no run is going."""
        emptied = open_streams.emptied = asyncio.Event()
        if open_streams.count or open_streams.runs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(emptied.wait(), timeout_s)


def reconnect_retry_ms() -> int:
    return random.randint(*RECONNECT_RETRY_MS)


drain = Drain()
