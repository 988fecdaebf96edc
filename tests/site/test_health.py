"""GET /healthz against the ASGI app: database, cache and backend readiness."""

from __future__ import annotations

from typing import Any

import pytest

from quotes.conf import OpenAICompatSettings
from tests.asgi import request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


async def session_of(*, is_staff: bool) -> dict[str, str]:
    """A logged-in user's session cookie, as a header."""
    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import User
    from django.test import Client

    def login() -> str:
        user = User.objects.create_user(
            "staff" if is_staff else "member", password="a-long-test-password-42", is_staff=is_staff
        )
        client = Client()
        client.force_login(user)
        return client.cookies["sessionid"].value

    return {"cookie": f"sessionid={await sync_to_async(login)()}"}


@pytest.fixture
async def staff() -> dict[str, str]:
    return await session_of(is_staff=True)


def cache_down(settings: Any) -> None:
    # A Redis cache on a port nothing listens on (port 9 is "discard", closed here).
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:9/0",
            "OPTIONS": {"socket_connect_timeout": 0.5},
        }
    }


@pytest.mark.services
async def test_healthz_reports_ok_with_each_check(staff: dict[str, str]) -> None:
    response = await request("GET", "/healthz", headers=staff)
    assert response.status == 200
    body = response.json()
    assert body["status"] == "ok"
    assert set(body["checks"]) == {"database", "cache", "backend", "log"}
    assert body["checks"]["log"]["status"] == "ok"
    assert body["checks"]["database"]["status"] == "ok"
    assert body["checks"]["cache"]["status"] == "ok"
    assert body["checks"]["backend"]["status"] in ("ok", "loading")
    assert response.headers["cache-control"] == "no-store"


async def test_healthz_workers_ai_is_ready_when_configured(
    workers_ai_settings: Any, staff: dict[str, str]
) -> None:
    body = (await request("GET", "/healthz", headers=staff)).json()
    assert body["checks"]["backend"] == {
        "status": "ok",
        "backend": "workers-ai",
        "ms": body["checks"]["backend"]["ms"],
    }


@pytest.mark.services
async def test_healthz_is_degraded_not_down_when_the_cache_is_down(
    settings: Any, staff: dict[str, str]
) -> None:
    """Redis is a cache and a coordinator (issue 21): while it is down the process serves on its
    own, so /healthz must not take it out of rotation: 200, "degraded", with the detail."""
    cache_down(settings)
    response = await request("GET", "/healthz", headers=staff)
    assert response.status == 200
    body = response.json()
    assert body["status"] == "degraded"
    assert (
        body["checks"]["cache"]["status"] == "failing"
        and "ConnectionError" in body["checks"]["cache"]["detail"]
    )
    assert body["checks"]["database"]["status"] == "ok"


async def test_healthz_answers_503_when_the_upstream_is_not_configured(settings: Any) -> None:
    settings.AI_BACKEND = "openai"
    settings.OPENAI_COMPAT = OpenAICompatSettings(base_url="", api_key="")
    settings.DEBUG = True  # details for everyone in development
    response = await request("GET", "/healthz")
    assert response.status == 503
    assert response.json()["checks"]["backend"]["detail"] == "not configured: OPENAI_BASE_URL"


async def test_healthz_reports_the_local_model_loaded_or_loading(settings: Any) -> None:
    from quotes.ai.backends import get_backend

    backend: Any = get_backend("local")
    body = (await request("GET", "/healthz")).json()
    assert body["checks"]["backend"]["status"] == ("ok" if backend.loaded else "loading")
    assert body["status"] == "ok"


@pytest.mark.parametrize("who", ["anonymous", "member"])
async def test_healthz_shows_no_detail_to_visitors(
    settings: Any, caplog: pytest.LogCaptureFixture, who: str
) -> None:
    """Exception text and configuration are for staff (or DEBUG); a visitor, or a logged-in
    user who is not staff, gets each check's status only, and the detail goes to the log."""
    import config.asgi  # noqa: F401  (its logging set-up would drop caplog's handler)

    headers = await session_of(is_staff=False) if who == "member" else {}
    cache_down(settings)
    settings.AI_BACKEND = "openai"
    settings.OPENAI_COMPAT = OpenAICompatSettings(base_url="", api_key="")

    response = await request("GET", "/healthz", headers=headers)

    assert response.status == 503
    assert response.json() == {
        "status": "error",
        "checks": {
            "database": {"status": "ok"},
            "cache": {"status": "failing"},
            "backend": {"status": "error"},
            "log": {"status": "ok"},
        },
    }
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "quotes.health")
    assert "OPENAI_BASE_URL" in logged


async def test_healthz_is_not_redirected_to_https(settings: Any) -> None:
    """Load balancers call it over plain HTTP on the process's port, under SECURE_SSL_REDIRECT."""
    from django.http import HttpRequest, HttpResponse
    from django.middleware.security import SecurityMiddleware
    from django.test import RequestFactory

    settings.SECURE_SSL_REDIRECT = True

    async def ok(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    middleware = SecurityMiddleware(ok)  # reads the settings when made
    factory = RequestFactory()
    assert (await middleware(factory.get("/healthz"))).status_code == 200
    assert (await middleware(factory.get("/"))).status_code == 301
