"""ASGI entry point: HTTP through Django, WebSocket (/ws/quotes/) through Channels."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

# Django must be set up before anything imports models.
djangos_asgi_app = get_asgi_application()

from quotes.request_threads import RequestThreads  # noqa: E402

# Django's handler, with each request's thread leased from a pool and given back once a stream's
# view has answered (quotes/request_threads.py): an open stream holds no thread.
django_asgi_app = RequestThreads(djangos_asgi_app)

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.urls import get_resolver  # noqa: E402

from quotes.ai.backends import get_backend  # noqa: E402
from quotes.consumers import websocket_urlpatterns  # noqa: E402
from quotes.forks import freeze_startup_heap  # noqa: E402
from quotes.middleware import StreamAdmissionGate  # noqa: E402
from quotes.security import SameOriginWebSocketMiddleware, TrustedProxyMiddleware  # noqa: E402

if settings.AI_BACKEND == "local" and settings.LOCAL_MODEL.preload:
    get_backend()  # starts loading the embedded model on its thread now, not on the first request

# The client's address from a trusted proxy's X-Forwarded-For, for HTTP and WebSocket alike
# (QUOTES_TRUSTED_PROXIES); anyone else's forwarded headers are ignored.
application = TrustedProxyMiddleware(
    ProtocolTypeRouter(
        {
            # At the open-stream limit, a new stream is refused before Django's handler.
            "http": StreamAdmissionGate(django_asgi_app),
            # Only this origin's pages may open a socket (the rule of the HTTP stream URLs): a page on
            # another site or a sibling subdomain cannot ride this site's session cookie or spend its quota.
            "websocket": SameOriginWebSocketMiddleware(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
        }
    )
)

# Everything loaded so far (Django, the URLconf and views, every module) lives as long as the
# process: frozen out of the collector's full passes, each of which stalled every open stream
# (quotes/forks.py, with what it buys).
get_resolver().url_patterns  # noqa: B018  (loads the URLconf and the views now, to be frozen too)
freeze_startup_heap()
