"""The relay: a live run's events in Redis, for the other processes (only when REDIS_URL is set).

    owner process:  run -> Publisher -> XADD quotes:live:<public_id>   (+ heartbeat key)
    other process:  follow() <- XREAD BLOCK quotes:live:<public_id>    (a resume, or a follower)

While a run is live, its process publishes its events to one Redis Stream per run and keeps a
heartbeat key (`quotes:owner:<public_id>`, HEARTBEAT_TTL_S, refreshed every HEARTBEAT_EVERY_S)
saying that it still holds it. Publishing is batched by itself: one task per run sends what the
run's log gained since the last send in one XADD (one pickled list of events, numbered from the
index it starts at), so a follower sees a token one round trip after it came, and under load a
round trip carries many tokens instead of costing one each.

Another process reads a run it does not hold with `follow()`: what the stream has, then new
entries as they come (XREAD BLOCK), until the terminal event. When the heartbeat key has expired
and nothing more comes (the owner was killed), the reader ends with `generation_lost` (retryable)
instead of waiting forever.

Coalescing across processes: the first process to start an upstream call for an answer-cache key
claims it (`SET quotes:flight:<key> <run id> NX`); an identical request elsewhere follows that
run's events (`claim()` returns the owner's run id) instead of calling the upstream itself.

Stopping across processes: the heartbeat key holds the owner process's id (`PROCESS`). A stop
asked of another process (`stop_elsewhere`, the stop endpoint behind nginx) pushes the run's id
onto the owner's list `quotes:stops:<process>`. The owner's sender pops that list in each of its
round trips (the same pipeline as the events) and stops the run: within milliseconds while
tokens flow, within HEARTBEAT_EVERY_S before the first one. The asking process answers once the
run's end is in its stream. (No task of its own waits on the list: a blocking read per process
outlived asyncio.run's shutdown in `manage.py quote` on CI.) Only the client that started a run may stop it: the run's first entry names it.

Two connection pools per process: a small one that short calls wait on (publishing, claims),
one for blocking reads (a follower holds a connection while it waits). Every call is bounded by
REDIS_OPTIONS' timeouts; a Redis that fails costs the cross-process
parts (logged), never the stream of the process that holds the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from django.conf import settings

from ..errors import ErrorCode
from ..events import Done, Error, Event, Ping

if TYPE_CHECKING:
    from .runs import Run

logger = logging.getLogger(__name__)

#: How long a dead owner's heartbeat outlives it: followers give up this long after a kill -9.
HEARTBEAT_TTL_S = 3.0
HEARTBEAT_EVERY_S = 1.0
#: How long a run's stream stays in Redis after its last entry (a late resume reads the
#: finished log from the cache; this covers the moment in between, and followers still reading).
STREAM_TTL_S = 120
#: A live run's stream lasts at most this long (reset to STREAM_TTL_S at its end).
LIVE_TTL_S = 3600
#: An owner's claim on an answer key lasts at most this long without being released.
CLAIM_TTL_S = 300
#: The codes a run ends with for its own connections' sake, not the generation's: a follower on
#: another process, which did not ask for that, is told the generation is lost instead.
RUN_ENDINGS = frozenset({ErrorCode.STOPPED, ErrorCode.ABANDONED, ErrorCode.SERVER_DRAINING})

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class OwnerGone(Exception):
    """The run a follower followed ended for its own connections' sake (stopped, abandoned,
    drained), or its process stopped publishing it: the follower decides what to do."""


def generation_lost() -> Error:
    return Error(
        ErrorCode.GENERATION_LOST,
        "The server writing this quote went away before it finished. Please ask again.",
        503,
        retry_after=1,
    )


def stream_key(public_id: str) -> str:
    return f"quotes:live:{public_id}"


def owner_key(public_id: str) -> str:
    return f"quotes:owner:{public_id}"


def claim_key(answer_key: str) -> str:
    return f"quotes:flight:{answer_key}"


def stops_key(process: str) -> str:
    return f"quotes:stops:{process}"


#: This process, as the heartbeat keys of its runs name it (where other processes send stops).
PROCESS = uuid.uuid4().hex
#: Stops taken from the list per round trip (more wait for the next round).
STOPS_PER_ROUND = 64
#: How long a process asking another to stop a run waits to see it end.
STOP_WAIT_S = 5.0


def enabled() -> bool:
    return bool(settings.REDIS_URL)


# -- the client: one pool per process (per event loop) --------------------------------------------

#: Short calls (publishing, claims, reads) share a few connections, waiting for a free one
#: (within the socket timeout) rather than failing when every run publishes at once.
SHORT_CONNECTIONS = 32
#: A follower's XREAD BLOCK holds a connection while it waits: one each, from a pool of their own
#: so that they never starve the publishers.
BLOCKING_CONNECTIONS = 10_000

_clients: tuple[asyncio.AbstractEventLoop, aioredis.Redis, aioredis.Redis] | None = None


def _pools() -> tuple[aioredis.Redis, aioredis.Redis]:
    """This process's two Redis clients (short calls, blocking reads). Bound to the running
    loop: daphne has one; a test run has one per test, and `close()` ends each."""
    global _clients
    loop = asyncio.get_running_loop()
    if _clients is None or _clients[0] is not loop:
        forget()
        options = settings.REDIS_OPTIONS
        timeouts = {
            "socket_timeout": options["socket_timeout"],
            "socket_connect_timeout": options["socket_connect_timeout"],
        }
        short = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            max_connections=SHORT_CONNECTIONS,
            timeout=options["socket_timeout"],
            **timeouts,
        )
        blocking = aioredis.ConnectionPool.from_url(
            settings.REDIS_URL, max_connections=BLOCKING_CONNECTIONS, **timeouts
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


#: The publishers of this process still sending, so a drain can wait for their last entries.
publishers: set[Publisher] = set()


async def flush(timeout_s: float) -> None:
    """Wait (up to `timeout_s`) until every run's last events are in Redis (before an exit)."""
    if _sender is not None and not _sender.done():
        await asyncio.wait([_sender], timeout=timeout_s)  # it stops once every run is out


def forget() -> None:
    """Drop clients whose loop is gone (a finished test's), closing their sockets without it."""
    global _clients
    if _clients is None:
        return
    _, *redis_clients = _clients
    _clients = None
    _close_dead(redis_clients)


def _close_dead(redis_clients: list[aioredis.Redis]) -> None:
    for redis in redis_clients:
        pool = redis.connection_pool
        for connection in [*pool._available_connections, *pool._in_use_connections]:
            writer = connection._writer
            connection._writer = connection._reader = None
            if writer is not None:
                _close_without_loop(writer.transport)


def _close_without_loop(transport: asyncio.BaseTransport) -> None:
    """Close a socket transport whose loop is closed (so StreamWriter.close() cannot run), and
    leave it as a closed transport would be: marked closing (StreamWriter.__del__ is then quiet)
    and with no socket (so _SelectorTransport.__del__ is too)."""
    # close() marks the transport closing, then fails where it schedules connection_lost on the
    # closed loop: that callback would only tell a protocol nobody reads any more.
    with contextlib.suppress(RuntimeError):
        transport.close()
    sock = getattr(transport, "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
        transport._sock = None  # type: ignore[attr-defined]


def reset() -> None:
    """Forget everything of a loop that is gone (a finished test's): its runs, its sender, its
    clients."""
    global _sender
    _sender = None
    _dirty.clear()
    publishers.clear()
    forget()


async def close() -> None:
    """Stop publishing and close the pools (the end of a test's loop)."""
    global _clients
    global _sender
    if _sender is not None:
        _sender.cancel()
        _sender = None
    publishers.clear()
    _dirty.clear()
    if _clients is not None:
        loop, *redis_clients = _clients
        _clients = None
        if loop is asyncio.get_running_loop():
            for redis in redis_clients:
                await redis.aclose()
        elif loop.is_closed():
            _close_dead(redis_clients)


# -- the owner's side -------------------------------------------------------------------------------


class Publisher:
    """A run's place in this process's one sender: what of its log is in Redis (`sent`), its
    heartbeat, the answer key it claimed. `poke()` (a run's event, synchronous) marks it."""

    __slots__ = ("beat_due", "claim", "run", "sent")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.sent = 0
        self.beat_due = 0.0
        #: the answer key this run claimed for its upstream call (released at its end)
        self.claim = ""
        publishers.add(self)
        self.poke()

    def poke(self) -> None:
        _dirty.add(self)
        _wake_sender()

    def stage(self, pipe: Any, now: float) -> tuple[int, bool]:
        """Queue this run's commands on `pipe`: its new events, its heartbeat when due, and at
        its end the stream's expiry, the heartbeat's removal and the claim's release. Returns
        the log length sent, and whether that is the end."""
        run = self.run
        log = run.log
        end = len(log)
        ended = run.ended and end > 0
        stream = stream_key(run.public_id)
        if end > self.sent:
            fields = {
                "i": self.sent,
                "d": pickle.dumps([log.at(i) for i in range(self.sent, end)], protocol=5),
            }
            if not self.sent:
                fields["r"] = pickle.dumps(run.facts, protocol=5)
                fields["c"] = run.client_key  # who may stop it from another process
            pipe.xadd(stream, fields)
            if not self.sent or ended:
                # Set once live (a bound for a run whose process dies), once ended: not per
                # batch, which would double the commands per token.
                pipe.expire(stream, STREAM_TTL_S if ended else LIVE_TTL_S)
        if ended:
            pipe.delete(owner_key(run.public_id))
            if self.claim:
                pipe.eval(_RELEASE, 1, claim_key(self.claim), run.public_id)
        elif now >= self.beat_due:
            pipe.set(owner_key(run.public_id), PROCESS, px=int(HEARTBEAT_TTL_S * 1000))
            self.beat_due = now + HEARTBEAT_EVERY_S
        return end, ended


#: Publishers with something to send (new events, or their end).
_dirty: set[Publisher] = set()
_wake: asyncio.Event | None = None
_sender: asyncio.Task[None] | None = None


def _wake_sender() -> None:
    global _wake, _sender
    if _sender is None or _sender.done():
        from .flights import detached_task

        _wake = asyncio.Event()
        _sender = detached_task(_send())
    assert _wake is not None
    _wake.set()


async def _send() -> None:
    """This process's one sender: every run's pending events, heartbeats and ends in one
    pipeline per round trip, so that under load a round trip carries many runs' tokens (and
    a drain's hundreds of ends), on one connection."""
    assert _wake is not None
    wake = _wake
    while publishers:
        if not _dirty:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), HEARTBEAT_EVERY_S)
        wake.clear()
        now = time.monotonic()
        due = {p for p in publishers if now >= p.beat_due}
        batch = list(_dirty | due)
        _dirty.clear()
        if not batch:
            continue
        pipe = client().pipeline(transaction=False)
        staged = []
        for publisher in batch:
            before = len(pipe)
            end, ended = publisher.stage(pipe, now)
            staged.append((publisher, end, ended, before, len(pipe)))
        # The stops other processes were asked for this process's runs, in the same round trip.
        pipe.lpop(stops_key(PROCESS), STOPS_PER_ROUND)
        try:
            results = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:
            raise
        except Exception:
            if _cancelled():
                return
            # Other processes miss these runs for now; their own connections do not.
            logger.exception("could not publish runs' events to Redis")
            for publisher, _, ended, _, _ in staged:
                if ended:
                    publishers.discard(publisher)  # given up: its resumers will hear it is lost
                else:
                    _dirty.add(publisher)
            await asyncio.sleep(HEARTBEAT_EVERY_S)
            continue
        for publisher, end, ended, first, last in staged:
            if any(isinstance(result, Exception) for result in results[first:last]):
                logger.warning("could not publish run %s's events to Redis", publisher.run.public_id)
                if ended:
                    publishers.discard(publisher)
                else:
                    _dirty.add(publisher)
                    publisher.beat_due = 0.0
                continue
            publisher.sent = end
            if ended:
                publishers.discard(publisher)
        if isinstance(results[-1], list):
            _stop_runs(results[-1])


def _stop_runs(public_ids: list[bytes]) -> None:
    from .runs import runs

    for public_id in public_ids:
        run = runs.get(public_id.decode())
        if run is not None:
            run.stop()


def _cancelled() -> bool:
    """This task was asked to stop, even if the call it was in answered with another exception
    (redis-py's connection may turn a cancel that meets its own read timeout into an error): a
    loop that retried would outlive its event loop's shutdown (asyncio.run waits for it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# -- the other processes' side --------------------------------------------------------------------


async def claim(answer_key: str, public_id: str) -> str | None:
    """Claim the upstream call for `answer_key` for run `public_id`: None when this process now
    owns it (or Redis cannot say: then it calls the upstream itself), else the owner's run id."""
    try:
        redis = client()
        if await redis.set(claim_key(answer_key), public_id, nx=True, ex=CLAIM_TTL_S):
            return None
        owner = await redis.get(claim_key(answer_key))
    except Exception:
        logger.exception("could not claim an upstream call in Redis")
        return None
    if owner is None:
        return None  # released in between: the answer is cached now, or it failed; ask ourselves
    owner_id = owner.decode() if isinstance(owner, bytes) else str(owner)
    return None if owner_id == public_id else owner_id


def _new(fields: dict[bytes, bytes], seen: int) -> list[Event]:
    """The events of a stream entry that come after the first `seen` of the run (an entry sent
    again after a failed reply would repeat some: a client must never get a token twice)."""
    batch: list[Event] = pickle.loads(fields[b"d"])
    return batch[max(0, seen - int(fields[b"i"])) :]


async def read(public_id: str) -> tuple[list[Event], str, dict[str, Any]] | None:
    """The events of run `public_id` that its stream holds now (all of them, from the first),
    the id of the last entry read and the run's facts (Run.facts); None when Redis has no such
    run."""
    try:
        entries: Any = await client().xrange(stream_key(public_id))
    except Exception:
        logger.exception("could not read a run from Redis")
        return None
    if not entries:
        return None
    events: list[Event] = []
    for _, fields in entries:
        events.extend(_new(fields, len(events)))
    facts = entries[0][1].get(b"r")
    return events, entries[-1][0].decode(), pickle.loads(facts) if facts else {}


async def stop_elsewhere(public_id: str, client_key: str) -> bool | None:
    """Stop run `public_id`, live in another process, for the client that started it: True
    once it has ended stopped (or the owner was asked and did not answer within STOP_WAIT_S),
    False when it ended otherwise first; None when no process holds it for this client."""
    redis = client()
    try:
        owner = await redis.get(owner_key(public_id))
        if owner is None:
            return None
        first: Any = await redis.xrange(stream_key(public_id), count=1)
        if not first or first[0][1].get(b"c") != client_key.encode():
            return None
        key = stops_key(owner.decode() if isinstance(owner, bytes) else str(owner))
        pipe = redis.pipeline(transaction=False)
        pipe.rpush(key, public_id)
        pipe.expire(key, int(HEARTBEAT_TTL_S) + 1)  # a dead owner's list goes with it
        await pipe.execute()
    except Exception:
        logger.exception("could not ask another process to stop a run")
        return None
    try:
        async with asyncio.timeout(STOP_WAIT_S), contextlib.aclosing(follow(public_id)) as events:
            async for event in events:
                if isinstance(event, Error):
                    return event.code is ErrorCode.STOPPED
                if isinstance(event, Done):
                    return False
    except TimeoutError:
        pass
    return True


async def follow(
    public_id: str,
    *,
    last: str = "0-0",
    keepalive_s: float | None = None,
    for_run: bool = False,
    skip: int = 0,
    seen: int = 0,
) -> AsyncGenerator[Event, None]:
    """The events of run `public_id` from its stream, after entry `last`, as they come, ending
    with its terminal event; `generation_lost` when its owner is gone (heartbeat expired) before
    that. Pings after `keepalive_s` of quiet when given. `for_run`: the events feed a flight of
    our own (a follower), which is told by OwnerGone when the owner's run ends for its own
    connections' sake (stopped, abandoned, drained) or is lost, instead of an event. `skip`: how many events to leave out first (a follower leaves out
    the owner's opening Meta: its run has its own). `seen`: how many events the entries up to
    `last` hold."""
    redis = reader()
    stream, owner = stream_key(public_id), owner_key(public_id)
    wait = block_ms()
    quiet_since = time.monotonic()
    while True:
        try:
            answer: Any = await redis.xread({stream: last}, block=wait, count=64)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("could not follow a run in Redis")
            if for_run:
                raise OwnerGone("redis") from None
            yield generation_lost()
            return
        if answer:
            for entry_id, fields in answer[0][1]:
                last = entry_id.decode()
                batch = _new(fields, seen)
                seen += len(batch)
                for event in batch:
                    if skip:
                        skip -= 1
                        continue
                    kind = type(event)
                    if isinstance(event, Error) and for_run and event.code in RUN_ENDINGS:
                        raise OwnerGone(event.code)
                    yield event
                    if kind is Done or kind is Error:
                        return
            quiet_since = time.monotonic()
            continue
        try:
            alive = await redis.exists(owner)
            if not alive:
                # One last look: the owner may have sent its end just before its key went.
                answer = await redis.xread({stream: last}, count=64)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("could not follow a run in Redis")
            alive, answer = 0, None
        if not alive and not answer:
            logger.warning("run %s lost: its process stopped publishing it", public_id)
            if for_run:
                raise OwnerGone("heartbeat")
            yield generation_lost()
            return
        if not alive:
            continue  # the end came: read it on the next turn
        if keepalive_s is not None and time.monotonic() - quiet_since >= keepalive_s:
            quiet_since = time.monotonic()
            yield Ping()
