"""`GET /healthz`: can this process serve a quote right now? (docs/deployment.md, section 5.)
"degraded" (200) is what every process shares, Redis or the log's database down: taking them all
out of rotation would turn a degraded site into none.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe
from redis.exceptions import RedisError

from .. import state
from ..admission import DRAINING_RETRY_S, Admission
from ..backends import get_backend
from ..backends.local import LocalBackend
from ..cache import store
from ..models import Persona
from ..rows import REFUSED_SHOWN_S, writer

CHECK_TIMEOUT_S = 3.0

logger = logging.getLogger(__name__)

Check = dict[str, Any]


async def _database() -> Check:
    await Persona.objects.order_by().values("pk")[:1].aexists()
    return {"status": "ok"}


async def _cache() -> Check:
    key = f"healthz:{uuid.uuid4().hex}"
    try:
        await sync_to_async(store().set, thread_sensitive=False)(key, "ok", timeout=30)
        value = await sync_to_async(store().get, thread_sensitive=False)(key)
        await sync_to_async(store().delete, thread_sensitive=False)(key)
    except (RedisError, OSError) as exc:  # the process serves on its own meanwhile
        return {"status": "failing", "detail": f"{type(exc).__name__}: {exc}"[:300]}
    if value != "ok":
        return {"status": "error", "detail": "a value written to the cache did not read back"}
    return {"status": "ok"}


async def _backend() -> Check:
    name = settings.AI_BACKEND
    if name == "local":
        backend = get_backend("local")
        loaded = isinstance(backend, LocalBackend) and backend.loaded
        # Not loaded yet is no failure: the first request loads it and waits.
        return {"status": "ok" if loaded else "loading", "backend": name}
    if name == "workers-ai":
        required: tuple[str, ...] = ("CLOUDFLARE_ACCOUNT_ID", "CLOUDFLARE_API_TOKEN")
    elif name == "openai":
        required = ("OPENAI_BASE_URL",)
    else:
        return {"status": "error", "backend": name, "detail": f"unknown backend {name!r}"}
    missing = [variable for variable in required if not getattr(settings, variable)]
    if missing:
        return {"status": "error", "backend": name, "detail": f"not configured: {', '.join(missing)}"}
    return {"status": "ok", "backend": name}


async def _log_writer() -> Check:
    rows = writer()  # its own state: no query (the database check asks the database)
    if rows.failing:
        return {"status": "failing", "waiting": len(rows.waiting), "detail": rows.failing}
    if rows.refused is not None and time.monotonic() - rows.refused[0] < REFUSED_SHOWN_S:
        return {
            "status": "failing",
            "waiting": len(rows.waiting),
            "detail": f"a row was refused: {rows.refused[1]}",
        }
    return {"status": "ok", "waiting": len(rows.waiting)}


Probe = Callable[[], Awaitable[Check]]
CHECKS: dict[str, Probe] = {"database": _database, "cache": _cache, "backend": _backend, "log": _log_writer}


async def _run(check: Probe) -> Check:
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
    if state.of(Admission).draining:
        return JsonResponse(
            {"status": "draining"},
            status=503,
            headers={"Cache-Control": "no-store", "Retry-After": str(DRAINING_RETRY_S)},
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
