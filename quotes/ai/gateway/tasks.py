"""Tasks that outlive the request that starts them (a flight, a run's end, the Redis sender)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

from asgiref.sync import SyncToAsync

_T = TypeVar("_T")


def detached_task(coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
    """A task that may outlive the request that starts it: not in that request's
    thread-sensitive context (sync_to_async work of a finished request must not wait on it)."""
    context = contextvars.copy_context()
    context.run(SyncToAsync.thread_sensitive_context.set, None)  # type: ignore[arg-type]
    return asyncio.create_task(coro, context=context)
