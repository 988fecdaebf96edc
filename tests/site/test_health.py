"""GET /healthz through the ASGI app: the database, the cache, the backend and the row writer;
details for staff only."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.test import Client

from quotes.backends import get_backend
from tests.asgi import request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


async def session_of(*, is_staff: bool) -> dict[str, str]:
    """A logged-in user's session cookie, as a header."""

    def login() -> str:
        client, name = Client(), "staff" if is_staff else "member"
        client.force_login(User.objects.create_user(name, password="a-long-password-42", is_staff=is_staff))
        return client.cookies["sessionid"].value

    return {"cookie": f"sessionid={await sync_to_async(login)()}"}


def cache_down(settings: Any) -> None:
    # A Redis cache on a port nothing listens on (port 9 is "discard", closed here).
    down = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": "redis://127.0.0.1:9/0"}
    settings.CACHES = {**settings.CACHES, "default": {**down, "OPTIONS": {"socket_connect_timeout": 0.5}}}


@pytest.mark.services
async def test_healthz_reports_ok_with_each_check_for_staff() -> None:
    response = await request("GET", "/healthz", headers=await session_of(is_staff=True))

    assert response.status == 200 and response.headers["cache-control"] == "no-store"
    body, loaded = response.json(), get_backend("local").loaded  # type: ignore[attr-defined]
    assert body["status"] == "ok" and set(body["checks"]) == {"database", "cache", "backend", "log"}
    assert [body["checks"][name]["status"] for name in ("database", "cache", "log")] == ["ok"] * 3
    check = body["checks"]["backend"]
    assert (check["status"], check["backend"]) == ("ok" if loaded else "loading", "local")
    assert body["checks"]["log"]["waiting"] == 0


async def test_healthz_workers_ai_is_ready_when_configured(workers_ai_settings: Any) -> None:
    response = await request("GET", "/healthz", headers=await session_of(is_staff=True))

    check = response.json()["checks"]["backend"]
    assert (check["status"], check["backend"]) == ("ok", "workers-ai")


@pytest.mark.services
async def test_healthz_is_degraded_not_down_when_the_cache_is_down(settings: Any) -> None:
    """While Redis is down the process serves on its own: /healthz must not take it out of
    rotation (200, "degraded", with the detail)."""
    cache_down(settings)

    response = await request("GET", "/healthz", headers=await session_of(is_staff=True))

    body = response.json()
    assert response.status == 200 and body["status"] == "degraded"
    assert body["checks"]["database"]["status"] == "ok" and body["checks"]["cache"]["status"] == "failing"
    assert "ConnectionError" in body["checks"]["cache"]["detail"]


@pytest.mark.parametrize("who", ["anonymous", "member", "anyone under DEBUG"])
async def test_healthz_503_shows_its_detail_to_staff_or_under_debug_only(
    settings: Any, caplog: pytest.LogCaptureFixture, who: str
) -> None:
    """Exception text and configuration are for staff (or DEBUG); a visitor, or a logged-in user
    who is not staff, gets each check's status only, and the detail goes to the log."""
    import config.asgi  # noqa: F401  (its logging set-up would drop caplog's handler)

    headers = await session_of(is_staff=False) if who == "member" else {}
    cache_down(settings)
    settings.AI_BACKEND, settings.OPENAI_BASE_URL, settings.DEBUG = "openai", "", who.endswith("DEBUG")

    response = await request("GET", "/healthz", headers=headers)

    assert response.status == 503
    body = response.json()
    statuses = {name: check["status"] for name, check in body["checks"].items()}
    assert statuses == {"database": "ok", "cache": "failing", "backend": "error", "log": "ok"}
    assert body["status"] == "error"
    if settings.DEBUG:
        assert body["checks"]["backend"]["detail"] == "not configured: OPENAI_BASE_URL"
    else:
        assert all(set(check) == {"status"} for check in body["checks"].values())
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "quotes.ops.health")
    assert "OPENAI_BASE_URL" in logged


async def test_healthz_is_not_redirected_to_https(settings: Any) -> None:
    """Load balancers call it over plain HTTP on the process's port, under SECURE_SSL_REDIRECT."""
    from django.http import HttpRequest, HttpResponse
    from django.middleware.security import SecurityMiddleware
    from django.test import RequestFactory

    settings.SECURE_SSL_REDIRECT = True

    async def ok(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    middleware = SecurityMiddleware(ok)  # reads the settings when made, as the app's does at start
    assert (await middleware(RequestFactory().get("/healthz"))).status_code == 200
    assert (await middleware(RequestFactory().get("/"))).status_code == 301
