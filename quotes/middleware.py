"""Middleware that keeps the stream path on the event loop and off Django's per-request thread.

- `ReleaseRequestThreadMiddleware`: a streaming response does not keep the request's thread
  (quotes.request_threads).
- `StreamAdmissionGate` (ASGI, in front of Django's handler): the stream URLs' admission decided
  once, and at the process's open-stream limit their 503 answered before Django's handler and
  its middleware run.
- `DatabaseOutageMiddleware`: a database outage escaping a view is a 503 in the request's
  dialect, not a 500 with its traceback.

Django's own middleware run their methods on the event loop too, and WhiteNoise has an async
entry point: both touch their library's internals, so they live in quotes.forks (as does the
gate's request, made before Django's handler).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, cast

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware.security import SecurityMiddleware
from django.urls import reverse

from .database import UNREACHABLE, outage
from .forks import asgi_request
from .request_threads import read_body, release_request_thread, replay


class ReleaseRequestThreadMiddleware:
    """Once a view has returned a streaming response, give the request's thread back.

    A stream's view answers within milliseconds and its body then flows for minutes, all on the
    event loop: the request's thread (quotes.request_threads) goes back to the pool here, so an
    open stream holds none. (The stream views give it back earlier still, before they wait for
    the first token; this catches any other streaming response.)
    """

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)
        if response.streaming:
            release_request_thread()
        return response


class NotRefused(Exception):
    """Raised through StreamAdmissionGate's short chain when the request is not refused there."""


class StreamAdmissionGate:
    """ASGI, in front of Django's handler: whether this process takes one more stream on the
    stream URLs (`/api/quotes/stream`, and the persona page's form, `/quotes/stream`) is decided
    here, once (admission.enter), and the answer goes on in the request's scope
    (admission.DECIDED): the Entry that admission later opens, or the Error that refuses it. A
    refused new stream is answered here (by quotes.views.refuse_stream_when_full, behind the same
    RequestIdMiddleware and SecurityMiddleware as in settings.MIDDLEWARE), with no thread, no
    signal and no other middleware.

    Under an overload most requests are refusals (800 of 1,000 in bench/scaleout_load.py, each
    tried on both processes by nginx), and what each costs is taken from the event loop of the
    streams the process holds. Through Django's handler a refusal cost about twice what it does
    here (docs/benchmarks.md, issue 22): the handler's three thread hops (its `request_started`
    receivers, the log line of every response >= 400, `response.close()`), a request thread
    leased for them, and the middleware chain. Anything this does not answer (let in, a request
    with a session, a resume, a bad request, a host not allowed) goes on to Django with its body
    as it came, and the view answers it (with the decision made here)."""

    def __init__(self, app: Callable[[dict[str, Any], Any, Any], Awaitable[None]]) -> None:
        self.app = app
        self._chains: dict[str, Callable[[HttpRequest], Awaitable[HttpResponseBase]]] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from .ai.gateway import admission  # the gateway imports Django's models: not before setup

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._chains is None:  # not in __init__: the URLconf may not load yet
            self._chains = {
                reverse("quotes:stream"): _refusal_chain(form=False),
                reverse("quotes:stream-form"): _refusal_chain(form=True),
            }
        chain = self._chains.get(scope["path"])
        if chain is None:
            return await self.app(scope, receive, send)
        # Decided once, here: the view and the admission take this answer as it is.
        decided = admission.enter(settings.QUOTES_GATEWAY)
        scope = {**scope, admission.DECIDED: decided}
        if isinstance(decided, admission.Entry):
            try:
                return await self.app(scope, receive, send)
            finally:
                decided.close()  # not admitted: its request ended first
        read, body = await read_body(receive)  # a disconnect: Django's handler sees it as it would have
        response: HttpResponseBase | None = None
        if read[-1]["type"] == "http.request" and not read[-1].get("more_body", False):
            # A host not allowed (get_host() raises for it): Django's handler answers its 400.
            with contextlib.suppress(NotRefused, SuspiciousOperation):
                response = await chain(asgi_request(scope, body))
        if response is None:
            return await self.app(scope, replay(read, receive), send)
        assert isinstance(response, HttpResponse)  # the refusals are whole responses, not streams
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": response.content})
        return None


def _refusal_chain(*, form: bool) -> Callable[[HttpRequest], Awaitable[HttpResponseBase]]:
    """refuse_stream_when_full behind the middleware that come before the session's in
    settings.MIDDLEWARE (but the thread release: no thread here)."""
    from .logging import RequestIdMiddleware
    from .views import refuse_stream_when_full

    async def refuse(request: HttpRequest) -> HttpResponseBase:
        response = await refuse_stream_when_full(request, form=form)
        if response is None:
            raise NotRefused
        return response

    security_headers = cast(Callable[[HttpRequest], Awaitable[HttpResponseBase]], SecurityMiddleware(refuse))
    return RequestIdMiddleware(security_headers)


class DatabaseOutageMiddleware:
    """A view that meets the database down (a connection refused or dropped, quotes.database)
    answers a 503 `service_unavailable` with Retry-After, in its request's dialect
    (quotes.views.unavailable_response: the htmx error event, the JSON error, a readable page),
    instead of Django's "Server Error (500)" and a traceback at ERROR per request: the outage is
    logged once, by quotes.database. Django's documented exception hook: it sees what a view
    raises (no middleware here queries the database on its own)."""

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return await self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponseBase | None:
        if not isinstance(exception, UNREACHABLE):
            return None
        outage.failed(exception)
        from .views import unavailable_response  # the views import this module's neighbours

        return unavailable_response(request, outage.error())
