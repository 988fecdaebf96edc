"""quotes.forks: the upstream code each fork relies on is pinned, Django's middleware really run
on the event loop, and the app's system checks catch a replacement that no longer does what
Django's own code does."""

from __future__ import annotations

import gc
import re
import threading
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.checks.registry import registry
from django.http import HttpRequest, HttpResponseBase
from django.middleware import clickjacking, csrf, security
from django.test import AsyncClient
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

from quotes import forks
from tests.asgi import AsgiStream, request


@pytest.mark.unit
def test_the_upstream_code_each_fork_relies_on_is_unchanged() -> None:
    """Fails when an upgrade of Django, django-csp, daphne or autobahn changes a
    function a fork replaces, overrides or calls: read the new code, check the fork still holds
    (or is still needed: docs/benchmarks.md, "The forks"), then update forks.PINS."""
    assert forks.changed_pins() == {}


@pytest.mark.unit
def test_a_changed_pin_is_reported_by_the_test_and_the_system_check(monkeypatch: pytest.MonkeyPatch) -> None:
    dotted = "django.utils.deprecation.MiddlewareMixin.__acall__"
    monkeypatch.setitem(forks.PINS, dotted, "0" * 64)  # as if Django's code had changed under it

    assert forks.changed_pins() == {dotted: forks.source_hash(dotted)}
    [warning] = forks.check_pins()
    assert warning.id == "quotes.W002" and dotted in warning.msg


@pytest.mark.unit
def test_another_python_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The freeze's gain was measured on one interpreter's collector."""
    monkeypatch.setattr(forks, "PYTHON", (3, 99))
    assert "python" in forks.changed_pins()


@pytest.mark.integration
def test_the_served_app_freezes_its_start_up_heap() -> None:
    import config.asgi  # noqa: F401  (the app as daphne loads it)

    assert gc.get_freeze_count() > 0


@pytest.mark.unit
def test_source_hash_follows_the_source() -> None:
    assert forks.source_hash("quotes.forks.inline_acall") != forks.source_hash("quotes.forks.steps_aside")
    with pytest.raises(AttributeError):
        forks.source_hash("quotes.forks.no_such_function")


@pytest.mark.unit
def test_every_middleware_runs_on_the_event_loop() -> None:
    """A sync-capable MiddlewareMixin that is not inlined would cost two thread hops a request,
    the SSE stream's included."""
    for dotted in settings.MIDDLEWARE:
        cls = import_string(dotted)
        async_only = getattr(cls, "async_capable", False) and not getattr(cls, "sync_capable", True)
        # Sync- and async-capable, and not Django's MiddlewareMixin (whose async path hops to a
        # thread per method): under ASGI Django runs it as a coroutine (django-axes').
        dual = getattr(cls, "async_capable", False) and not issubclass(cls, MiddlewareMixin)
        inlined = cls in forks.INLINED and cls.__acall__ is forks.inline_acall
        assert inlined or async_only or dual, dotted


@pytest.mark.integration
@pytest.mark.django_db
async def test_djangos_middleware_methods_run_on_the_event_loops_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real ASGI app: Django's own middleware's methods run on the thread of the
    event loop, not on the request's thread (what MiddlewareMixin.__acall__ does)."""
    seen: dict[str, str] = {}

    def recording(cls: type[Any], method: str) -> None:
        original = getattr(cls, method)

        def record(self: Any, *args: Any) -> Any:
            seen[f"{cls.__name__}.{method}"] = threading.current_thread().name
            return original(self, *args)

        monkeypatch.setattr(cls, method, record)

    recording(security.SecurityMiddleware, "process_request")
    recording(SessionMiddleware, "process_response")
    recording(csrf.CsrfViewMiddleware, "process_response")
    recording(clickjacking.XFrameOptionsMiddleware, "process_response")
    page = AsgiStream("GET", "/")
    response = await page.start()
    await page.read_all()

    assert response.status == 200
    assert response.headers["x-frame-options"] == "DENY"
    assert seen and set(seen.values()) == {threading.current_thread().name}, seen


@pytest.mark.integration
def test_the_inline_middleware_check_passes_on_this_app() -> None:
    assert forks.check_inline_middleware() == []


@pytest.mark.unit
async def test_the_inline_middleware_check_says_so_when_it_cannot_compare() -> None:
    """Inside an event loop async_to_sync cannot drive the two chains: no silent pass."""
    [info] = forks.check_inline_middleware()
    assert info.id == "quotes.I001"


@pytest.mark.unit
def test_the_inline_middleware_check_catches_middleware_left_to_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(security.SecurityMiddleware, "__acall__", MiddlewareMixin.__acall__)

    [error] = forks.check_inline_middleware()
    assert error.id == "quotes.E001" and "SecurityMiddleware is not run inline" in error.msg


@pytest.mark.integration
def test_the_inline_middleware_check_catches_a_replacement_that_does_not_do_what_djangos_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replacement that forgot process_response: the security headers go missing, and the
    check compares what comes out of the chain either way."""

    async def forgetful(self: Any, request: HttpRequest) -> HttpResponseBase:
        return (self.process_request(request) if hasattr(self, "process_request") else None) or (
            await self.get_response(request)
        )

    for cls in forks.INLINED:
        if cls.__acall__ is forks.inline_acall:
            monkeypatch.setattr(cls, "__acall__", forgetful)
    monkeypatch.setattr(forks, "inline_acall", forgetful)

    errors = forks.check_inline_middleware()
    assert errors and {e.id for e in errors} == {"quotes.E001"}
    assert "differently inline than through Django's MiddlewareMixin.__acall__" in errors[0].msg


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_signed_in_pages_work_with_the_csrf_secret_in_the_session(settings: Any) -> None:
    """Issue 29, point 5: with CSRF_USE_SESSIONS, CSRF's middleware reads and writes the session
    (the database); run on the event loop it raised SynchronousOnlyOperation, and every signed-in
    page answered 500. It keeps Django's thread hops then, and a form's token works."""
    settings.CSRF_USE_SESSIONS = True
    user = await User.objects.acreate_superuser("boss", "boss@example.com", "boss-password-123")
    browser = AsyncClient()
    await browser.aforce_login(user)
    cookie = {"cookie": f"sessionid={browser.cookies['sessionid'].value}"}

    assert (await request("GET", "/admin/", headers=cookie)).status == 200
    form = await request("GET", "/admin/password_change/", headers=cookie)
    assert form.status == 200 and "csrftoken" not in form.headers.get("set-cookie", "")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.body.decode())
    assert token
    posted = {**cookie, "content-type": "application/x-www-form-urlencoded"}
    forged = await request("POST", "/admin/logout/", body=b"csrfmiddlewaretoken=" + b"a" * 64, headers=posted)
    logout = await request(
        "POST", "/admin/logout/", body=f"csrfmiddlewaretoken={token[1]}".encode(), headers=posted
    )

    assert forged.status == 403
    assert logout.status == 200 and b"Logged out" in logout.body
    assert (await request("GET", "/admin/", headers=cookie)).status == 302  # the session is gone


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CSRF_USE_SESSIONS", True),
        ("MESSAGE_STORAGE", "django.contrib.messages.storage.session.SessionStorage"),
    ],
)
def test_the_inline_middleware_check_catches_a_fork_that_touches_the_session_on_the_loop(
    settings: Any, monkeypatch: pytest.MonkeyPatch, name: str, value: object
) -> None:
    """The check's requests carry a session cookie: a middleware that loads the session inline
    (CSRF's secret, or messages stored there, without stepping aside) comes out differently."""
    setattr(settings, name, value)
    assert forks.check_inline_middleware() == []
    monkeypatch.setattr(forks, "steps_aside", lambda middleware: False)

    errors = forks.check_inline_middleware()
    assert errors and {e.id for e in errors} == {"quotes.E001"}
    assert "SynchronousOnlyOperation" in errors[0].msg


@pytest.mark.unit
def test_the_checks_are_registered() -> None:
    registered = registry.get_checks(include_deployment_checks=True)
    assert forks.check_inline_middleware in registered and forks.check_pins in registered
