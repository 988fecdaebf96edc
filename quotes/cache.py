"""The shared cache (Django's: in memory, or Redis): complete answers replayed as streams, and
the safe way to call it.

`call` runs a cache operation off the loop; after a failure the cache is left alone for RETRY_S
(so a hung Redis costs one socket timeout, not one per request). Values are JSON, never pickle:
whoever can write to Redis must not be able to run code here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import BaseCache, caches
from django.core.cache.backends.locmem import LocMemCache
from redis.exceptions import RedisError
from streaming import Done, Event, Meta, from_json, to_json

from .backends.base import GenerationRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_S = 2.0


class Shared:
    """The process's cache objects, and whether the cache failed lately (left alone until
    `down_until`)."""

    def __init__(self) -> None:
        self.stores: dict[str, BaseCache] = {}
        self.down_until = 0.0
        self.failing = False


shared = Shared()


def store(alias: str = "default") -> BaseCache:
    """The process's one cache object for `alias`. (Django makes one per request context under
    ASGI, and a RedisCache one opens a connection pool of its own that nothing closes.)"""
    key = f"{alias}:{json.dumps(settings.CACHES[alias], sort_keys=True, default=str)}"
    if key not in shared.stores:
        shared.stores[key] = caches.create_connection(alias)
    return shared.stores[key]


async def call(operation: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """`operation(*args, **kwargs)` on a worker thread; None when the cache fails or is resting."""
    if time.monotonic() < shared.down_until:
        return None
    try:
        if isinstance(getattr(operation, "__self__", None), LocMemCache):
            result = operation(*args, **kwargs)  # this process's memory: microseconds, no thread
        else:
            result = await sync_to_async(operation, thread_sensitive=False)(*args, **kwargs)
    except (RedisError, OSError) as exc:
        if not shared.failing:
            logger.warning("the cache is unavailable (%s); serving without it", type(exc).__name__)
        shared.failing, shared.down_until = True, time.monotonic() + RETRY_S
        return None
    if shared.failing:
        shared.failing = False
        logger.info("the cache answers again")
    return result


class JSONSerializer:
    """RedisCache's serializer: JSON, integers as they are (INCR); a value not JSON is a miss."""

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


def answer_key(*, backend: str, request: GenerationRequest, version_id: int | None) -> str:
    """A hash of the backend, the whole request and the persona's version."""
    material = json.dumps(
        {"backend": backend, "request": asdict(request), "version": version_id},
        sort_keys=True,
        separators=(",", ":"),
    )
    return "quotes:answer:" + hashlib.sha256(material.encode()).hexdigest()


async def get_answer(key: str) -> list[Event] | None:
    """The complete answer kept under `key` (ending with Done), or None."""
    stored = await call(store().get, key)
    try:
        answer = from_json(stored) if stored is not None else None
    except ValueError:
        logger.warning("an answer in the cache has an unexpected shape: read as a miss")
        return None
    return answer if answer and type(answer[-1]) is Done else None


async def store_answer(key: str, events: list[Event], *, ttl: int) -> None:
    """Keep a complete answer, without the generation's id, cache status and upstream headers
    (they name that call, not a replay)."""
    kept = [
        Meta(model=e.model, step=e.step) if type(e) is Meta else e
        for e in events
        if not (type(e) is Meta and e.id is not None)  # the generation's own opening
    ]
    await call(store().set, key, to_json([*kept, Done()]), timeout=ttl)
