"""Django's per-request thread, taken from a pool and given back as soon as a stream's view has
answered, so an open stream holds no OS thread and no request starts one.

Why a thread per open stream: Django's ASGI handler runs each request in an asgiref
`ThreadSensitiveContext`, and the request's first thread-sensitive `sync_to_async` call (Django's
own `request_started` signal always makes one: its receivers are sync) starts a thread for that
request, which asgiref keeps until the context ends, i.e. until the last byte of the response is
sent. For a stream that is minutes: threads = 1 + open streams, each with its stack (and a
database connection if the request queried anything). Starting that thread was also the largest
single cost on the way to the first token (about 1.7 ms of a loaded 2-core machine), and a second
thread was started at the end of every request only to join the first.

`RequestThreads` wraps Django's ASGI application with one change: each HTTP request runs in a
thread-sensitive context with an executor of its own (asgiref's documented
`ThreadSensitiveContext(executor=...)`; Django's handler enters a context too, and only the
outermost one counts), a `Lease` that runs each call on a single-thread executor leased from
`pool`, one that served earlier requests (at most MAX_THREADS of them: past that, a request waits
for one, so overload queues requests instead of piling up threads). The stream views (and
`ReleaseRequestThreadMiddleware`, quotes.middleware, for any other streaming response) give it
back once the view has answered; the lease then sends the rest of that request's
thread-sensitive calls (Django's `response.close()` at the very end) to one shared thread,
`tail`. Everything else about the request (middleware, URLs, views, signals) is Django's. Only
documented interfaces are used: asgiref's context and `concurrent.futures.Executor`.

Database connections stay per thread, as Django expects: a pooled thread closes its obsolete ones
(per CONN_MAX_AGE) when it is given back, as `request_finished` would have on a thread of its own.

The thread is leased once the request's body is in (`read_body`), not before: Django's handler
reads the body after its context is entered, so under a server that streams bodies (daphne buffers
them, others do not), MAX_THREADS clients that never finish theirs would hold every thread.

"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import ThreadSensitiveContext
from django.conf import settings
from django.db import close_old_connections, reset_queries

#: At most this many request threads: a request that finds them all leased waits for one to be
#: given back (under overload, requests queue instead of threads piling up).
MAX_THREADS = 32


class RequestThreadPool:
    def __init__(self, max_threads: int = MAX_THREADS) -> None:
        self._idle: list[ThreadPoolExecutor] = []
        self._waiting: collections.deque[asyncio.Future[ThreadPoolExecutor]] = collections.deque()
        self._max_threads = max_threads
        self.started = 0  # threads started since the process began

    async def lease(self) -> ThreadPoolExecutor:
        if self._idle:
            return self._idle.pop()
        if self.started < self._max_threads:
            self.started += 1
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix="request")
        waiter: asyncio.Future[ThreadPoolExecutor] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back(waiter.result())  # handed over as this request was cancelled
            raise

    def give_back(self, executor: ThreadPoolExecutor, *, finished: bool = False) -> None:
        """`finished`: the request's last call on the thread was Django's `response.close()`, so
        request_finished (close_old_connections) has just run there."""
        # On that thread, after whatever the request left queued there and before anything the
        # next request runs there: the connection hygiene of request_finished and request_started.
        if not finished:
            executor.submit(_connection_hygiene)
        elif settings.DEBUG:
            executor.submit(reset_queries)
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(executor)
                return
        self._idle.append(executor)


def _connection_hygiene() -> None:
    reset_queries()
    close_old_connections()


pool = RequestThreadPool()
#: Where a request's thread-sensitive calls go once its thread is given back (a stream's tail:
#: Django's `response.close()` and request_finished, microseconds each).
tail = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-tail")


P = ParamSpec("P")
T = TypeVar("T")


class Lease(Executor):
    """The executor of one request's thread-sensitive context: its calls run one at a time on
    the thread leased for it, then, once that is given back, on `tail`."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor: ThreadPoolExecutor | None = executor

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return (self.executor or tail).submit(fn, *args, **kwargs)

    def give_back(self, *, finished: bool = False) -> None:
        """Hand the thread on; this request's later thread-sensitive calls go to `tail`."""
        executor, self.executor = self.executor, None
        if executor is not None:
            pool.give_back(executor, finished=finished)


_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("request_thread_lease", default=None)


def release_request_thread() -> bool:
    """Give the current request's thread back now (its view has answered). False outside a
    request served through `RequestThreads`."""
    lease = _lease.get()
    if lease is None:
        return False
    lease.give_back()
    return True


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
    pending = list(read)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        message: dict[str, Any] = await receive()
        return message

    return replayed


class RequestThreads:
    """An ASGI application: `app` (Django's) with each HTTP request's thread leased."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)  # Django's own refusal
        read, _ = await read_body(receive)  # before the thread: a body that never ends holds none
        if read[-1]["type"] != "http.request":
            return  # the client left during its body: Django's handler would do nothing either
        receive = replay(read, receive)
        lease = Lease(await pool.lease())
        token = _lease.set(lease)
        finished = False
        try:
            async with ThreadSensitiveContext(executor=lease):
                await self.app(scope, receive, send)
            # Django's handler ends every request it served with response.close() (which sends
            # request_finished) on the request's thread: its connections are seen to already.
            finished = True
        finally:
            lease.give_back(finished=finished)  # a stream's was given back already: no-op
            _lease.reset(token)
