"""The naive Django proxy: one async view that opens an httpx stream to the upstream and yields
its `aiter_raw()` chunks into a StreamingHttpResponse. No parsing, no database: the cheapest thing
Django + httpx + daphne can do with a stream, and so the baseline rows of bench/proxy_overhead.py
and bench/load.py, bare (settings.py, these urlpatterns) and under the app's own stack
(stack_settings.py). The upstream comes from the environment, set by the benchmark that starts
it: BENCH_UPSTREAM_URL (the full URL to POST to) and BENCH_UPSTREAM_HEADERS (a JSON object)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import httpx
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

UPSTREAM_URL = os.environ.get("BENCH_UPSTREAM_URL", "")
UPSTREAM_HEADERS: dict[str, str] = json.loads(os.environ.get("BENCH_UPSTREAM_HEADERS", "{}"))

_client: httpx.AsyncClient | None = None


def client() -> httpx.AsyncClient:
    global _client
    if _client is None:
        # As many upstream connections as open streams (the app gets AI_MAX_CONNECTIONS).
        _client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
            trust_env=False,
        )
    return _client


@csrf_exempt
async def proxy(request: HttpRequest) -> StreamingHttpResponse:
    upstream = client().build_request("POST", UPSTREAM_URL, content=request.body, headers=UPSTREAM_HEADERS)
    response = await client().send(upstream, stream=True)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    return StreamingHttpResponse(
        body(),
        status=response.status_code,
        content_type=response.headers.get("content-type", "text/event-stream"),
        headers={"Cache-Control": "no-cache"},
    )


async def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [path("api/quotes/stream", proxy), path("healthz", healthz)]
