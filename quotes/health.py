"""`GET /healthz`: can this process serve a quote right now?

Checks the database (one trivial query), the cache (a write and a read back) and the AI backend
(the embedded model loaded, or the upstream configured). Answers 200 with
`{"status": "ok", "checks": {...}}`, or 503 with `"status": "error"`, so a load balancer takes
the process out of rotation. Each check is bounded in time.

Anyone may ask, so by default each check says only "ok", "loading" or "error": a failing
check's `detail` (exception text, missing settings), the backend's name and the timings are
shown only to staff and when DEBUG is on, and a failure's detail goes to the log.

The cache's check says "failing" while Redis is down or hung: the process serves on its own
meanwhile (quotes.ai.redis_health), so that too answers 200 "degraded"; a hung Redis costs the
check one socket timeout, then nothing while the breaker is open.

The log writer's check says "failing" while the database takes no log rows (down, or
read-only): the rows wait in the process's outbox (quotes/ai/gateway/rows.py), and staff see how
many. That alone answers 200, with `"status": "degraded"`: every process shares the one
database, so taking them out of rotation for it would turn lost log rows (which the outbox
prevents) into a site that answers nobody. /metrics has the outbox's depth for alerting.

A process that drains (it got SIGTERM: quotes.server) answers 503 `{"status": "draining"}` at
once, without checks: it takes no new streams, so a load balancer (and the rolling restart in
docs/deployment.md) must look elsewhere. Its Retry-After says it is a refusal meant as such (it
is logged at INFO: quotes.logging.ClientErrorFilter), not a failing check.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe
from redis.exceptions import RedisError

from .ai.gateway.admission import DRAINING_RETRY_AFTER_S, drain
from .ai.gateway.rows import writer
from .ai.limits import run_on_cache
from .models import Persona

CHECK_TIMEOUT_S = 3.0

logger = logging.getLogger(__name__)

Check = dict[str, Any]


async def _database() -> Check:
    await Persona.objects.order_by().values("pk")[:1].aexists()
    return {"status": "ok"}


async def _cache() -> Check:
    key = f"healthz:{uuid.uuid4().hex}"
    try:
        await run_on_cache(cache.set, key, "ok", timeout=30)
        value = await run_on_cache(cache.get, key)
        await run_on_cache(cache.delete, key)
    except (RedisError, OSError) as exc:
        # Redis is a cache and a coordinator: without it the process serves on its own
        # (quotes.ai.redis_health), so a load balancer must not take every process out for it.
        return {"status": "failing", "detail": f"{type(exc).__name__}: {exc}"[:300]}
    if value != "ok":
        return {"status": "error", "detail": "a value written to the cache did not read back"}
    return {"status": "ok"}


async def _backend() -> Check:
    name = settings.AI_BACKEND
    if name == "local":
        from .ai.backends import get_backend
        from .ai.backends.local import LocalBackend

        backend = get_backend("local")
        loaded = isinstance(backend, LocalBackend) and backend.loaded
        # Not loaded yet is not a failure: the first request loads it (or LOCAL_MODEL_PRELOAD
        # already is) and waits for it.
        return {"status": "ok" if loaded else "loading", "backend": name}
    if name == "workers-ai":
        missing = [
            variable
            for variable, value in (
                ("CLOUDFLARE_ACCOUNT_ID", settings.WORKERS_AI.account_id),
                ("CLOUDFLARE_API_TOKEN", settings.WORKERS_AI.api_token),
            )
            if not value
        ]
    elif name == "openai":
        missing = [] if settings.OPENAI_COMPAT.base_url else ["OPENAI_BASE_URL"]
    else:
        return {"status": "error", "backend": name, "detail": f"unknown backend {name!r}"}
    if missing:
        return {"status": "error", "backend": name, "detail": f"not configured: {', '.join(missing)}"}
    return {"status": "ok", "backend": name}


async def _log_writer() -> Check:
    # Read from the writer's own state: no query (the database check asks the database).
    if writer.failing:
        return {"status": "failing", "outbox": writer.outbox.depth, "detail": writer.failing}
    return {"status": "ok", "outbox": writer.outbox.depth}


CHECKS: dict[str, Callable[[], Awaitable[Check]]] = {
    "database": _database,
    "cache": _cache,
    "backend": _backend,
    "log": _log_writer,
}


async def _run(check: Callable[[], Awaitable[Check]]) -> Check:
    started = time.perf_counter()
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            result = await check()
    except TimeoutError:
        result = {"status": "error", "detail": f"no answer within {CHECK_TIMEOUT_S:g} s"}
    except Exception as exc:  # a health check reports every failure instead of raising it
        result = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"[:300]}
    result["ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


@require_safe
async def healthz(request: HttpRequest) -> JsonResponse:
    if drain.draining:
        return JsonResponse(
            {"status": "draining"},
            status=503,
            headers={"Cache-Control": "no-store", "Retry-After": str(DRAINING_RETRY_AFTER_S)},
        )
    names = list(CHECKS)
    results = await asyncio.gather(*(_run(CHECKS[name]) for name in names))
    checks = dict(zip(names, results, strict=True))
    healthy = all(check["status"] != "error" for check in checks.values())
    degraded = any(check["status"] == "failing" for check in checks.values())
    for name, check in checks.items():
        if check["status"] == "error":
            logger.warning("healthz: %s check failed: %s", name, check.get("detail", ""))
    if not (settings.DEBUG or await _is_staff(request)):
        checks = {name: {"status": check["status"]} for name, check in checks.items()}
    return JsonResponse(
        {"status": ("degraded" if degraded else "ok") if healthy else "error", "checks": checks},
        status=200 if healthy else 503,
        headers={"Cache-Control": "no-store"},
    )


async def _is_staff(request: HttpRequest) -> bool:
    # Without a session cookie (a load balancer, a monitor) this reads nothing from the database.
    try:
        user = await request.auser()
    except Exception:  # the database may be what is down: then no details, but still an answer
        return False
    return bool(user.is_active and user.is_staff)
