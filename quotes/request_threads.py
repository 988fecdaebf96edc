"""Django's per-request thread, leased from a pool and given back once a stream's view has answered
(docs/architecture.md). Django's handler keeps a request's thread until the last byte of its
response, for a stream minutes; here each request runs in a `ThreadSensitiveContext(executor=...)`
of its own (asgiref's documented API), whose later sync calls go to the shared `tail` thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import ThreadSensitiveContext
from django.conf import settings
from django.core.signals import request_started
from django.db import close_old_connections, reset_queries

#: Past this many request threads a request waits for one: overload queues requests, not threads.
MAX_THREADS = 32

#: The request threads; each starts at its executor's first call (a request may make none).
_idle = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="request") for _ in range(MAX_THREADS)]
_waiting: collections.deque[asyncio.Future[ThreadPoolExecutor]] = collections.deque()
#: Where a request's sync calls go once its thread is given back (microseconds each).
tail = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-tail")


async def _lease_thread() -> ThreadPoolExecutor:
    if _idle:
        return _idle.pop()
    waiter: asyncio.Future[ThreadPoolExecutor] = asyncio.get_running_loop().create_future()
    _waiting.append(waiter)
    try:
        return await waiter
    except asyncio.CancelledError:
        if waiter.done() and not waiter.cancelled():
            _hand_on(waiter.result())  # handed over as this request was cancelled
        raise


def _hand_on(executor: ThreadPoolExecutor) -> None:
    while _waiting:
        waiter = _waiting.popleft()
        if not waiter.done():
            waiter.set_result(executor)
            return
    _idle.append(executor)


T = TypeVar("T")


class Lease(Executor):
    """One request's executor: its leased thread, then, once that is given back, `tail`."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor: ThreadPoolExecutor | None = executor

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return (self.executor or tail).submit(fn, *args, **kwargs)

    def give_back(self, *, finished: bool = False) -> None:
        """`finished`: the request's last call there was Django's `response.close()`, whose
        request_finished closed the obsolete connections already. Otherwise that runs on the
        thread now, after what the request left queued there, as on a thread of its own."""
        executor, self.executor = self.executor, None
        if executor is None:
            return
        if settings.DEBUG:
            executor.submit(reset_queries)
        if not finished:
            executor.submit(close_old_connections)
        _hand_on(executor)


_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("request_thread_lease", default=None)


def release_request_thread() -> None:
    """Give the current request's thread back now (its view has answered)."""
    lease = _lease.get()
    if lease is not None:
        lease.give_back()


async def read_body(receive: Any) -> tuple[list[dict[str, Any]], bytes]:
    """The request's messages up to its body's last (or a disconnect), and the body. Past
    DATA_UPLOAD_MAX_MEMORY_SIZE (a body Django refuses anyway) the rest is left unread."""
    read: list[dict[str, Any]] = []
    body = b""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    while True:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return read, body  # a disconnect
        body += message.get("body", b"")
        if not message.get("more_body", False) or (limit is not None and len(body) > limit):
            return read, body


def replay(read: list[dict[str, Any]], receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """`receive`, with the messages already read given first."""
    pending = iter(read)

    async def replayed() -> dict[str, Any]:
        return next(pending, None) or await receive()

    return replayed


class RequestThreads:
    """An HTTP ASGI application: `app` (Django's) with each request's thread leased."""

    def __init__(self, app: Any) -> None:
        self.app = app
        # A request starts with no thread hop: Django's receivers of request_started are the
        # connection hygiene a leased thread had when it was given back (Lease.give_back, or
        # request_finished), so they are not run again (as Django's test client does).
        request_started.disconnect(close_old_connections)
        request_started.disconnect(reset_queries)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # The body first: a client that never finishes its body (under a server that streams
        # bodies) must hold no thread.
        read, _ = await read_body(receive)
        if read[-1]["type"] != "http.request":
            return  # the client left during its body: Django's handler would do nothing either
        lease = Lease(await _lease_thread())
        token = _lease.set(lease)
        finished = False
        try:
            async with ThreadSensitiveContext(executor=lease):
                await self.app(scope, replay(read, receive), send)
            finished = True  # Django's handler ended it with response.close() on that thread
        finally:
            lease.give_back(finished=finished)  # a stream's was given back already: no-op
            _lease.reset(token)
