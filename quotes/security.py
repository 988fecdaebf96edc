"""Who is asking, and whether to believe them: client addresses as limits count them, trusted
proxies' forwarded headers, refusing pages of another origin (HTTP and WebSocket), the WebSocket's
frame cap, and django-axes' hooks for the admin login.
"""

from __future__ import annotations

import functools
import ipaddress
import math
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
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

from .errors import ErrorCode, QuoteError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:192.0.2.1 is 192.0.2.1, whichever stack accepted it
    return address


def client_address(ip: str) -> str:
    """The address an anonymous client is counted by: an IPv6 one as its QUOTES_IPV6_PREFIX network
    (a /64, what one subscriber or instance is given: no rotating out), as its first address; what
    is no address (a unix socket's peer), as it is."""
    address = _address(ip)
    if address is None:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        network = ipaddress.IPv6Network((int(address), settings.QUOTES_IPV6_PREFIX), strict=False)
        return str(network.network_address)
    return str(address)


def client_network(ip: str) -> str:
    """The network the coarser rate limit counts an address by (QUOTES_IPV6_NETWORK_PREFIX,
    QUOTES_IPV4_NETWORK_PREFIX); "" when it is not an address."""
    address = _address(ip)
    if address is None:
        return ""
    v6 = isinstance(address, ipaddress.IPv6Address)
    prefix = settings.QUOTES_IPV6_NETWORK_PREFIX if v6 else settings.QUOTES_IPV4_NETWORK_PREFIX
    return str(ipaddress.ip_network((int(address), prefix), strict=False))


@dataclass(frozen=True, slots=True)
class TrustedProxies:
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    #: a unix socket has no peer address: only a local process (nginx) can reach it
    unix: bool

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def parse(entries: tuple[str, ...]) -> TrustedProxies:
        networks = tuple(ipaddress.ip_network(entry, strict=False) for entry in entries if entry != "unix")
        return TrustedProxies(networks=networks, unix="unix" in entries)

    def trusts(self, address: Address) -> bool:
        return any(address in network for network in self.networks)

    def trusts_peer(self, client: Sequence[Any] | None) -> bool:
        if not client or not client[0]:
            return self.unix
        address = _address(str(client[0]))
        return address is not None and self.trusts(address)

    def forwarded_client(self, hops: list[str]) -> str | None:
        """The client in an X-Forwarded-For chain: the first hop from the right that is not a
        trusted proxy (each appends the address it saw; what is left of it, the client wrote)."""
        for hop in reversed(hops):
            address = _hop_address(hop)
            if address is None:
                return None  # garbage (or "unknown") where an address should be: believe none
            if not self.trusts(address):
                return str(address)
        first = _hop_address(hops[0]) if hops else None  # every hop a proxy of ours
        return str(first) if first is not None else None


def _hop_address(hop: str) -> Address | None:
    """One X-Forwarded-For entry: `192.0.2.1`, `192.0.2.1:4711`, `2001:db8::1` or `[2001:db8::1]:4711`."""
    hop = hop.strip()
    if hop.startswith("["):
        hop = hop[1 : hop.find("]")] if "]" in hop else ""
    elif hop.count(":") == 1:
        hop = hop.partition(":")[0]
    return _address(hop)


def _header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope.get("headers", ()) if key.lower() == name]


class TrustedProxyMiddleware:
    """Pure ASGI, around the whole app (HTTP and WebSocket): when the peer is one of
    QUOTES_TRUSTED_PROXIES, the client and scheme it forwarded (X-Forwarded-For, -Proto) replace
    the peer's in the scope. Not daphne's `--proxy-headers`, which believes whoever connects."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            proxies = TrustedProxies.parse(tuple(settings.QUOTES_TRUSTED_PROXIES))
            if proxies.trusts_peer(scope.get("client")):
                scope = _forwarded_scope(scope, proxies)
        await self.app(scope, receive, send)


def _forwarded_scope(scope: Scope, proxies: TrustedProxies) -> Scope:
    hops = [
        hop for value in _header_values(scope, b"x-forwarded-for") for hop in value.split(",") if hop.strip()
    ]
    protos = _header_values(scope, b"x-forwarded-proto")
    if not hops and not protos:
        return scope
    scope = dict(scope)  # the server's dict is its own
    client = proxies.forwarded_client(hops) if hops else None
    if client is not None:
        scope["client"] = (client, 0)  # the client's port is not forwarded
    proto = protos[-1].strip().lower() if protos else ""
    if proto in ("http", "https"):
        scope["scheme"] = proto if scope["type"] == "http" else proto.replace("http", "ws")
    return scope


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
    origins = _header_values(scope, b"origin")
    if len(origins) != 1:
        return False
    fetch_sites = _header_values(scope, b"sec-fetch-site")
    return not comes_from_elsewhere(
        fetch_site=fetch_sites[-1] if fetch_sites else None,
        origin=origins[0],
        own_origin=_websocket_own_origin(scope),
    )


def _websocket_own_origin(scope: Scope) -> str | None:
    hosts = _header_values(scope, b"host")
    if len(hosts) != 1:
        return None
    domain, _port = split_domain_port(hosts[0])
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]  # as Django's HttpRequest.get_host
    if not domain or not validate_host(domain, allowed):
        return None
    scheme = "https" if scope.get("scheme") == "wss" else "http"
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
