"""Every place where the app relies on a dependency's internals, quarantined here.

The rule (docs/architecture.md): only the documented interfaces of Django, asgiref, daphne,
redis-py and the rest, except in this module. Each piece below says what it buys, measured side
by side with the framework's own way (docs/benchmarks.md, "The forks"), and what upstream code
it relies on: `PINS` holds a hash of that code's source, so an upgrade that changes it fails
tests/deploy/test_forks.py and this app's `quotes.W002` system check instead of breaking us silently.
A fork that bought less than about 10% of a figure was removed instead of kept here.

1. **Django's middleware on the event loop** (`inline_middleware`). Under ASGI, Django's
   `MiddlewareMixin.__acall__` runs each `process_request` and `process_response` in a thread
   (a `sync_to_async` hop to the request's thread and back, ~0.4 ms each on these machines):
   with the eight middleware below that is a dozen hops per request, and the app added 72-82%
   more to the first token (2.2-2.7 times what the naive proxy adds, instead of 1.3-1.6).
   On these settings their methods do no I/O, so their `__acall__` is replaced by one that
   calls them inline; a session that must be saved keeps its hop, and so does a middleware that
   a setting makes touch a store (`steps_aside`: CSRF_USE_SESSIONS and the like). CSRF's
   `process_view` is the handler's, with its hop (on the loop it bought 9%, under the bar).
   They stay in MIDDLEWARE under Django's own dotted paths, so Django's deploy checks
   (W001-W003 and the HSTS, SSL and cookie checks that depend on them) run unsilenced, and
   `check_inline_middleware` (`quotes.E001`) runs a few requests through both Django's
   `__acall__` and ours (with a session cookie) and compares what comes out.
2. **WhiteNoise with an async entry** (`StaticFilesMiddleware`). WhiteNoise's middleware is
   sync-only, and one sync middleware makes Django run the rest of the chain through a thread
   (two hops per request, and the request's thread held while a stream waits for its first
   token): 5-13% more added to the first token, at the edge of the 10% bar. This subclass serves
   files under STATIC_URL from a worker thread and lets every other request straight through on
   the loop.
3. **daphne's WebSocket close codes** (`use_server_close_codes`). daphne hands an ASGI
   `websocket.close` code to autobahn's `sendClose()`, which accepts only 1000 and 3000-4999 and
   raises on any other, so a socket closed with 1012 (service restart: the drain) or 1009
   (message too big) was never closed. A feature, not a speed-up: tests/deploy/test_drain.py and
   tests/stream/test_consumers.py hold it.
4. **The start-up heap out of the collector's full passes** (`freeze_startup_heap`). A full
   (generation 2) collection walks every tracked object, Django and the app's modules included,
   and stalls every open stream while it does: 67-68 ms of CPU at 100 streams (89-97 ms at 200),
   about once every 30 s. With what start-up loaded frozen (`gc.freeze`, documented, but a
   process-wide tuning that depends on the interpreter's collector) the same passes take 8-12 ms
   (17-54 ms). Pinned to the Python it was measured on (`PYTHON`).
5. **A request made before Django's handler** (`asgi_request`). quotes.middleware's
   StreamAdmissionGate refuses a new stream at the open-stream limit in front of Django's
   handler, and needs an HttpRequest for the refusal's view: Django's `ASGIRequest`, made from
   the ASGI scope and the body read, is undocumented, and so is the scope it keeps, where the
   view reads the gate's decision (`asgi_scope`). Through the handler a refusal cost about
   twice the CPU (its thread hops, a request thread, the whole middleware chain;
   docs/benchmarks.md, issue 22), and an overload is mostly refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import importlib
import inspect
import io
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync, markcoroutinefunction, sync_to_async
from csp import middleware as csp_middleware

# daphne's WebSocket protocol: importing it is safe once daphne.server has installed Twisted's
# asyncio reactor, which the daphne app (first in INSTALLED_APPS) and daphne's CLI both do first.
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
from whitenoise import middleware as whitenoise_middleware

if TYPE_CHECKING:
    from daphne.server import Server

# -- 1. Django's middleware on the event loop ---------------------------------------------------

#: The middleware whose `__acall__` runs their methods inline (in MIDDLEWARE under Django's paths).
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


#: The message storage whose methods touch nothing but the request and response (settings.py).
COOKIE_STORAGE = "django.contrib.messages.storage.cookie.CookieStorage"


def steps_aside(middleware: object) -> bool:
    """Whether, under the current settings, this middleware's methods may read or write a store
    (the database, a cache, files): then it keeps Django's `__acall__`, hops and all. CSRF's
    secret in the session (CSRF_USE_SESSIONS), messages anywhere but their cookie
    (MESSAGE_STORAGE: Django's default falls back to the session), a session engine not
    Django's (whose SessionStore() may connect)."""
    if isinstance(middleware, csrf.CsrfViewMiddleware):
        return bool(settings.CSRF_USE_SESSIONS)
    if isinstance(middleware, messages.MessageMiddleware):
        return bool(settings.MESSAGE_STORAGE != COOKIE_STORAGE)
    if isinstance(middleware, sessions.SessionMiddleware):
        return not settings.SESSION_ENGINE.startswith("django.contrib.sessions.backends.")
    return False


async def inline_acall(self: Any, request: HttpRequest) -> HttpResponseBase:
    """`MiddlewareMixin.__acall__` with its two `sync_to_async` hops taken out."""
    if steps_aside(self):
        return await MiddlewareMixin.__acall__(self, request)
    response = None
    if hasattr(self, "process_request"):
        response = self.process_request(request)
    response = response or await self.get_response(request)
    if hasattr(self, "process_response"):
        response = self.process_response(request, response)
    return response


async def session_acall(self: Any, request: HttpRequest) -> HttpResponseBase:
    """`inline_acall` for the session, whose `process_response` saves a modified session: that
    write goes to the session store (the database), so it keeps Django's hop to a thread."""
    if steps_aside(self):
        return await MiddlewareMixin.__acall__(self, request)
    self.process_request(request)
    response = await self.get_response(request)
    session = getattr(request, "session", None)
    if session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST):
        return await sync_to_async(self.process_response)(request, response)
    return self.process_response(request, response)


def inline_middleware() -> None:
    """Swap the `__acall__` of each of INLINED (QuotesConfig.ready(): before any handler loads
    its middleware). Only `__acall__`: Django's `csrf_protect` and the other decorators made
    from these classes call their methods directly and are untouched."""
    for cls in INLINED:
        cls.__acall__ = session_acall if cls is sessions.SessionMiddleware else inline_acall  # type: ignore[method-assign]


def _outcome(handler: Callable[[HttpRequest], Awaitable[HttpResponseBase]], request: HttpRequest) -> object:
    """What `handler` makes of `request`: the status, headers and cookies (without their random
    values: a CSRF token differs each time), or the exception it raised."""
    try:
        response = async_to_sync(handler)(request)
    except Exception as exc:
        return ("raised", type(exc).__name__)
    cookies = sorted((name, sorted(morsel.items())) for name, morsel in response.cookies.items())
    return (response.status_code, sorted(response.items()), cookies)


def _chain(acall: Callable[[Any, HttpRequest], Awaitable[HttpResponseBase]]) -> Callable[..., Any]:
    """The INLINED middleware in MIDDLEWARE's order around a view that adds a message, each
    called through `acall`."""

    async def view(request: HttpRequest) -> HttpResponseBase:
        if request.GET.get("message"):
            messages_api.info(request, "stored in a cookie on the way out")
        return HttpResponse("ok")

    handler: Callable[..., Any] = view
    for dotted in reversed(settings.MIDDLEWARE):
        cls = import_string(dotted)
        if cls in INLINED:
            handler = _through(cls(handler), acall)
    return handler


def _through(middleware: Any, acall: Callable[[Any, HttpRequest], Awaitable[HttpResponseBase]]) -> Any:
    async def call(request: HttpRequest) -> HttpResponseBase:
        return await acall(middleware, request)

    return call


def _requests() -> list[HttpRequest]:
    from django.test import RequestFactory  # only this check needs django.test

    allowed = [host.lstrip(".") for host in settings.ALLOWED_HOSTS if host != "*"]
    factory = RequestFactory(HTTP_HOST=(allowed or ["localhost"])[0])
    # A session cookie naming a session: a middleware that loads it inline (the database's
    # SynchronousOnlyOperation on the loop) comes out differently from Django's, in a thread.
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
    the chain the same through Django's own `__acall__` (with its hops) and through ours."""
    errors: list[checks.CheckMessage] = []
    for cls in INLINED:
        expected = session_acall if cls is sessions.SessionMiddleware else inline_acall
        if cls.__acall__ is not expected:
            errors.append(
                checks.Error(
                    f"{cls.__module__}.{cls.__qualname__} is not run inline: its __acall__ is not quotes.forks'.",
                    hint="quotes.forks.inline_middleware() runs from QuotesConfig.ready().",
                    id="quotes.E001",
                )
            )
    if errors:
        return errors
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no event loop in this thread (manage.py check, migrate, runserver): async_to_sync works
    else:
        return [
            checks.Info(
                "The inline middleware were not compared with Django's: checks ran inside an event loop.",
                id="quotes.I001",
            )
        ]
    djangos, ours = _chain(MiddlewareMixin.__acall__), _chain(lambda middleware, request: middleware(request))
    for request, again in zip(_requests(), _requests(), strict=True):
        theirs_out, ours_out = _outcome(djangos, request), _outcome(ours, again)
        if theirs_out != ours_out:
            errors.append(
                checks.Error(
                    f"{request.method} {request.get_full_path()} (secure: {request.is_secure()}) comes out of "
                    f"the middleware differently inline than through Django's MiddlewareMixin.__acall__: "
                    f"{ours_out!r} != {theirs_out!r}.",
                    hint="Django's middleware changed: see quotes/forks.py, and update or drop the fork.",
                    id="quotes.E001",
                )
            )
    return errors


# -- 2. WhiteNoise with an async entry ----------------------------------------------------------


class StaticFilesMiddleware(whitenoise_middleware.WhiteNoiseMiddleware):
    """WhiteNoise (its file finding, compression negotiation and caching headers), but only
    requests under STATIC_URL touch a thread; everything else passes straight through on the
    event loop."""

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


# -- 3. daphne's WebSocket close codes ----------------------------------------------------------

#: Close codes a server sends of its own accord (IANA's registry): going away, policy violation,
#: message too big, internal error, service restart, try again later.
SERVER_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011, 1012, 1013})


class ServerCloseCodesProtocol(daphne_ws.WebSocketProtocol):
    """daphne's WebSocket protocol, sending the close codes of SERVER_CLOSE_CODES as they are
    instead of through autobahn's `sendClose()`, which refuses them."""

    def serverClose(self, code: int | None = None) -> None:
        if code in SERVER_CLOSE_CODES:
            self.sendCloseFrame(code=code, isReply=False)
        else:
            super().serverClose(code)


def use_server_close_codes(server: Server) -> None:
    """From daphne's `ready_callable`: `Server.run()` has made its WebSocket factory by then,
    and no connection has come in yet."""
    server.ws_factory.protocol = ServerCloseCodesProtocol


# -- 4. The start-up heap out of the collector's full passes -------------------------------------

#: The interpreter (major, minor) the freeze's gain was measured on: CPython 3.12 and 3.13 changed
#: the collector's thresholds, and 3.14's is incremental (quotes.W002 says when it differs).
PYTHON = (3, 11)


def freeze_startup_heap() -> None:
    """At the end of config.asgi, once Django, the URLconf and every module are loaded: what is
    left lives as long as the process, so the collector's full passes need not walk it again.
    Frozen objects are still freed by reference counting; only the collector's scans skip them."""
    gc.collect()
    gc.freeze()


# -- 5. A request made before Django's handler --------------------------------------------------


def asgi_request(scope: dict[str, Any], body: bytes) -> HttpRequest:
    """The HttpRequest Django's ASGI handler would make of `scope` and its whole `body`."""
    return ASGIRequest(scope, io.BytesIO(body))


def asgi_scope(request: HttpRequest) -> Mapping[str, Any]:
    """The ASGI scope `request` was made from (empty for a request made another way)."""
    return request.scope if isinstance(request, ASGIRequest) else {}


# -- the pins ------------------------------------------------------------------------------------

#: The upstream code each piece relies on (its source's SHA-256; quotes.W002, tests/deploy/test_forks.py).
#: When one changes, read the new code, check the piece still holds (or is still needed), then
#: update the hash here.
# -- redis-py clients whose event loop is gone ------------------------------------------------------
#
# Not a speed-up: the Redis clients of the stream core (quotes.ai.gateway.redis_clients) are bound
# to an event loop, and a loop that ends without closing them (a test's per-request loop under
# async_to_sync, `manage.py quote`'s asyncio.run) leaves sockets that redis-py cannot close any
# more (its disconnect() awaits the writer on that loop), and that warn at garbage collection.
# daphne's one loop never ends so.


def close_redis_clients_without_their_loop(clients: list[Any]) -> None:
    """Close the sockets of redis-py asyncio clients whose loop is closed, and leave their
    transports as closed ones would be (marked closing, no socket), so nothing warns."""
    for client in clients:
        pool = client.connection_pool
        for connection in [*pool._available_connections, *pool._in_use_connections]:
            writer = connection._writer
            connection._writer = connection._reader = None
            if writer is not None:
                _close_transport_without_loop(writer.transport)


def _close_transport_without_loop(transport: Any) -> None:
    # close() marks the transport closing, then fails where it schedules connection_lost on the
    # closed loop: that callback would only tell a protocol nobody reads any more.
    with contextlib.suppress(RuntimeError):
        transport.close()
    sock = getattr(transport, "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
        transport._sock = None


PINS: dict[str, str] = {
    # 1: what inline_acall / session_acall replace, and the methods they call on the loop.
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
    # 2: what StaticFilesMiddleware overrides or reads.
    "whitenoise.middleware.WhiteNoiseMiddleware.__init__": "3a5a52074a3bbd1ca2e17feea2bb6676f2cb0171675bab5545c1385a52e098a6",
    "whitenoise.middleware.WhiteNoiseMiddleware.__call__": "538b06958308b801b205f7495dd97176dbf4e6f93ed8a3cf495b4b8e631ff73a",
    "whitenoise.middleware.WhiteNoiseMiddleware.serve": "5858d32edfbb9db21ccab8dfa22a0062c13e99c41b7b112bfb271fccdd7a8d45",
    "whitenoise.base.WhiteNoise.add_files": "dfbe7beb6dac6c00882da25ac2b2620fe24d2c37b1757a75ec611fdf22fc5ba0",
    "whitenoise.base.WhiteNoise.find_file": "f338d02358b615c58f14532918be3b6f78b3c7d53394acfbac8b64a61099dd45",
    "whitenoise.responders.StaticFile.get_response": "eae5fa4bd64d991dfe4a1e61e46668a4ccb4243bedf4acf9bae99f88749b0e5c",
    # 3: daphne's close, autobahn's refusal of server codes, the frame we send instead, and
    # where daphne makes its WebSocket factory (before it calls ready_callable).
    "daphne.ws_protocol.WebSocketProtocol.serverClose": "8302150efac698d62de45c277e79a177c67ae5ea3c4f437064000bbdb6545a7b",
    "daphne.server.Server.run": "447c6bd42c62e98cda21fbd603a045ff72abbccabd2b234d8b40c18d366cb7db",
    "autobahn.websocket.protocol.WebSocketProtocol.sendClose": "6ccfd325e62723095869fe62379a4a7ef1d1ebff86a8381c402bb6f40251764b",
    "autobahn.websocket.protocol.WebSocketProtocol.sendCloseFrame": "a511406d6b0d711e81f5067e322de0f628437b9f9dac0c74a001bc19c482b9fc",
    # 5: how asgi_request's ASGIRequest reads the scope and the body.
    "django.core.handlers.asgi.ASGIRequest.__init__": "5ff1464df4bf995e78cfc6ca2590fe9166c6565dee93a37020dba88f2c9c7bc0",
    # close_redis_clients_without_their_loop: the pool's connection lists and a connection's
    # _writer/_reader (what disconnect() uses), asyncio's selector transport's _sock.
    "redis.asyncio.connection.ConnectionPool.disconnect": "16fe6bc22d97481216a032996ce8d1f81b5880793b0379fab8126a78bfb922fc",
    "redis.asyncio.connection.AbstractConnection.disconnect": "11194f01c2f6d3c2e23f187f73d0bfeea24109a6a5b85a20454ea4abd2c388b9",
    "asyncio.selector_events._SelectorTransport.close": "92ff882936b07fb4b0e71b039f0d2f32f060ef0fe150ef574bf17357040110f2",
    "asyncio.selector_events._SelectorTransport.__del__": "831509cbecbc4ddfd32b4d6e30e738996cae8dd8da786eb93c2a7085bf67889b",
}


def source_hash(dotted: str) -> str:
    """The SHA-256 of the source of the function named `dotted` (a module's, or a class's)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return hashlib.sha256(inspect.getsource(inspect.unwrap(target)).encode()).hexdigest()
    raise ImportError(f"no module in {dotted!r}")


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
