"""The app's own middleware, each keeping the stream path on the event loop (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any, cast

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware.security import SecurityMiddleware
from django.urls import reverse
from servestatic.middleware import ServeStaticMiddleware
from servestatic.responders import MissingFileError

from .database import UNREACHABLE, outage
from .forks import asgi_request
from .request_threads import read_body, release_request_thread, replay

GetResponse = Callable[[HttpRequest], Awaitable[HttpResponseBase]]


class AsyncMiddleware:
    sync_capable = False
    async_capable = True

    def __init__(self, get_response: GetResponse) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return await self.get_response(request)


class ReleaseRequestThreadMiddleware(AsyncMiddleware):
    """A streaming response's body flows for minutes: its request's thread goes back now."""

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)
        if response.streaming:
            release_request_thread()
        return response


class StaticFilesMiddleware(AsyncMiddleware):
    """ServeStatic's, asked only about STATIC_URL: in development it looks every request up in a
    thread, a hop the stream path must not pay. A missing file is Django's 404, as in production."""

    def __init__(self, get_response: GetResponse) -> None:
        super().__init__(get_response)
        self.serve_static = ServeStaticMiddleware(get_response)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if request.path.startswith(settings.STATIC_URL):
            with contextlib.suppress(MissingFileError):
                return await self.serve_static(request)
        return await self.get_response(request)


class DatabaseOutageMiddleware(AsyncMiddleware):
    """The database down: a 503 in the request's dialect, not a 500 and a traceback per request."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponseBase | None:
        if not isinstance(exception, UNREACHABLE):
            return None
        outage.failed(exception)
        from .views import unavailable_response  # the views import this module's neighbours

        return unavailable_response(request, outage.error())


class StreamAdmissionGate:
    """ASGI, in front of Django's handler: a stream URL's admission is decided here, once, and
    passed on in the scope. A refusal is answered here, behind two middleware alone and without
    Django's thread hops (an overload is mostly refusals); anything else goes on to Django."""

    def __init__(self, app: Callable[[dict[str, Any], Any, Any], Awaitable[None]]) -> None:
        from .logging import RequestIdMiddleware
        from .views import stream_quote, stream_quote_form

        self.app = app
        # A refusal's chain: the two middleware in front of the rest, then the view at the gate.
        self._chains = {
            reverse(name): RequestIdMiddleware(
                cast(GetResponse, SecurityMiddleware(functools.partial(view, gate=True)))
            )
            for name, view in (("quotes:stream", stream_quote), ("quotes:stream-form", stream_quote_form))
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from .ai.gateway import admission  # the gateway imports Django's models: not before setup
        from .views import NotRefused

        chain = self._chains.get(scope["path"])
        if chain is None:
            return await self.app(scope, receive, send)
        decided = admission.enter(settings.QUOTES_GATEWAY)
        scope = {**scope, admission.DECIDED: decided}
        if isinstance(decided, admission.Entry):
            try:
                return await self.app(scope, receive, send)
            finally:
                decided.close()  # not admitted: its request ended first
        read, body = await read_body(receive)
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
