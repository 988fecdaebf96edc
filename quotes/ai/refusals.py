"""Refused requests (429), counted instead of logged one row each.

A client over its limit can send hundreds of requests a second (a WebSocket sent 181 `start`
frames in 0.9 s). A full log row for each (the whole request, about 31 KB) grew the table
without bound and, on SQLite, held the write lock against the rows of live streams. So the
refusals of one client, persona and reason in one rate-limit window share one small row (no
request body, topic or text) whose `request_count` says how many there were:

- the first refusal in the window inserts the row, before the 429 goes out;
- every refusal is counted in the cache (one atomic increment, as the limit itself is);
- the count is copied to the row at most once a second (`FLUSH_AFTER_S`) after refusals
  stop arriving in it, by a timer in this process, so a flood costs two writes a second at most.

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
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache, caches
from django.core.cache.backends.locmem import LocMemCache
from django.db import IntegrityError, OperationalError, close_old_connections

from ..models import Generation, Persona, PersonaVersion
from . import limits
from .redis_health import report

logger = logging.getLogger(__name__)

#: How long after a refusal its window's count is copied to the log row.
FLUSH_AFTER_S = 1.0

#: Flushes waiting to run in this process, by cache key: at most one per window.
_pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle, uuid.UUID]] = {}
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
        await _record(
            key_parts=(client_key, persona.pk, code, int(preview)),
            window=window,
            local=local,
            row=lambda public_id: Generation(
                public_id=public_id,
                persona_id=persona.pk,
                persona_version=version,
                backend=backend,
                model=model,
                status=status or Generation.Status.RATE_LIMITED,
                error_code=code,
                error_message=message,
                client_hash=client_hash,
                is_preview=preview,
                request_count=1,
            ),
        )
    except Exception as exc:
        report(logger, "could not record a refused request", exc)


async def _record(
    *, key_parts: tuple[object, ...], window: int, local: bool, row: Callable[[uuid.UUID], Generation]
) -> None:
    """Count the refusal under its window's key (`key_parts`: client, persona, code, preview);
    the first of the window writes `row(its id)`, later ones schedule the count's flush."""
    index = int(time.time() // window)
    # A cache of this process's own (no Redis) counts this process's refusals only: each
    # process then keeps its own row, so the analytics' sum is still every refusal.
    local_cache = isinstance(caches["default"], LocMemCache)
    scope = f":pid{os.getpid()}" if local or local_cache else ""
    key = f"quotes:refusals:{':'.join(map(str, key_parts))}:{window}:{index}{scope}"
    # Kept past the window's end, so a flush that runs after it still reads the count.
    keep_s = window + int(FLUSH_AFTER_S) + 60
    if local:
        count = _count_locally(key, keep_s)
    else:
        count = await limits.run_on_cache(limits.count_in_window, key, keep_s)
    public_id = _row_id(key)
    if count == 1:
        try:
            await _save_new(row(public_id), own_thread=local)
            return
        except IntegrityError:  # the count was lost (cache restarted), not the row
            pass
    _schedule_flush(key, public_id)


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


async def _save_new(row: Generation, *, own_thread: bool = False) -> None:
    """Insert the window's row. `own_thread`: on a worker thread that sees to its own database
    connection, as the flush does: a refusal of this process's own (its limit, its drain) may be
    answered before Django's handler (quotes.middleware.StreamAdmissionGate), by no request and
    on no request thread, so no request_finished would ever close that connection."""

    async def insert(attempts: int = 5) -> None:
        for attempt in range(attempts):
            try:
                if own_thread:
                    await sync_to_async(_insert, thread_sensitive=False)(row)
                else:
                    await row.asave(force_insert=True)
                return
            except OperationalError:  # SQLite briefly locked by the rows of live streams
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)

    await asyncio.shield(asyncio.ensure_future(insert()))  # a client leaving must not cost the row


def _insert(row: Generation) -> None:
    close_old_connections()
    try:
        row.save(force_insert=True)
    finally:
        close_old_connections()


def _schedule_flush(key: str, public_id: uuid.UUID) -> None:
    loop = asyncio.get_running_loop()
    pending = _pending.get(key)
    if pending is not None and pending[0] is loop and not pending[1].cancelled():
        return  # that flush reads the count after this refusal was added
    _pending[key] = (loop, loop.call_later(FLUSH_AFTER_S, _start_flush, key, public_id), public_id)


def _start_flush(key: str, public_id: uuid.UUID) -> None:
    _pending.pop(key, None)  # before reading the count: a refusal from now on schedules anew
    task = asyncio.ensure_future(_flush(key, public_id))
    _running.add(task)
    task.add_done_callback(_running.discard)


async def flush_now() -> None:
    """Copy every pending count to its row now, and wait for the copies under way: the last
    thing a process does before it stops (no await may come between this and the stop, or a
    refusal answered in between would go uncounted)."""
    while _pending or _running:
        for key, (_loop, handle, public_id) in list(_pending.items()):
            handle.cancel()
            _start_flush(key, public_id)
        if _running:
            await asyncio.gather(*_running, return_exceptions=True)


async def _flush(key: str, public_id: uuid.UUID) -> None:
    try:
        if key in _local_counts:
            count: object = _local_counts[key][0]
        else:
            count = await limits.run_on_cache(cache.get, key)
        if isinstance(count, int) and count > 1:
            await sync_to_async(_write_count, thread_sensitive=False)(public_id, count)
    except Exception as exc:
        report(logger, "could not record refused requests", exc)


def _write_count(public_id: uuid.UUID, count: int, attempts: int = 5) -> None:
    # Outside any request: a worker thread's connection is closed here, or nothing would.
    close_old_connections()
    try:
        for attempt in range(attempts):
            try:
                # Only upward: another process may have written a later count already.
                Generation.objects.filter(public_id=public_id, request_count__lt=count).update(
                    request_count=count
                )
                return
            except OperationalError:  # SQLite briefly locked by the rows of live streams
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * 2**attempt)
    finally:
        close_old_connections()
