"""Complete answers, kept in Django's cache and replayed as the same stream; and the cache's
serializer on Redis (JSONSerializer), for every value the app keeps there."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import asdict, dataclass

from django.core.cache import cache

from .. import metrics
from .events import GenerationRequest, header_safe, plain_text
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
    match value:
        case {
            "model": str() as model,
            "tokens": list() as tokens,
            "prompt_tokens": int() | None as prompt_tokens,
            "completion_tokens": int() | None as completion_tokens,
            "step": int() as step,
            **rest,
        } if not rest and all(map(plain_text, tokens)) and header_safe(model):
            return CachedAnswer(model, tuple(tokens), prompt_tokens, completion_tokens, step)
    misfit("an answer", value)
    return None


async def store_answer(key: str, answer: CachedAnswer, *, ttl: int) -> None:
    await run_on_cache(cache.set, key, {**asdict(answer), "tokens": list(answer.tokens)}, timeout=ttl)
