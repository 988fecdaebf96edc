"""Active personas and their current version, kept in each process and invalidated by a
version counter in the shared cache.

Every stream needs its persona and the persona's latest version (the log row and the answer
cache key point at it). Two queries per request, each a hop to a thread, were the largest part
of what the app added to the first token. Personas change rarely (an editor saves one in the
admin), so each process keeps them in memory, checked against one value in Django's cache:

- any change to a persona or its versions (save, delete, a queryset update, a migration or a
  flush) replaces the value (`bump`), in this process's memory at once, and in the shared cache
  (Redis) for every process;
- a request reads the value (inline for the in-memory cache, one round trip to Redis) and, when
  it differs from the one the memory was filled under, starts afresh;
- an entry is also re-read after MAX_AGE_S, so a process that cannot see the others' counter
  (several processes on the in-memory cache) or a change made behind the ORM's back (raw SQL)
  is never stale for long.

The active personas' slugs are loaded together, in one query, under the same value (and at most
MAX_AGE_S old): a slug that is not among them is answered from memory, so made-up slugs cost no
query of their own, however many a stranger sends, counted or not.

While the database cannot be reached (quotes.database), a persona this process has loaded before
is served as it was last loaded, however old (personas rarely change, and a quote from a
persona's last known version beats no quote), and the database is asked again only after a
short backoff, not by every request. A persona this process has never loaded cannot be served:
its request gets a 503 `service_unavailable` with Retry-After. The last loaded entry of each
persona outlives the invalidations above (a new version value, or Redis down, empties the fresh
entries on every request); it goes when the database says the persona is gone, or when this
process deletes or deactivates it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.db import close_old_connections
from django.db.models.signals import post_delete, post_migrate, post_save

from .ai.cache import misfit
from .ai.limits import run_on_cache
from .ai.redis_health import report
from .database import UNREACHABLE, outage
from .models import Persona, PersonaVersion, personas_changed

logger = logging.getLogger(__name__)

#: The shared value that names the current generation of persona data ("" until a first change).
VERSION_KEY = "quotes:personas:version"
#: The longest an entry is trusted without reading the database again.
MAX_AGE_S = 30.0


@dataclass(frozen=True, slots=True)
class ActivePersona:
    persona: Persona
    #: its latest version (None only for a persona saved without one, which save() prevents)
    version: PersonaVersion | None
    loaded_at: float


_entries: dict[str, ActivePersona] = {}
#: each persona as it was last loaded, kept across invalidations: what an outage is served from
_known: dict[str, ActivePersona] = {}
#: the active personas' slugs, and when they were loaded (None: not loaded under this value)
_slugs: tuple[frozenset[str], float] | None = None
#: the load of the slugs under way, and the value it started under
_slugs_loading: tuple[str | None, asyncio.Future[frozenset[str]]] | None = None
_loading: dict[str, asyncio.Future[ActivePersona | None]] = {}
_under: str | None = None  # the version value the entries were loaded under (None: none yet)


async def get_active(slug: str) -> ActivePersona | None:
    """The active persona called `slug` and its current version, or None. Raises the 503
    QuoteError when the database cannot be reached and this process has never loaded it."""
    global _under, _slugs
    try:
        # A read only (never a write on the request path): a missing value is a value too.
        current = await run_on_cache(cache.get, VERSION_KEY, "")
        if not isinstance(current, str):
            misfit("the persona version value", current)
            current = ""
    except Exception as exc:  # the shared cache is down: memory cannot be trusted, the database can
        report(logger, "could not read the persona version value; reading the database", exc)
        current = None
    if current is None or current != _under:
        _entries.clear()
        _slugs = None
        _under = current
    entry = _entries.get(slug)
    now = time.monotonic()
    if entry is not None and now - entry.loaded_at <= MAX_AGE_S:
        return entry
    if outage.waiting:  # it failed a moment ago: not asked again before its backoff ends
        return _last_known(slug)
    try:
        slugs = await _active_slugs(now, current)
    except UNREACHABLE as exc:
        outage.failed(exc)
        return _last_known(slug)
    if slug not in slugs:
        _entries.pop(slug, None)
        _known.pop(slug, None)
        return None
    # One load per slug at a time: a burst of requests for a persona not in memory (a process
    # that just started) waits for one query instead of sending one each.
    loading = _loading.get(slug)
    if loading is None:
        loading = asyncio.ensure_future(sync_to_async(_load, thread_sensitive=False)(slug, now))
        _loading[slug] = loading
        loading.add_done_callback(lambda done: _loaded(slug, done))
    try:
        entry = await asyncio.shield(loading)
    except UNREACHABLE as exc:
        outage.failed(exc)
        return _last_known(slug)
    outage.recovered()
    if entry is None:
        _entries.pop(slug, None)
        _known.pop(slug, None)
        return None
    _known[slug] = entry
    if current is not None and _under == current:  # nothing changed while it loaded
        _entries[slug] = entry
    return entry


async def _active_slugs(now: float, current: str | None) -> frozenset[str]:
    """The active personas' slugs, loaded in one query when not loaded under `current` or older
    than MAX_AGE_S (one load at a time, whoever asks)."""
    global _slugs, _slugs_loading
    if _slugs is not None and now - _slugs[1] <= MAX_AGE_S:
        return _slugs[0]
    if _slugs_loading is None or _slugs_loading[1].done() or _slugs_loading[0] != current:
        loading = asyncio.ensure_future(sync_to_async(_load_slugs, thread_sensitive=False)())
        # A failure is seen (not logged as never retrieved) when every waiter has left.
        loading.add_done_callback(lambda done: done.cancelled() or done.exception())
        _slugs_loading = (current, loading)
    slugs = await asyncio.shield(_slugs_loading[1])
    if current is not None and _under == current:  # nothing changed while it loaded
        _slugs = (slugs, now)
    return slugs


def _load_slugs() -> frozenset[str]:
    try:
        return frozenset(Persona.objects.active().values_list("slug", flat=True))
    finally:
        close_old_connections()


def _last_known(slug: str) -> ActivePersona:
    """During an outage: the persona as this process last loaded it, or the 503."""
    known = _known.get(slug)
    if known is None:
        raise outage.error()
    return known


def _loaded(slug: str, done: asyncio.Future[ActivePersona | None]) -> None:
    _loading.pop(slug, None)
    if not done.cancelled():
        # Marks a failure as seen: when every waiter was cancelled (their clients left), asyncio
        # would otherwise log it at ERROR as never retrieved; the waiters that remain handle it.
        done.exception()


def peek(slug: str) -> ActivePersona | None:
    """The persona as this process last loaded it, with no I/O at all (or None): for counting a
    refusal against it when the process is too busy for anything else."""
    return _entries.get(slug)


def bump(*, signal: object = None, instance: object = None, **_: Any) -> None:
    """Persona data changed: forget it here, and tell every process through the shared cache.
    A persona this process deleted or deactivated is forgotten for outages too."""
    global _under, _slugs
    if isinstance(instance, Persona) and (signal is post_delete or not instance.is_active):
        for slug, known in list(_known.items()):
            if known.persona.pk == instance.pk or slug == instance.slug:
                del _known[slug]
    _entries.clear()
    _slugs = None
    _under = None
    cache.set(VERSION_KEY, uuid.uuid4().hex, timeout=None)


def _load(slug: str, now: float) -> ActivePersona | None:
    """Both queries in one hop, on a shared worker thread (not the request's own: no thread is
    made for the request), whose connection is then closed as at the end of a request."""
    try:
        persona = Persona.objects.active().filter(slug=slug).first()
        if persona is None:
            return None
        version = persona.versions.order_by("-number").first()
        return ActivePersona(persona=persona, version=version, loaded_at=now)
    finally:
        close_old_connections()


for _model in (Persona, PersonaVersion):
    post_save.connect(bump, sender=_model, dispatch_uid=f"quotes.personas.bump.save.{_model.__name__}")
    post_delete.connect(bump, sender=_model, dispatch_uid=f"quotes.personas.bump.delete.{_model.__name__}")
personas_changed.connect(bump, dispatch_uid="quotes.personas.bump.changed")
# Migrations (data migrations seed personas) and `flush` change rows without saving models.
post_migrate.connect(bump, dispatch_uid="quotes.personas.bump.migrate")
