"""Middleware that keeps the stream path on the event loop and off Django's per-request thread.

- `ReleaseRequestThreadMiddleware`: a streaming response does not keep the request's thread
  (quotes.request_threads).
- `StreamAdmissionGate` (ASGI, in front of Django's handler): at the process's open-stream limit,
  the stream URLs' 503 answered before Django's handler and its middleware run.
- `StaticFilesMiddleware`: WhiteNoise, given an async entry point.
- Django's own middleware with their methods run inline instead of in a thread each.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Awaitable, Callable
from typing import Any, cast

from asgiref.sync import SyncToAsync, markcoroutinefunction, sync_to_async
from csp import middleware as csp_middleware
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.messages.storage import default_storage
from django.contrib.sessions import middleware as sessions
from django.core.exceptions import SuspiciousOperation
from django.core.handlers.asgi import ASGIRequest
from django.db import connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware import clickjacking, common, csrf, security
from django.urls import reverse
from django.utils.functional import SimpleLazyObject, empty
from whitenoise.middleware import WhiteNoiseMiddleware

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


class NotRefused(Exception):
    """Raised through StreamAdmissionGate's short chain when the request is not refused there."""


class StreamAdmissionGate:
    """ASGI, in front of Django's handler: while this process is at its open-stream limit (or
    drains), a new stream on the stream URLs (`/api/quotes/stream`, and the persona page's form,
    `/quotes/stream`) is refused here (by quotes.views.refuse_stream_when_full, behind the same
    RequestIdMiddleware and SecurityMiddleware as in settings.MIDDLEWARE), with no thread, no
    signal and no other middleware.

    Under an overload most requests are refusals (800 of 1,000 in bench/scaleout_load.py, each
    tried on both processes by nginx), and what each costs is taken from the event loop of the
    streams the process holds. Through Django's handler a refusal cost about twice what it does
    here (docs/benchmarks.md, issue 22): the handler's three thread hops (its `request_started`
    receivers, the log line of every response >= 400, `response.close()`), a request thread
    leased for them, and the middleware chain. Anything this does not refuse (not at the limit,
    a request with a session, a resume, a bad request, a host not allowed) goes on to Django with
    its body as it came, and the view answers it (refusing it there if it must)."""

    def __init__(self, app: Callable[[dict[str, Any], Any, Any], Awaitable[None]]) -> None:
        self.app = app
        self._chains: dict[str, Callable[[HttpRequest], Awaitable[HttpResponseBase]]] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from .ai.gateway import admission  # the gateway imports Django's models: not before setup

        if scope["type"] != "http" or not admission.at_capacity(settings.QUOTES_GATEWAY):
            return await self.app(scope, receive, send)
        if self._chains is None:  # not in __init__: the URLconf may not load yet
            self._chains = {
                reverse("quotes:stream"): _refusal_chain(form=False),
                reverse("quotes:stream-form"): _refusal_chain(form=True),
            }
        chain = self._chains.get(scope["path"])
        if chain is None:
            return await self.app(scope, receive, send)
        read: list[dict[str, Any]] = []
        body = b""
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: Django's handler sees it as it would have
            body += message.get("body", b"")
            if not message.get("more_body", False) or len(body) > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
                break
        response = None
        if read[-1]["type"] == "http.request" and not read[-1].get("more_body", False):
            # A host not allowed (get_host() raises for it): Django's handler answers its 400.
            with contextlib.suppress(NotRefused, SuspiciousOperation):
                response = await chain(ASGIRequest(scope, io.BytesIO(body)))
        if response is None:
            await self.app(scope, _replay(read, receive), send)
            return None
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


def _replay(read: list[dict[str, Any]], receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """`receive`, with the messages already read given first."""
    pending = list(read)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        message: dict[str, Any] = await receive()
        return message

    return replayed


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
