"""Django's own middleware on an async stack, without the thread hops.

Under ASGI, Django runs each MiddlewareMixin middleware's `process_request` and
`process_response` (and the handler its `process_view`) through `sync_to_async`: a hop to a
thread and back for each, some fifteen per request for the eight in settings.MIDDLEWARE. They were
two thirds of a stream's CPU before its first token (docs/benchmarks.md: 24 ms against 8 ms with
them out). Their hooks do no I/O: they read and set headers and cookies and make lazy objects.
So each is listed as a subclass here, async-native, whose same public hooks run in the event
loop's thread, in Django's order. The one hook that can do I/O, the session's save, keeps
its thread. Should a hook ever reach the database from here, Django raises
SynchronousOnlyOperation rather than block the loop, and the suite's requests (pages, forms,
the admin's login) go through each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from csp.middleware import CSPMiddleware as DjangoCSP
from django.conf import settings
from django.contrib.auth.middleware import AuthenticationMiddleware as DjangoAuthentication
from django.contrib.messages.middleware import MessageMiddleware as DjangoMessages
from django.contrib.sessions.middleware import SessionMiddleware as DjangoSessions
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.middleware.clickjacking import XFrameOptionsMiddleware as DjangoXFrameOptions
from django.middleware.common import CommonMiddleware as DjangoCommon
from django.middleware.csrf import CsrfViewMiddleware as DjangoCsrf
from django.middleware.security import SecurityMiddleware as DjangoSecurity


class Inline:
    """Put before a MiddlewareMixin middleware in a class's bases: its hooks called inline (it
    stays that middleware, as Django's checks and isinstance() see it)."""

    sync_capable = False
    async_capable = True

    @classmethod
    def shipped(cls) -> type[Any]:
        """The middleware this one runs (its last base)."""
        return cls.__bases__[-1]

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        this: Any = self
        response = this.process_request(request) if hasattr(this, "process_request") else None
        response = response or await this.get_response(request)
        return this.process_response(request, response) if hasattr(this, "process_response") else response


class SecurityMiddleware(Inline, DjangoSecurity):
    pass


class CSPMiddleware(Inline, DjangoCSP):
    pass


class CommonMiddleware(Inline, DjangoCommon):
    pass


class CsrfViewMiddleware(Inline, DjangoCsrf):
    async def process_view(  # type: ignore[override]  # the handler awaits an async hook
        self, request: HttpRequest, view: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        # A refusal calls CSRF_FAILURE_VIEW (quotes.views.csrf_failure), which does no I/O either.
        return super().process_view(request, view, args, kwargs)


class AuthenticationMiddleware(Inline, DjangoAuthentication):
    pass


class MessageMiddleware(Inline, DjangoMessages):
    """The messages in a cookie (MESSAGE_STORAGE): no I/O."""


class XFrameOptionsMiddleware(Inline, DjangoXFrameOptions):
    pass


class SessionMiddleware(Inline, DjangoSessions):
    """The session is read lazily (`await request.auser()`, or a sync view in its thread); its
    save, when a view changed it, is I/O: that one in a thread, as Django does."""

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        self.process_request(request)
        response = await self.get_response(request)  # type: ignore[misc]  # async: sync_capable is False
        if request.session.modified or settings.SESSION_SAVE_EVERY_REQUEST:
            saved: HttpResponseBase = await sync_to_async(self.process_response)(request, response)
            return saved
        return self.process_response(request, response)
