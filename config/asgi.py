"""ASGI entry point: HTTP through Django's own handler, behind the gate that refuses a stream an
overloaded process cannot take (quotes.gate); WebSocket (/ws/quotes/) through Channels; both
behind the trusted-proxy rule for the client's address; all inside OpenTelemetry's request span
when traces are on (quotes.ops.tracing)."""

from __future__ import annotations

import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()  # sets Django up: the imports below need it

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from quotes.backends import get_backend  # noqa: E402
from quotes.clients import TrustedProxyMiddleware  # noqa: E402
from quotes.consumers import websocket_urlpatterns  # noqa: E402
from quotes.gate import Gate  # noqa: E402
from quotes.ops import tracing  # noqa: E402
from quotes.security import SameOriginWebSocketMiddleware  # noqa: E402

if settings.AI_BACKEND == "local" and settings.LOCAL_MODEL_PRELOAD:
    get_backend()  # starts loading the embedded model on its thread now

application = tracing.instrument(
    TrustedProxyMiddleware(
        ProtocolTypeRouter(
            {
                "http": Gate(django_asgi_app),
                # Only this origin's pages may open a socket, as for the HTTP stream URLs.
                "websocket": SameOriginWebSocketMiddleware(
                    AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
                ),
            }
        )
    )
)

# What is loaded by now lives as long as the process: out of the collector's full passes, each
# of which would stall every open stream.
gc.freeze()
