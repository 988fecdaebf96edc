"""The active personas in each process's memory, and the database's outages as it sees them.

The personas are checked against one value in the shared cache that any change replaces (`bump`),
and read again after MAX_AGE_S anyway; the active slugs are loaded together, so a made-up slug
costs no query. During an outage a persona loaded before is served as it was, the database is
asked again RETRY_S after its last failure, and anything else is a 503 with Retry-After.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError, close_old_connections
from django.db.models.signals import post_delete, post_migrate, post_save

from . import cache
from .backends.base import GENERATION_FIELDS
from .errors import ErrorCode, QuoteError
from .models import Experiment, Persona, PersonaVersion, personas_changed

logger = logging.getLogger(__name__)

UNREACHABLE: tuple[type[Exception], ...] = (OperationalError, InterfaceError)
VERSION_KEY = "quotes:personas:version"
MAX_AGE_S = 30.0
RETRY_S = 2.0


@dataclass(frozen=True, slots=True)
class ActivePersona:
    persona: Persona
    #: its live version
    version: PersonaVersion | None
    loaded_at: float
    #: its running experiment, and the persona as its draft version has it (never saved)
    experiment: Experiment | None = None
    draft: Persona | None = None


class Outage:
    """Whether the database is in an outage (one WARNING as it begins, one INFO as it ends)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.last = -math.inf

    def failed(self, error: BaseException) -> None:
        self.last = time.monotonic()
        if self.since is None:
            self.since = self.last
            detail = (str(error).strip().splitlines() or [""])[0][:200]
            logger.warning(
                "the database cannot be reached (%s: %s); serving personas from memory",
                type(error).__name__,
                detail,
            )

    def recovered(self) -> None:
        if self.since is not None:
            logger.info("the database answers again, after %.1f s", time.monotonic() - self.since)
        self.since, self.last = None, -math.inf

    @property
    def waiting(self) -> bool:
        return time.monotonic() < self.last + RETRY_S

    def error(self) -> QuoteError:
        retry_after = max(1, math.ceil(self.last + RETRY_S - time.monotonic()))
        message = (
            "The site cannot load this right now. This is not your fault; please try again in a few seconds."
        )
        return QuoteError(ErrorCode.SERVICE_UNAVAILABLE, message, 503, retry_after=retry_after)


class Memory:
    """What this process holds of the personas (one object: the signals reach it from any thread)."""

    def __init__(self) -> None:
        self.outage = Outage()
        self.entries: dict[str, ActivePersona] = {}  # fresh under `under`
        self.known: dict[str, ActivePersona] = {}  # as last loaded, whatever happened since: an outage's
        self.slugs: tuple[frozenset[str], float] | None = None
        self.under: object = None


memory = Memory()


async def get_active(slug: str) -> ActivePersona | None:
    """The active persona called `slug` with its current version, or None; raises the 503 while
    the database is down and this process never loaded it."""
    current = await cache.call(cache.store().get, VERSION_KEY, "")
    if current is None or current != memory.under:  # a change, or no shared cache to tell: reload
        memory.entries.clear()
        memory.slugs, memory.under = None, current
    now = time.monotonic()
    entry = memory.entries.get(slug)
    if entry is not None and now - entry.loaded_at <= MAX_AGE_S:
        return entry
    if memory.outage.waiting:
        return _last_known(slug)
    try:
        if memory.slugs is None or now - memory.slugs[1] > MAX_AGE_S:
            memory.slugs = (await sync_to_async(_load_slugs, thread_sensitive=False)(), now)
        entry = (
            await sync_to_async(_load, thread_sensitive=False)(slug, now) if slug in memory.slugs[0] else None
        )
    except UNREACHABLE as exc:
        memory.outage.failed(exc)
        return _last_known(slug)
    memory.outage.recovered()
    if entry is None:
        memory.entries.pop(slug, None)
        memory.known.pop(slug, None)
        return None
    memory.entries[slug] = memory.known[slug] = entry
    return entry


def peek(slug: object) -> ActivePersona | None:
    """The persona as this process last loaded it, with no I/O (to count a refusal against)."""
    return memory.known.get(slug) if isinstance(slug, str) else None


def _last_known(slug: str) -> ActivePersona:
    known = memory.known.get(slug)
    if known is None:
        raise memory.outage.error()
    return known


def _load_slugs() -> frozenset[str]:
    try:
        return frozenset(Persona.objects.active().values_list("slug", flat=True))
    finally:
        close_old_connections()


def _load(slug: str, now: float) -> ActivePersona | None:
    try:
        persona = Persona.objects.active().filter(slug=slug).first()
        if persona is None:
            return None
        version = persona.versions.filter(is_draft=False).order_by("-number").first()
        experiment = persona.experiments.filter(ended_at__isnull=True).select_related("draft").first()
        draft = as_of(persona, experiment.draft) if experiment else None
        return ActivePersona(persona, version, now, experiment, draft)
    finally:
        close_old_connections()


def as_of(persona: Persona, version: PersonaVersion) -> Persona:
    """A copy of `persona` with `version`'s settings, to build requests from (never saved)."""
    draft = copy.copy(persona)
    for name in GENERATION_FIELDS:
        if name in version.config:
            setattr(draft, name, version.config[name])
    return draft


def bump(*, signal: object = None, instance: object = None, **_: Any) -> None:
    """Persona data changed: forget it here, and tell every process through the shared cache."""
    if isinstance(instance, Persona) and (signal is post_delete or not instance.is_active):
        for slug, known in list(memory.known.items()):
            if known.persona.pk == instance.pk:
                del memory.known[slug]
    memory.entries.clear()
    memory.slugs, memory.under = None, object()
    try:
        cache.store().set(VERSION_KEY, uuid.uuid4().hex, timeout=None)
    except Exception:  # Redis down: each process reads the database again within MAX_AGE_S
        logger.warning("could not tell the other processes that personas changed", exc_info=True)


for _model in (Persona, PersonaVersion, Experiment):
    post_save.connect(bump, sender=_model, dispatch_uid=f"quotes.personas.save.{_model.__name__}")
    post_delete.connect(bump, sender=_model, dispatch_uid=f"quotes.personas.delete.{_model.__name__}")
personas_changed.connect(bump, dispatch_uid="quotes.personas.changed")
post_migrate.connect(bump, dispatch_uid="quotes.personas.migrate")
