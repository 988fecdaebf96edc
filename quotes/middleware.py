"""Middleware that keeps the stream path on the event loop and off Django's per-request thread.

- `ReleaseRequestThreadMiddleware`: a streaming response does not keep the request's thread
  (quotes.request_threads).
- `StreamAdmissionMiddleware`: at the process's open-stream cap, the stream URLs' 503 answered
  before the session, CSRF, auth and message middleware run.
- `StaticFilesMiddleware`: WhiteNoise, given an async entry point.
- `DatabaseOutageMiddleware`: a database outage escaping a view is a 503 in the request's
  dialect, not a 500 with its traceback.
- Django's own middleware with their methods run inline instead of in a thread each.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import SyncToAsync, markcoroutinefunction, sync_to_async
from csp import middleware as csp_middleware
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.messages.storage import default_storage
from django.contrib.sessions import middleware as sessions
from django.db import connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware import clickjacking, common, csrf, security
from django.urls import reverse
from django.utils.functional import SimpleLazyObject, empty
from whitenoise.middleware import WhiteNoiseMiddleware

from .database import UNREACHABLE, outage
from .request_threads import release_request_thread


class ReleaseRequestThreadMiddleware:
    """Once a view has returned a streaming response, give the request's thread back.

    A stream's view answers within milliseconds and its body then flows for minutes, all on the
    event loop: the request's thread (quotes.request_threads) goes back to the pool here, so an
    open stream holds none. Under another handler (Django's own, as in its test client) the
    thread asgiref started for the request is let go instead.
    """

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)
        if response.streaming and not release_request_thread():
            _let_go_of_asgirefs_thread()
        return response


def _let_go_of_asgirefs_thread() -> None:
    context = SyncToAsync.thread_sensitive_context.get(None)
    if context is None:
        return
    executor = SyncToAsync.context_to_thread_executor.pop(context, None)
    if executor is None:
        return  # no thread-sensitive call yet: no thread to let go
    # Its database connections would never be used again (they belong to that thread).
    executor.submit(connections.close_all)
    executor.shutdown(wait=False)


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


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise, given an async entry point.

    WhiteNoise's middleware is sync-only, and one sync middleware makes Django hop to a thread
    on every request, the SSE stream included. This subclass keeps WhiteNoise's file finding,
    compression negotiation and caching headers, but only requests under STATIC_URL touch a
    thread; everything else passes straight through on the event loop.
    """

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        super().__init__(get_response)
        markcoroutinefunction(self)

    def add_files(self, root: str, prefix: str | None = None) -> None:
        # Before collectstatic has run (development, tests) the finders serve the files, so a
        # missing STATIC_ROOT is expected; without finders WhiteNoise's warning stays.
        if self.use_finders and not os.path.isdir(root):
            return
        super().add_files(root, prefix)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if request.path_info.startswith(self.static_prefix):
            response = await sync_to_async(self._serve_static, thread_sensitive=False)(request)
            if response is not None:
                return response
        return await self.get_response(request)

    def _serve_static(self, request: HttpRequest) -> HttpResponse | None:
        path = request.path_info
        static_file: Any = self.find_file(path) if self.autorefresh else self.files.get(path)
        if static_file is None:
            return None
        found = static_file.get_response(request.method, request.META)
        # Static files are small: read them here, in the thread, so the event loop never does file I/O.
        body = b""
        if found.file is not None:
            with found.file:
                body = found.file.read()
        response = HttpResponse(body, status=int(found.status))
        del response["Content-Type"]
        for key, value in found.headers:
            response[key] = value
        return response


# --- Django's own middleware, run on the event loop ----------------------------------------------
#
# Django's MiddlewareMixin runs process_request and process_response in a thread each
# (sync_to_async) under ASGI: with seven middleware that is over a dozen thread hops per request,
# most of the time the stream endpoint adds to the first token. These middleware do no I/O (the
# session only when it must save, and that keeps its hop), so their methods run inline here.


class InlineMiddlewareMixin:
    """Swap Django's thread-hopping `__acall__` for one that calls the methods directly."""

    get_response: Any

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = await self.aprocess_response(request, response)
        return response

    async def aprocess_response(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        return self.process_response(request, response)  # type: ignore[attr-defined]


class SecurityMiddleware(InlineMiddlewareMixin, security.SecurityMiddleware):
    pass


class SessionMiddleware(InlineMiddlewareMixin, sessions.SessionMiddleware):
    async def aprocess_response(self, request: HttpRequest, response: Any) -> HttpResponseBase:
        session = getattr(request, "session", None)
        if session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST):
            # Saving writes to the session store: that I/O belongs in a thread.
            return await sync_to_async(self.process_response)(request, response)
        return self.process_response(request, response)


class CommonMiddleware(InlineMiddlewareMixin, common.CommonMiddleware):
    pass


class CsrfViewMiddleware(InlineMiddlewareMixin, csrf.CsrfViewMiddleware):
    async def process_view(self, request: HttpRequest, *args: Any) -> HttpResponseBase | None:  # type: ignore[override]
        # A coroutine, so Django calls it on the loop instead of adapting it into a thread.
        return super().process_view(request, *args)


class AuthenticationMiddleware(InlineMiddlewareMixin, auth.AuthenticationMiddleware):
    pass


class MessageMiddleware(InlineMiddlewareMixin, messages.MessageMiddleware):
    """The message storage made when something first uses it: the stream API, the feedback API
    and most pages never do, and making it (a cookie and a session storage) and storing it
    again on the way out was a measurable part of every request."""

    def process_request(self, request: HttpRequest) -> None:
        request._messages = SimpleLazyObject(lambda: default_storage(request))  # type: ignore[attr-defined]

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        stored = getattr(request, "_messages", None)
        if isinstance(stored, SimpleLazyObject) and stored._wrapped is empty:  # type: ignore[attr-defined]
            return response  # never used: nothing to store
        return super().process_response(request, response)


class XFrameOptionsMiddleware(InlineMiddlewareMixin, clickjacking.XFrameOptionsMiddleware):
    pass


class CSPMiddleware(InlineMiddlewareMixin, csp_middleware.CSPMiddleware):
    """django-csp's middleware (a MiddlewareMixin) without its thread hops: it only sets headers.

    A response marked exempt from both policies (quotes.views.not_a_document: the streams, which
    no browser renders as a page) is passed through: django-csp 4.0 builds both policies before
    it looks at the marks, and that was the costliest step of a stream's middleware."""

    def process_response(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        if getattr(response, "_csp_exempt", False) and getattr(response, "_csp_exempt_ro", False):
            return response
        return super().process_response(request, response)
