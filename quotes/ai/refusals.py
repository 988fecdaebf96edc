"""Refused requests (429), counted instead of logged one row each.

A client over its limit can send hundreds of requests a second: a full log row for each would
grow the table without bound and, on SQLite, hold the write lock against the rows of live streams.
So the refusals of one client, persona and reason in one rate-limit window share one small row (no
request body, topic or text) whose `request_count` says how many there were:

- the first refusal in the window writes the row, before the 429 goes out;
- every refusal is counted in the cache (one atomic increment, as the limit itself is);
- the count is copied to the row at most once a second (`FLUSH_AFTER_S`) after refusals
  stop arriving in it, by a timer in this process, so a flood costs two writes a second at most.

Both writes go through the log writer (quotes.ai.gateway.rows), and its outbox while the database
is down: the count as the whole row with its `request_count`, which the writer inserts if the row
is not in yet and else only raises, so a count that overtakes its row is not lost.

The analytics sum `request_count`, so every refusal is still counted there. The row's id is
derived from the window's cache key (keyed with the SECRET_KEY), so processes sharing a Redis
cache update the same row (without Redis each process keeps its own). A process that drains
before it exits (quotes.server) copies every pending count at the last moment (`flush_now`), so
a draining process's refusals, which go on until it stops, are counted too.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
import uuid

from django.conf import settings
from django.core.cache import cache, caches
from django.core.cache.backends.locmem import LocMemCache

from ..models import Generation, Persona, PersonaVersion
from . import limits
from .gateway.rows import refusal_row, writer
from .redis_health import report

logger = logging.getLogger(__name__)

#: How long after a refusal its window's count is copied to the log row.
FLUSH_AFTER_S = 1.0

#: Flushes waiting to run in this process, by cache key: at most one per window.
_pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle, Generation]] = {}
_running: set[asyncio.Task[None]] = set()


async def record_refusal(
    *,
    persona: Persona,
    version: PersonaVersion | None,
    backend: str,
    model: str,
    client_key: str,
    client_hash: str,
    preview: bool,
    code: str,
    message: str,
    window: int,
    status: str | None = None,
    local: bool = False,
) -> None:
    """Count one refused request; the first of its window also writes the row. Never raises
    (but for cancellation): the visitor's 429 (or 503) must go out whatever the log's trouble.
    `status`: rate-limited unless said otherwise (busy, for a process at its open-stream limit).
    `local`: counted in this process's memory, not the shared cache (a refusal by this process's
    own open-stream limit: quick, with no round trip, when the process is at its busiest)."""
    try:
        index = int(time.time() // window)
        # A cache of this process's own (no Redis) counts this process's refusals only: each
        # process then keeps its own row, so the analytics' sum is still every refusal.
        local_cache = isinstance(caches["default"], LocMemCache)
        scope = f":pid{os.getpid()}" if local or local_cache else ""
        key = f"quotes:refusals:{client_key}:{persona.pk}:{code}:{int(preview)}:{window}:{index}{scope}"
        # Kept past the window's end, so a flush that runs after it still reads the count.
        keep_s = window + int(FLUSH_AFTER_S) + 60
        if local:
            count = _count_locally(key, keep_s)
        else:
            count = await limits.run_on_cache(limits.count_in_window, key, keep_s)
        facts: dict[str, object] = {"persona_id": persona.pk, "persona_version_id": version and version.pk}
        facts |= {"backend": backend, "model": model, "client_hash": client_hash, "is_preview": preview}
        status = status or Generation.Status.RATE_LIMITED
        row = refusal_row(_row_id(key), facts, status=status, code=code, message=message)
        if count == 1:  # (or the count was lost, the cache restarted: the row is kept as it is)
            await writer.write(row)
        else:
            _schedule_flush(key, row)
    except Exception as exc:
        report(logger, "could not record a refused request", exc)


#: Counts kept in this process's memory (`local`), by key: (count, forget after).
_local_counts: dict[str, tuple[int, float]] = {}


def _count_locally(key: str, keep_s: int) -> int:
    now = time.monotonic()
    if len(_local_counts) > 1000:  # forget windows long over
        for old in [k for k, (_, until) in _local_counts.items() if until < now]:
            del _local_counts[old]
    count = _local_counts.get(key, (0, 0.0))[0] + 1
    _local_counts[key] = (count, now + keep_s)
    return count


def _row_id(key: str) -> uuid.UUID:
    """The window's row: the same in every process, and not guessable from outside."""
    digest = hmac.new(settings.SECRET_KEY.encode(), key.encode(), hashlib.sha256).digest()
    return uuid.UUID(bytes=digest[:16], version=4)


def _schedule_flush(key: str, row: Generation) -> None:
    loop = asyncio.get_running_loop()
    pending = _pending.get(key)
    if pending is not None and pending[0] is loop and not pending[1].cancelled():
        return  # that flush reads the count after this refusal was added
    _pending[key] = (loop, loop.call_later(FLUSH_AFTER_S, _start_flush, key, row), row)


def _start_flush(key: str, row: Generation) -> None:
    _pending.pop(key, None)  # before reading the count: a refusal from now on schedules anew
    task = asyncio.ensure_future(_flush(key, row))
    _running.add(task)
    task.add_done_callback(_running.discard)


async def flush_now() -> None:
    """Copy every pending count to its row now, and wait for the copies under way: the last
    thing a process does before it stops (no await may come between this and the stop, or a
    refusal answered in between would go uncounted)."""
    while _pending or _running:
        for key, (_loop, handle, row) in list(_pending.items()):
            handle.cancel()
            _start_flush(key, row)
        if _running:
            await asyncio.gather(*_running, return_exceptions=True)


async def _flush(key: str, row: Generation) -> None:
    """Copy the window's count to its row: the whole row, with the count, through the log
    writer, which inserts it if it is not in yet (its first refusal's row is still queued, or in
    an outbox) and else only raises its count."""
    try:
        if key in _local_counts:
            count: object = _local_counts[key][0]
        else:
            count = await limits.run_on_cache(cache.get, key)
        if isinstance(count, int) and count > 1:
            row.request_count = count
            await writer.write(row)
    except Exception as exc:
        report(logger, "could not record refused requests", exc)
