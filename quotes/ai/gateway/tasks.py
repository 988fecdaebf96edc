"""Tasks that outlive the request that starts them (a flight, a run's end, the Redis sender)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import ThreadSensitiveContext

T = TypeVar("T")

#: The thread of detached tasks' thread-sensitive calls.
detached_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detached")


def detached_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task in a thread-sensitive context of its own, not the request's, which refuses calls
    once the request is over and must not wait on this task."""

    async def detached() -> T:
        async with ThreadSensitiveContext(executor=detached_thread):
            return await coro

    task = asyncio.create_task(detached())
    task.add_done_callback(lambda _: coro.close())  # cancelled before it started: never awaited
    return task
