"""Whether to believe a request: refusing pages of another origin (HTTP and WebSocket), which bad
input counts against the client, the WebSocket's frame cap, and django-axes' hooks for the admin
login.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from axes.backends import AxesStandaloneBackend
from axes.handlers.database import AxesDatabaseHandler
from axes.models import AccessAttempt
from django.conf import settings
from django.db import router, transaction
from django.http import HttpRequest, HttpResponse, QueryDict
from django.http.request import split_domain_port, validate_host
from django.shortcuts import render
from django.utils.http import is_same_domain

from .clients import ASGIApp, Receive, Scope, Send, client_address, header_values
from .errors import ErrorCode, QuoteError

#: `Sec-Fetch-Site` of a request no other page made: this site's own, or `none` (typed, a
#: bookmark, another application), which no page can make a browser send.
FROM_THIS_ORIGIN = frozenset({"same-origin", "none"})


def comes_from_elsewhere(*, fetch_site: str | None, origin: str | None, own_origin: str | None) -> bool:
    """Whether a browser says this request comes from a page of another origin: another site, or
    a sibling subdomain (`same-site`: still another origin, its own code).

    Browsers send `Sec-Fetch-Site` on every request, and `Origin` on every cross-origin fetch or
    EventSource, POST and WebSocket. A request is from elsewhere unless its `Origin` is one of
    DJANGO_CSRF_TRUSTED_ORIGINS, or both headers say this origin (each absent, Sec-Fetch-Site in
    FROM_THIS_ORIGIN, Origin equal to `own_origin`). One with neither header, such as curl's, is
    no browser riding a visitor's session."""
    if origin is not None and _trusted_origin(origin):
        return False
    if fetch_site is not None and fetch_site not in FROM_THIS_ORIGIN:
        return True  # same-site, cross-site, or a value no browser sends
    return origin is not None and origin != own_origin


def _from_elsewhere(request: HttpRequest) -> bool:
    origin = request.headers.get("Origin")
    return comes_from_elsewhere(
        fetch_site=request.headers.get("Sec-Fetch-Site"),
        origin=origin,
        own_origin=f"{request.scheme}://{request.get_host()}" if origin is not None else None,
    )


def refuse_cross_site(request: HttpRequest) -> None:
    """A 403 before any work for a page of another origin: it must not start a (paid) generation
    or stop a visitor's."""
    if _from_elsewhere(request):
        raise QuoteError(
            ErrorCode.CROSS_SITE,
            "Quotes can only be asked for from this site's own pages (or without a browser, e.g. curl).",
            403,
        )


def _trusted_origin(origin: str) -> bool:
    """One of DJANGO_CSRF_TRUSTED_ORIGINS (wildcards as Django reads them)."""
    if origin in settings.CSRF_TRUSTED_ORIGINS:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    for trusted in settings.CSRF_TRUSTED_ORIGINS:
        if "*" in trusted:
            pattern = urlsplit(trusted)
            if pattern.scheme == parts.scheme and is_same_domain(parts.netloc, pattern.netloc.lstrip("*")):
                return True
    return False


class SameOriginWebSocketMiddleware:
    """Pure ASGI: a WebSocket handshake from a page of another origin (comes_from_elsewhere) or
    without `Origin` (browsers always send it) is refused with a 403 before any frame is read.
    Unlike Channels' AllowedHostsOriginValidator, it minds scheme and port, and lets no other
    subdomain of a `.example.com` entry in."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not _websocket_from_this_origin(scope):
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})  # before accept: an HTTP 403
            return
        await self.app(scope, receive, send)


def _websocket_from_this_origin(scope: Scope) -> bool:
    return len(header_values(scope, b"origin")) == 1 and not scope_from_elsewhere(scope)


def scope_from_elsewhere(scope: Scope) -> bool:
    """`comes_from_elsewhere` read from an ASGI scope's headers (a WebSocket's handshake, or an
    HTTP request before Django: quotes.gate); this origin is the Host, if ALLOWED_HOSTS has it."""
    origins = header_values(scope, b"origin")
    fetch_sites = header_values(scope, b"sec-fetch-site")
    return comes_from_elsewhere(
        fetch_site=fetch_sites[-1] if fetch_sites else None,
        origin=origins[-1] if origins else None,
        own_origin=_scope_own_origin(scope) if origins else None,
    )


def _scope_own_origin(scope: Scope) -> str | None:
    hosts = header_values(scope, b"host")
    if len(hosts) != 1:
        return None
    domain, _port = split_domain_port(hosts[0])
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]  # as Django's HttpRequest.get_host
    if not domain or not validate_host(domain, allowed):
        return None
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    return f"{scheme}://{hosts[0]}"


def counts_bad_input(request: HttpRequest) -> bool:
    """Whether a request's bad input may count against its client's budget: when its headers say
    this site, or when it is no browser at all. A browser that names no origin (an <img> in an
    older Safari) may be another site's page spending a visitor's."""
    if "Sec-Fetch-Site" in request.headers or "Origin" in request.headers:
        return not _from_elsewhere(request)
    return not request.headers.get("User-Agent", "").startswith("Mozilla/")


def frame_too_large(text_data: str | None, bytes_data: bytes | None) -> QuoteError | None:
    """A WebSocket frame over QUOTES_MAX_FRAME_BYTES, refused before anything parses or cleans it."""
    cap = settings.QUOTES_MAX_FRAME_BYTES
    if text_data is not None:
        size = len(text_data)
        if size * 4 > cap:  # could be over in UTF-8 (up to 4 bytes a character): measure
            size = len(text_data.encode("utf-8", "surrogatepass"))
    else:
        size = len(bytes_data or b"")
    if size <= cap:
        return None
    return QuoteError(ErrorCode.FRAME_TOO_LARGE, f"A frame may be at most {cap} bytes (UTF-8).", 413)


class LoginThrottleBackend(AxesStandaloneBackend):
    """django-axes' backend (first in AUTHENTICATION_BACKENDS), made whole for Django 5.2, which
    calls `aauthenticate`, missing in axes 8.3; and a call with no request (tests, scripts) has
    no client to count, so it is not throttled, where axes would raise."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        return super().authenticate(request, username, password, **kwargs)

    async def aauthenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        # axes counts and checks in the database, with the sync ORM: one thread hop, per login only.
        return await sync_to_async(self.authenticate)(request, username, password, **kwargs)


class LoginFailureHandler(AxesDatabaseHandler):
    """AXES_HANDLER: django-axes' database handler, keeping nothing a client sent. axes appends
    each failure's fields and username to the client's row: 40 attempts with a 2 KB field grew one
    from 1.3 KB to 84 KB, holding whatever was typed. Here it sees none (the lockout is by
    address), and the separators it still appends are emptied in the same transaction."""

    def user_login_failed(
        self, sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **kwargs: Any
    ) -> None:
        if request is None:
            return super().user_login_failed(sender, credentials, request, **kwargs)
        submitted = request.GET, request.POST
        request.GET = request.POST = QueryDict()
        try:
            with transaction.atomic(using=router.db_for_write(AccessAttempt)):
                # No credentials: axes takes the username from them, else from the (empty) POST.
                super().user_login_failed(sender, None, request, **kwargs)
                AccessAttempt.objects.filter(ip_address=request.axes_ip_address).exclude(  # type: ignore[attr-defined]
                    get_data="", post_data=""
                ).update(get_data="", post_data="")
        finally:
            request.GET, request.POST = submitted


def login_client_address(request: HttpRequest) -> str | None:
    """AXES_CLIENT_IP_CALLABLE: the address rate limits count."""
    return client_address(request.META.get("REMOTE_ADDR") or "") or None


def login_locked_out(
    request: HttpRequest, original_response: object = None, credentials: object = None
) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: a readable page (429, with Retry-After) instead of axes' bare text."""
    from axes.helpers import get_cool_off

    cool_off = get_cool_off(request)
    seconds = int(cool_off.total_seconds()) if cool_off is not None else 0
    response = render(
        request,
        "admin/login_locked_out.html",
        {
            "title": "Too many failed logins",
            "failure_limit": settings.AXES_FAILURE_LIMIT,
            "cooloff_minutes": max(1, math.ceil(seconds / 60)) if seconds else None,
        },
        status=429,
    )
    if seconds:
        response["Retry-After"] = str(seconds)
    return response
