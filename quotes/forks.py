"""Every use of a dependency's internals, quarantined here (docs/architecture.md), each with what
it buys (figures: docs/benchmarks.md, "The forks"). `PINS` hashes the upstream source each relies
on: an upgrade that changes it fails tests/deploy/test_forks.py and the `quotes.W002` check."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import inspect
import io
import pkgutil
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync, sync_to_async
from csp import middleware as csp_middleware

# After daphne.server installs Twisted's reactor: the daphne app (first in INSTALLED_APPS) does.
from daphne import ws_protocol as daphne_ws
from django.conf import settings
from django.contrib import messages as messages_api
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.core import checks
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware import clickjacking, common, csrf, security
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from daphne.server import Server

# -- 1. Django's middleware on the event loop ---------------------------------------------------
# MiddlewareMixin.__acall__ hops to a thread for each method; on these settings they do no I/O, so
# they run inline, for a much faster first token. quotes.E001 compares them with Django's way.

INLINED: tuple[type[MiddlewareMixin], ...] = (
    security.SecurityMiddleware,
    sessions.SessionMiddleware,
    common.CommonMiddleware,
    csrf.CsrfViewMiddleware,
    auth.AuthenticationMiddleware,
    messages.MessageMiddleware,
    clickjacking.XFrameOptionsMiddleware,
    csp_middleware.CSPMiddleware,
)


def steps_aside(middleware: object) -> bool:
    """Whether the settings make this middleware touch a store (so it keeps Django's hops): CSRF's
    secret in the session, messages not in their cookie, a session engine not Django's."""
    if isinstance(middleware, csrf.CsrfViewMiddleware):
        return bool(settings.CSRF_USE_SESSIONS)
    if isinstance(middleware, messages.MessageMiddleware):
        return bool(settings.MESSAGE_STORAGE != "django.contrib.messages.storage.cookie.CookieStorage")
    if isinstance(middleware, sessions.SessionMiddleware):
        return not settings.SESSION_ENGINE.startswith("django.contrib.sessions.backends.")
    return False


async def inline_acall(self: Any, request: HttpRequest) -> HttpResponseBase:
    if steps_aside(self):
        return await MiddlewareMixin.__acall__(self, request)
    response = None
    if hasattr(self, "process_request"):
        response = self.process_request(request)
    response = response or await self.get_response(request)
    if not hasattr(self, "process_response"):
        return response
    session = getattr(request, "session", None) if isinstance(self, sessions.SessionMiddleware) else None
    if session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST):
        return await sync_to_async(self.process_response)(request, response)  # saved: a database write
    return self.process_response(request, response)


def inline_middleware() -> None:
    """From QuotesConfig.ready(), before any handler loads its middleware. Decorators made from
    these classes (csrf_protect) call their methods directly and are untouched."""
    for cls in INLINED:
        cls.__acall__ = inline_acall  # type: ignore[method-assign]


def _outcome(handler: Callable[[HttpRequest], Awaitable[HttpResponseBase]], request: HttpRequest) -> object:
    """Status, headers and cookies (without their random values), or the exception raised."""
    try:
        response = async_to_sync(handler)(request)
    except Exception as exc:
        return ("raised", type(exc).__name__)
    cookies = sorted((name, sorted(morsel.items())) for name, morsel in response.cookies.items())
    return (response.status_code, sorted(response.items()), cookies)


def _chain(*, djangos: bool) -> Callable[..., Any]:
    """The INLINED middleware in MIDDLEWARE's order, called through Django's `__acall__` or ours,
    around a view that adds a message."""

    async def view(request: HttpRequest) -> HttpResponseBase:
        if request.GET.get("message"):
            messages_api.info(request, "stored in a cookie on the way out")
        return HttpResponse("ok")

    handler: Callable[..., Any] = view
    for dotted in reversed(settings.MIDDLEWARE):
        cls = import_string(dotted)
        if cls in INLINED:
            middleware = cls(handler)
            handler = functools.partial(MiddlewareMixin.__acall__, middleware) if djangos else middleware
    return handler


def _requests() -> list[HttpRequest]:
    from django.test import RequestFactory  # only this check needs django.test

    allowed = [host.lstrip(".") for host in settings.ALLOWED_HOSTS if host != "*"]
    factory = RequestFactory(HTTP_HOST=(allowed or ["localhost"])[0])
    # A middleware that loads this session inline (SynchronousOnlyOperation) comes out differently.
    factory.cookies[settings.SESSION_COOKIE_NAME] = "checking-the-inline-middleware"
    return [
        factory.get("/", secure=True),
        factory.get("/", {"message": "1"}, secure=True),
        factory.post("/", {"field": "value"}, secure=True),  # no CSRF token
        factory.get("/", secure=False),  # SECURE_SSL_REDIRECT's redirect
    ]


@checks.register(checks.Tags.security)
def check_inline_middleware(app_configs: object = None, **kwargs: object) -> list[checks.CheckMessage]:
    """quotes.E001: each INLINED middleware has our `__acall__`, and a few requests come out of
    the chain the same through Django's `__acall__` and through ours."""
    errors: list[checks.CheckMessage] = [
        checks.Error(
            f"{cls.__module__}.{cls.__qualname__} is not run inline: its __acall__ is not quotes.forks'.",
            hint="quotes.forks.inline_middleware() runs from QuotesConfig.ready().",
            id="quotes.E001",
        )
        for cls in INLINED
        if cls.__acall__ is not inline_acall
    ]
    if errors:
        return errors
    with contextlib.suppress(RuntimeError):
        asyncio.get_running_loop()  # async_to_sync cannot drive the chains from inside a loop
        return [
            checks.Info(
                "The inline middleware were not compared with Django's: in an event loop.", id="quotes.I001"
            )
        ]
    djangos, ours = _chain(djangos=True), _chain(djangos=False)
    pairs = zip(_requests(), _requests(), strict=True)  # each request is read once
    outcomes = [(r, _outcome(djangos, r), _outcome(ours, again)) for r, again in pairs]
    return [
        checks.Error(
            f"{request.method} {request.get_full_path()} (secure: {request.is_secure()}) comes out of "
            f"the middleware differently inline than through Django's MiddlewareMixin.__acall__: "
            f"{ours_out!r} != {theirs_out!r}.",
            hint="Django's middleware changed: see quotes/forks.py, and update or drop the fork.",
            id="quotes.E001",
        )
        for request, theirs_out, ours_out in outcomes
        if theirs_out != ours_out
    ]


# -- 2. daphne's WebSocket close codes -----------------------------------------------------------
# autobahn's sendClose() accepts only 1000 and 3000-4999, so a socket daphne closed with 1012 (the
# drain) or 1009 (message too big) was never closed. Behaviour, not speed.

#: Close codes a server sends of its own accord (IANA's registry).
SERVER_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011, 1012, 1013})


class ServerCloseCodesProtocol(daphne_ws.WebSocketProtocol):
    def serverClose(self, code: int | None = None) -> None:
        if code in SERVER_CLOSE_CODES:
            self.sendCloseFrame(code=code, isReply=False)
        else:
            super().serverClose(code)


def use_server_close_codes(server: Server) -> None:
    """From daphne's `ready_callable`: its WebSocket factory exists, no connection yet."""
    server.ws_factory.protocol = ServerCloseCodesProtocol


# -- 3. The start-up heap out of the collector's full passes ---------------------------------------
# A full collection stalls every open stream; without what start-up loaded it is far shorter. A
# collector tuning, pinned to the interpreter it was measured on.

PYTHON = (3, 11)


def freeze_startup_heap() -> None:
    """At the end of config.asgi: what is loaded by then lives as long as the process."""
    gc.collect()
    gc.freeze()


# -- 4. A request made before Django's handler ---------------------------------------------------
# The StreamAdmissionGate answers a refusal without Django's handler, for far less CPU, with
# Django's undocumented ASGIRequest; the view reads the gate's decision from its scope.


def asgi_request(scope: dict[str, Any], body: bytes) -> HttpRequest:
    return ASGIRequest(scope, io.BytesIO(body))


def asgi_scope(request: HttpRequest) -> Mapping[str, Any]:
    """The ASGI scope `request` was made from (empty for a request made another way)."""
    return request.scope if isinstance(request, ASGIRequest) else {}


#: The upstream code each fork relies on (SHA-256 of its source). When one changes, read the new
#: code, check the fork still holds (or is still needed), then update the hash.
PINS: dict[str, str] = {
    # 1: what inline_acall replaces, and the methods they call on the loop.
    "django.utils.deprecation.MiddlewareMixin.__acall__": "adf8cbcaf9f11e45c4ac1953556ac422f2a6fe4193df5edbed186b2b66bea729",
    "django.utils.deprecation.MiddlewareMixin.__call__": "337be048dd62e01485fd5afaf5b79c473287430ccf369ff9dd80bb8f84fa569f",
    "django.middleware.security.SecurityMiddleware.process_request": "3373d262748cbe3ebf773432c2d3661231fade68467b673b1cde6f32a1ab2027",
    "django.middleware.security.SecurityMiddleware.process_response": "3822bd0d5f79f4a3760ccfedc88f297d450e340c76cc9d926539fe6164b59a98",
    "django.contrib.sessions.middleware.SessionMiddleware.process_request": "6782d24847e4a9267ad523e25487d5366241c7b7c2f0c90fe71c233b74af80aa",
    "django.contrib.sessions.middleware.SessionMiddleware.process_response": "fbaf5503c20d7dd09b0917969f49541a469fb48ca8f7867d97da879e9ca9bf79",
    "django.middleware.common.CommonMiddleware.process_request": "993f4d1f2084e01e0d2c8b96a2b122b17a187170cf8749bf890111689d17096f",
    "django.middleware.common.CommonMiddleware.process_response": "eb5ad294e9fbda9bd84e0800e5d3b6f001ceb5f5dd2e01bf7381530b7ce16e6a",
    "django.middleware.csrf.CsrfViewMiddleware.process_request": "9aec8dfd81c88a564457a508ed33a5f30cb54ba26ecba10b18a849f7c3ff5174",
    "django.middleware.csrf.CsrfViewMiddleware.process_response": "9fe1054c0f64b37f7a2afa82d748ec4b62259e745e69974381b82917380a6c7a",
    "django.contrib.auth.middleware.AuthenticationMiddleware.process_request": "6dd39b90ad6373e2c7d5b0ceda543c912360da9e1daf5766c3ca9b090e8675e6",
    "django.contrib.messages.middleware.MessageMiddleware.process_request": "7f4834ba26ee05835eb38324e7ff6b2e85f109815e42b641783401775d367e74",
    "django.contrib.messages.middleware.MessageMiddleware.process_response": "04469c9493c90e26418c6125b0ffcf66759fb16bb2ca79b42f6f8ebe4913f617",
    "django.middleware.clickjacking.XFrameOptionsMiddleware.process_response": "045e5788270860c67495f3749df26a405900ef54018858cf78a013692b61d926",
    "csp.middleware.CSPMiddleware.process_request": "bf5a743128a430b80d0d9cafd2a6b8e52232d1466cbdce510866436ef4e73f74",
    "csp.middleware.CSPMiddleware.process_response": "fa72a0cd0d633c49cb5318ebb621cb3b65bae3b8ac53a0a9edd5a6457df1080c",
    # 2: daphne's close, autobahn's refusal of server codes, the frame we send instead, and
    # where daphne makes its WebSocket factory (before it calls ready_callable).
    "daphne.ws_protocol.WebSocketProtocol.serverClose": "8302150efac698d62de45c277e79a177c67ae5ea3c4f437064000bbdb6545a7b",
    "daphne.server.Server.run": "447c6bd42c62e98cda21fbd603a045ff72abbccabd2b234d8b40c18d366cb7db",
    "autobahn.websocket.protocol.WebSocketProtocol.sendClose": "6ccfd325e62723095869fe62379a4a7ef1d1ebff86a8381c402bb6f40251764b",
    "autobahn.websocket.protocol.WebSocketProtocol.sendCloseFrame": "a511406d6b0d711e81f5067e322de0f628437b9f9dac0c74a001bc19c482b9fc",
    # 4: how asgi_request's ASGIRequest reads the scope and the body.
    "django.core.handlers.asgi.ASGIRequest.__init__": "5ff1464df4bf995e78cfc6ca2590fe9166c6565dee93a37020dba88f2c9c7bc0",
}


def source_hash(dotted: str) -> str:
    """The SHA-256 of the source of the function named `dotted` (a module's, or a class's)."""
    return hashlib.sha256(
        inspect.getsource(inspect.unwrap(pkgutil.resolve_name(dotted))).encode()
    ).hexdigest()


def changed_pins() -> dict[str, str]:
    """The pinned names whose source no longer has its pinned hash: name -> the hash now (or
    why it could not be read); and "python" when the interpreter is not PYTHON."""
    changed = {}
    if sys.version_info[:2] != PYTHON:
        changed["python"] = ".".join(map(str, sys.version_info[:3]))
    for dotted, pinned in PINS.items():
        try:
            now = source_hash(dotted)
        except (AttributeError, ImportError, OSError, TypeError) as exc:
            now = f"unreadable: {exc!r}"
        if now != pinned:
            changed[dotted] = now
    return changed


@checks.register(checks.Tags.compatibility)
def check_pins(app_configs: object = None, **kwargs: object) -> list[checks.CheckMessage]:
    """quotes.W002: the upstream code a fork relies on is the code it was checked against."""
    return [
        checks.Warning(
            f"{dotted} changed since quotes/forks.py was checked against it (now {now}).",
            hint="Read the new code, check the fork that relies on it still holds, then update PINS.",
            id="quotes.W002",
        )
        for dotted, now in changed_pins().items()
    ]
