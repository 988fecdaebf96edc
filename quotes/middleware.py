"""Middleware that keeps the stream path on the event loop and off Django's per-request thread.

- `ReleaseRequestThreadMiddleware`: a streaming response does not keep the request's thread
  (quotes.request_threads).
- `StreamAdmissionMiddleware`: at the process's open-stream cap, the stream URLs' 503 answered
  before the session, CSRF, auth and message middleware run.
- `DatabaseOutageMiddleware`: a database outage escaping a view is a 503 in the request's
  dialect, not a 500 with its traceback.

Django's own middleware run their methods on the event loop too, and WhiteNoise has an async
entry point: both touch their library's internals, so they live in quotes.forks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.urls import reverse

from .database import UNREACHABLE, outage
from .request_threads import release_request_thread


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


class StreamAdmissionMiddleware:
    """At the process's open-stream cap (or while it drains), a new stream (`/api/quotes/stream`,
    and the persona page's form, `/quotes/stream`) is refused here (by
    quotes.views.refuse_stream_when_full), early in the chain: Django's handler and the
    middleware before this one have run, the session, CSRF, auth, message, clickjacking and CSP
    middleware have not. Under an overload most requests are refusals (800 of 1,000 in
    bench/scaleout_load.py), and what each costs is taken from the streams the process holds.
    Anything this cannot answer (not at the cap, a request with a session, a bad request) goes
    on through the whole chain to the view, which refuses it there if it must."""

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        self._paths: dict[str, bool] | None = None
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if self._paths is None:  # not in __init__: the URLconf may not load yet
            self._paths = {reverse("quotes:stream"): False, reverse("quotes:stream-form"): True}
        form = self._paths.get(request.path_info)
        if form is not None:
            from .views import refuse_stream_when_full  # the views import this module's neighbours

            response = await refuse_stream_when_full(request, form=form)
            if response is not None:
                return response
        return await self.get_response(request)


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
