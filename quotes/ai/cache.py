"""Complete answers, kept in Django's cache and replayed as the same stream."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass

from django.core.cache import cache

from .. import metrics
from .events import GenerationRequest
from .limits import run_on_cache
from .redis_health import report

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    model: str
    tokens: tuple[str, ...]
    prompt_tokens: int | None
    completion_tokens: int | None
    step: int


def answer_key(*, backend: str, request: GenerationRequest, version_id: int | None) -> str:
    """A hash of the backend, the model, the full request and the persona version."""
    material = json.dumps(
        {"backend": backend, "request": asdict(request), "version": version_id},
        sort_keys=True,
        separators=(",", ":"),
    )
    return "quotes:answer:" + hashlib.sha256(material.encode()).hexdigest()


async def get_answer(key: str) -> CachedAnswer | None:
    """The cached answer for `key`, or None (a miss, or a cache that is down: a fresh answer)."""
    try:
        stored = await run_on_cache(cache.get, key)
    except Exception as exc:
        report(logger, "could not read the answer cache", exc)
        return None
    answer = _answer_of(stored)
    metrics.cache_lookup(hit=answer is not None)
    return answer


def _answer_of(value: object) -> CachedAnswer | None:
    if not isinstance(value, dict):
        return None
    try:
        return CachedAnswer(**{**value, "tokens": tuple(value["tokens"])})
    except TypeError:
        return None  # written by an older release: treat as a miss


async def store_answer(key: str, answer: CachedAnswer, *, ttl: int) -> None:
    await run_on_cache(cache.set, key, {**asdict(answer), "tokens": list(answer.tokens)}, timeout=ttl)
