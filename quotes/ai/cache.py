"""Complete answers, kept in Django's cache and replayed as the same stream; and the cache's
serializer on Redis (JSONSerializer), for every value the app keeps there."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import asdict

from django.core.cache import cache

from .. import metrics
from .events import Done, Event, GenerationRequest, Meta, decode_events, encode_events
from .limits import run_on_cache
from .redis_health import report

logger = logging.getLogger(__name__)


class JSONSerializer:
    """Django's RedisCache serializer (CACHES' OPTIONS["serializer"]): JSON, where Django's own
    pickles, so that whoever can write to Redis can alter what the app serves but cannot run
    code in it. Integers stay Redis integers (INCR). A value that is not JSON reads as None, a
    miss; each reader checks the shape of what it gets (`misfit` for one that does not fit)."""

    def dumps(self, value: object) -> bytes | int:
        if type(value) is int:
            return value
        return json.dumps(value, separators=(",", ":")).encode()

    def loads(self, data: bytes) -> object:
        with contextlib.suppress(ValueError):
            return int(data)
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            logger.warning("a value in the cache is not JSON: read as a miss")
            return None


def misfit(what: str, value: object) -> None:
    """A value read from the cache that is not of the shape the app writes: a miss, said once."""
    if value is not None:
        logger.warning("%s in the cache has an unexpected shape: read as a miss", what)


def answer_key(*, backend: str, request: GenerationRequest, version_id: int | None) -> str:
    """A hash of the backend, the model, the full request and the persona version."""
    material = json.dumps(
        {"backend": backend, "request": asdict(request), "version": version_id},
        sort_keys=True,
        separators=(",", ":"),
    )
    return "quotes:answer:" + hashlib.sha256(material.encode()).hexdigest()


async def get_answer(key: str) -> list[Event] | None:
    """The cached answer for `key`: a complete generation's events, kept as a finished run's
    are (events.encode_events), ending with Done. None for a miss (any other value, such as one
    a release before this one wrote, is one too), or a cache that is down: a fresh answer."""
    try:
        stored = await run_on_cache(cache.get, key)
    except Exception as exc:
        report(logger, "could not read the answer cache", exc)
        return None
    answer = None
    with contextlib.suppress(ValueError):
        answer = decode_events(stored)
    if not answer or type(answer[-1]) is not Done:
        misfit("an answer", stored)
        answer = None
    metrics.cache_lookup(hit=answer is not None)
    return answer


async def store_answer(key: str, answer: list[Event], *, ttl: int) -> None:
    """Keep a complete answer (what its flight published, then Done). Its upstream headers
    (cf-aig-log-id, ...) name that call, not a replay: left out."""
    events = [Meta(model=event.model, step=event.step) if type(event) is Meta else event for event in answer]
    try:
        await run_on_cache(cache.set, key, encode_events([*events, Done()]), timeout=ttl)
    except Exception as exc:  # a cache that is down costs a future hit, never this answer
        report(logger, "could not cache an answer", exc)
