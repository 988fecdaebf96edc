"""Runs across processes, in Redis (only with REDIS_URL): the wire format and the calls.

    owner process:  runs' sender -> XADD quotes:live:<public_id>  (+ heartbeat key, claim)
    other process:  follow() <- XREAD BLOCK quotes:live:<public_id>  (a resume, or a follower)

A live run's events go to one Redis Stream per run, as JSON (numbered from the index each entry
starts at), with a heartbeat key naming its process. A reader elsewhere holds a lease on the run
(`quotes:readers:<id>`), so its owner knows it is still read (`has_readers`); a reader whose
owner's heartbeat has gone ends with `generation_lost`. The first process to call the upstream
for an answer key claims it (`claim`); identical requests elsewhere follow its run. A stop asked
of another process goes to that process's list (`stop_elsewhere`), popped by its sender. A Redis
that fails costs the cross-process parts (logged), never the stream of the process holding the
run. docs/architecture.md, "Across processes", has the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from ..errors import ErrorCode, stopped
from ..events import Done, Error, Event, Ping, Reconnect, Token, from_json, to_json
from . import redis_clients
from .admission import drain
from .rows import FACT_TYPES, lost_row, writer
from .tasks import detached_task

logger = logging.getLogger(__name__)

#: How long a dead owner's heartbeat (and its claims) outlive it: followers give up, and
#: identical requests call the upstream themselves, this long after a kill -9.
HEARTBEAT_TTL_S = 3.0
HEARTBEAT_EVERY_S = 1.0
#: A reader's lease on a run: renewed this often, and gone this long after its process died.
READER_RENEW_S = 1.0
READER_TTL_S = 3.0
#: How long a run's stream stays in Redis after its last entry (a late resume reads the
#: finished log from the cache; this covers the moment in between, and followers still reading).
STREAM_TTL_S = 120
#: A live run's stream lasts at most this long (reset to STREAM_TTL_S at its end).
LIVE_TTL_S = 3600
#: The codes a run ends with for its own connections' sake, not the generation's: a follower on
#: another process, which did not ask for that, is told the generation is lost instead.
RUN_ENDINGS = frozenset({ErrorCode.STOPPED, ErrorCode.ABANDONED, ErrorCode.SERVER_DRAINING})
#: Stops taken from the list per round trip (more wait for the next round).
STOPS_PER_ROUND = 64
#: How long a process asking another to stop a run waits to see it end.
STOP_WAIT_S = 5.0

#: Claim `KEYS[1]` for run ARGV[1] unless a live owner holds it (its heartbeat key, ARGV[3] +
#: its run id, exists): nil when claimed now, else the owner's run id.
_CLAIM = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] and redis.call('EXISTS', ARGV[3] .. owner) == 1 then return owner end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', ARGV[3] .. ARGV[1], ARGV[4], 'PX', ARGV[2])
return false
"""
#: Renew `KEYS[1]` for ARGV[2] ms if run ARGV[1] still holds it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

OWNER_PREFIX = "quotes:owner:"
_NO_EVENTS = to_json([])


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
    return OWNER_PREFIX + public_id


def claim_key(answer_key: str) -> str:
    return f"quotes:flight:{answer_key}"


def readers_key(public_id: str) -> str:
    return f"quotes:readers:{public_id}"


def stops_key(process: str) -> str:
    return f"quotes:stops:{process}"


#: Every run live in some process (a set of run ids): a run joins it with its first entry and
#: leaves it at its end, so that a run whose process died without ending it can be found.
LIVE_RUNS = "quotes:live-runs"
#: How often a process looks for runs whose owner died (when it serves requests).
SWEEP_EVERY_S = 5.0


#: Whether runs are shared now: REDIS_URL is set and Redis answers (while it does not, each
#: process serves on its own: no coalescing or resume across processes).
available = redis_clients.usable


def reset() -> None:
    """Forget the clients of a loop that is gone (a finished test's)."""
    redis_clients.forget()


async def close() -> None:
    """Close the clients (the end of a test's loop)."""
    await redis_clients.close()


# -- the owner's side -------------------------------------------------------------------------------


class Publisher:
    """What of one run is in Redis (`sent`), its heartbeat, the answer key it claimed, and whether
    its readers elsewhere must hear its client's stop. quotes.ai.gateway.runs sends it."""

    __slots__ = ("beat_due", "claim", "end_tries", "public_id", "sent", "stop_due")

    def __init__(self, public_id: str, claim: str = "") -> None:
        self.public_id = public_id
        self.sent = 0
        self.beat_due = 0.0
        self.claim = claim  # renewed with the heartbeat, released at the run's end
        self.stop_due = False
        self.end_tries = 0  # rounds that failed to send its end


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A run's part of one round trip: its events not sent yet, whether they end it, and who it is."""

    publisher: Publisher
    events: list[Event]
    ended: bool
    client_key: str
    facts: dict[str, object]


def _stage(pipe: Any, out: Outgoing, now: float) -> None:
    """Queue one run's commands: its new events, its heartbeat (and claim) when due; at its end
    the stream's expiry, the heartbeat's removal and the claim's release."""
    publisher, public_id = out.publisher, out.publisher.public_id
    stream = stream_key(public_id)
    end = publisher.sent + len(out.events)
    if out.events:
        fields = {"i": publisher.sent, "d": to_json(out.events)}
        if not publisher.sent:
            fields["r"] = json.dumps(out.facts)
            fields["c"] = out.client_key  # who may stop it from another process
        pipe.xadd(stream, fields)
        if not publisher.sent or out.ended:  # once live, once ended: not per batch
            pipe.expire(stream, STREAM_TTL_S if out.ended else LIVE_TTL_S)
        if not publisher.sent and not out.ended:
            pipe.sadd(LIVE_RUNS, public_id)
    if publisher.stop_due:
        publisher.stop_due = False
        pipe.xadd(stream, {"i": end, "d": _NO_EVENTS, "x": 1})
    if out.ended:
        pipe.delete(owner_key(public_id))
        pipe.srem(LIVE_RUNS, public_id)
        if publisher.claim:
            pipe.eval(_RELEASE, 1, claim_key(publisher.claim), public_id)
    elif now >= publisher.beat_due:
        ttl_ms = int(HEARTBEAT_TTL_S * 1000)
        pipe.set(owner_key(public_id), redis_clients.PROCESS, px=ttl_ms)
        if publisher.claim:
            pipe.eval(_RENEW, 1, claim_key(publisher.claim), public_id, ttl_ms)
        publisher.beat_due = now + HEARTBEAT_EVERY_S


#: Rounds a run's end is tried (about a second apart while Redis fails) before it is given up.
END_TRIES = 30


async def send(
    outgoing: list[Outgoing], now: float
) -> tuple[set[Publisher], set[Publisher], list[str] | None]:
    """One round trip for every run in `outgoing`, and the stops asked of this process's runs:
    the publishers done (their end is in Redis, or given up), those to send again, and the run
    ids to stop (None when Redis failed). A run's end that fails is sent again: given up, its
    readers elsewhere would hear that a quote that finished was lost."""
    pipe = redis_clients.client().pipeline(transaction=False)
    spans = []
    for out in outgoing:
        before = len(pipe)
        _stage(pipe, out, now)
        spans.append((before, len(pipe)))
    pipe.lpop(stops_key(redis_clients.PROCESS), STOPS_PER_ROUND)
    try:
        redis_clients.breaker.check()
        results: list[Any] | None = await pipe.execute(raise_on_error=False)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        redis_clients.failed(exc)
        results = None
    else:
        redis_clients.breaker.succeeded()
    done: set[Publisher] = set()
    again: set[Publisher] = set()
    for out, (first, last) in zip(outgoing, spans, strict=True):
        publisher = out.publisher
        if results is not None and not any(isinstance(result, Exception) for result in results[first:last]):
            publisher.sent += len(out.events)
            if out.ended:
                done.add(publisher)
            continue
        if results is not None:
            logger.warning("could not publish run %s's events to Redis", publisher.public_id)
        if out.ended:
            publisher.end_tries += 1
            if publisher.end_tries >= END_TRIES:
                logger.warning("gave up publishing the end of run %s to Redis", publisher.public_id)
                done.add(publisher)
                continue
        publisher.beat_due = 0.0
        again.add(publisher)
    if results is None:
        return done, again, None
    stops = results[-1] if isinstance(results[-1], list) else []
    return done, again, [public_id.decode(errors="replace") for public_id in stops]


def cancelled() -> bool:
    """This task was asked to stop, even if the call it was in answered with another exception
    (redis-py may turn a cancel that meets its own read timeout into an error): a loop that
    retried would outlive its event loop's shutdown."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def has_readers(public_id: str, *, followers: bool = False) -> bool:
    """Whether a process other than this one reads run `public_id` now (a follower, a resume;
    with `followers`, a follower): then the run must not end early. False when Redis cannot
    say (the run ends as it would without other processes)."""
    if not available():
        return False
    try:
        leases: Any = await redis_clients.client().zrangebyscore(
            readers_key(public_id), time.time() * 1000, "+inf"
        )
    except Exception as exc:
        redis_clients.failed(exc)
        return False
    return any(lease.startswith(b"f:") for lease in leases) if followers else bool(leases)


# -- the runs of dead processes ----------------------------------------------------------------

_last_sweep = 0.0
_sweeping: asyncio.Task[list[str]] | None = None


def sweep_soon() -> None:
    """Look for runs whose process died (at most every SWEEP_EVERY_S; called as requests come)."""
    global _last_sweep, _sweeping
    now = time.monotonic()
    if now - _last_sweep < SWEEP_EVERY_S or not available():
        return
    if _sweeping is not None and not _sweeping.done() and _sweeping.get_loop() is asyncio.get_running_loop():
        return
    _last_sweep = now
    _sweeping = detached_task(sweep())


async def sweep() -> list[str]:
    """Write the row of every run whose owner's heartbeat has expired without an end (its
    process was killed): under the run's own id, with the facts and text Redis holds, as
    `generation_lost`. Exactly once: the process whose SREM takes a run off LIVE_RUNS writes it
    (and the log is idempotent by generation id besides). The ids written."""
    redis = redis_clients.client()
    try:
        members: Any = await redis.smembers(LIVE_RUNS)
        ids = sorted(member.decode() for member in members)
        if not ids:
            return []
        pipe = redis.pipeline(transaction=False)
        for public_id in ids:
            pipe.exists(owner_key(public_id))
        alive = await pipe.execute()
        written = []
        for public_id, beating in zip(ids, alive, strict=True):
            if beating or not await redis.srem(LIVE_RUNS, public_id):
                continue  # alive, or another process took it
            found = await read(public_id)
            if found is None or not found[2]:
                continue
            events, _, facts = found
            if events and type(events[-1]) in (Done, Error):
                continue  # it ended: its owner wrote its row
            text = "".join(e.text for e in events if type(e) is Token)
            writer.submit(
                lost_row(public_id, facts, text, "The process writing this quote died before it finished.")
            )
            written.append(public_id)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        redis_clients.failed(exc)
        return []
    if written:
        logger.warning("wrote the rows of %d runs whose process died", len(written))
    return written


# -- the other processes' side --------------------------------------------------------------------


async def claim(answer_key: str, public_id: str) -> str | None:
    """Claim the upstream call for `answer_key` for run `public_id`: None when this process now
    owns it (or Redis cannot say: then it calls the upstream itself), else the run id of its
    live owner. An owner whose heartbeat is gone (killed) loses its claim to this one."""
    if not available():
        return None
    try:
        owner = await redis_clients.client().eval(
            _CLAIM,
            1,
            claim_key(answer_key),
            public_id,
            int(HEARTBEAT_TTL_S * 1000),
            OWNER_PREFIX,
            redis_clients.PROCESS,
        )
    except Exception as exc:
        redis_clients.failed(exc)  # this process calls the upstream itself
        return None
    if not owner:
        return None
    return owner.decode() if isinstance(owner, bytes) else str(owner)


def _new(fields: dict[bytes, bytes], seen: int) -> list[Event]:
    """The events of a stream entry that come after the first `seen` of the run (an entry sent
    again after a failed reply would repeat some: a client must never get a token twice).
    ValueError for an entry this module did not write."""
    batch = from_json(fields.get(b"d", b""))
    return batch[max(0, seen - int(fields.get(b"i", b""))) :]


def _facts(data: bytes | None) -> dict[str, Any]:
    """A run's facts (Run.facts) as its first entry has them; ValueError for anything else:
    they become a log row's fields."""
    facts = json.loads(data) if data else {}
    if facts and not (
        isinstance(facts, dict)
        and facts.keys() == FACT_TYPES.keys()
        and all(type(facts[name]) in types for name, types in FACT_TYPES.items())
    ):
        raise ValueError("not a run's facts")
    return facts


def _unreadable(public_id: str) -> None:
    logger.warning("run %s's stream in Redis holds an entry this app did not write: read as lost", public_id)


async def read(public_id: str) -> tuple[list[Event], str, dict[str, Any]] | None:
    """The events of run `public_id` that its stream holds now (all of them, from the first),
    the id of the last entry read and the run's facts (Run.facts); None when Redis has no such
    run."""
    try:
        entries: Any = await redis_clients.client().xrange(stream_key(public_id))
    except Exception as exc:
        redis_clients.failed(exc)
        return None
    if not entries:
        return None
    events: list[Event] = []
    try:
        for _, fields in entries:
            events.extend(_new(fields, len(events)))
        facts = _facts(entries[0][1].get(b"r"))
    except (ValueError, RecursionError):
        _unreadable(public_id)
        return None
    return events, entries[-1][0].decode(), facts


async def stop_elsewhere(public_id: str, client_key: str) -> bool | None:
    """Stop run `public_id`, live in another process, for the client that started it: True
    once its owner has taken the stop (it ended stopped, or goes on only for other readers),
    False when it ended otherwise first; None when no process holds it for this client."""
    redis = redis_clients.client()
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
    except Exception as exc:
        redis_clients.failed(exc)
        return None
    # The stop is taken within a round trip of the owner's sender: the run ends stopped, or,
    # when followers read it, goes on for them with a stop entry in its stream (read here as a
    # stopped Error too). A Done that came first means it had ended.
    try:
        async with (
            asyncio.timeout(STOP_WAIT_S),
            contextlib.aclosing(follow(public_id, lease=False)) as events,
        ):
            async for event in events:
                if isinstance(event, Error):
                    return event.code is ErrorCode.STOPPED
                if isinstance(event, Done):
                    return False
    except TimeoutError:
        pass
    return True


_reader_ids = itertools.count(1)


async def follow(
    public_id: str,
    *,
    last: str = "0-0",
    keepalive_s: float | None = None,
    for_run: bool = False,
    skip: int = 0,
    seen: int = 0,
    lease: bool = True,
) -> AsyncGenerator[Event, None]:
    """The events of run `public_id` from its stream, after entry `last`, as they come, ending
    with its terminal event; `generation_lost` when its owner is gone (heartbeat expired) before
    that. Pings after `keepalive_s` of quiet when given. `for_run`: the events feed a flight of
    our own (a follower), which is told by OwnerGone when the owner's run ends for its own
    connections' sake (stopped, abandoned, drained) or is lost, instead of an event. `skip`: how
    many events to leave out first (a follower leaves out the owner's opening Meta: its run has
    its own). `seen`: how many events the entries up to `last` hold. `lease`: hold a reader
    lease on the run while reading (every reader but a stop's own look)."""
    redis = redis_clients.reader()
    stream, owner, readers = stream_key(public_id), owner_key(public_id), readers_key(public_id)
    me = f"{'f' if for_run else 'r'}:{redis_clients.PROCESS}:{next(_reader_ids)}"
    wait = redis_clients.block_ms()
    quiet_since = time.monotonic()
    renew_at = 0.0
    try:
        while True:
            if drain.cut and lease and not for_run:
                # A resume's, past this process's drain deadline (a follower's run is cut by
                # itself, a stop's look is no connection): its client resumes elsewhere.
                yield Reconnect()
                return
            if lease and time.monotonic() >= renew_at:
                renew_at = time.monotonic() + READER_RENEW_S
                with contextlib.suppress(Exception):  # a lease that fails costs a stop's wait
                    pipe = redis_clients.client().pipeline(transaction=False)
                    pipe.zadd(readers, {me: time.time() * 1000 + READER_TTL_S * 1000})
                    pipe.pexpire(readers, int(READER_TTL_S * 1000))
                    await pipe.execute()
            try:
                answer: Any = await redis.xread({stream: last}, block=wait, count=64)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                redis_clients.failed(exc)
                if for_run:
                    raise OwnerGone("redis") from None
                yield generation_lost()
                return
            if answer:
                for entry_id, fields in answer[0][1]:
                    last = entry_id.decode()
                    try:
                        batch = _new(fields, seen)
                    except ValueError:
                        _unreadable(public_id)
                        if for_run:
                            raise OwnerGone("unreadable") from None
                        yield generation_lost()
                        return
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
                    if b"x" in fields and not for_run:
                        yield stopped()  # its client stopped it (it goes on for followers)
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
            except Exception as exc:
                redis_clients.failed(exc)
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
    finally:
        if lease and renew_at:
            with contextlib.suppress(Exception):
                await asyncio.shield(redis_clients.client().zrem(readers, me))
