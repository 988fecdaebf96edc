"""quotes.forks: the upstream code each fork relies on is pinned, Django's middleware really run
on the event loop, and the app's system checks catch a replacement that no longer does what
Django's own code does."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
from django.conf import settings
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.checks.registry import registry
from django.http import HttpRequest, HttpResponseBase
from django.middleware import clickjacking, csrf, security
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

from quotes import forks
from tests.asgi import AsgiStream


def test_the_upstream_code_each_fork_relies_on_is_unchanged() -> None:
    """Fails when an upgrade of Django, django-csp, WhiteNoise, daphne or autobahn changes a
    function a fork replaces, overrides or calls: read the new code, check the fork still holds
    (or is still needed: docs/benchmarks.md, "The forks"), then update forks.PINS."""
    assert forks.changed_pins() == {}


def test_a_changed_pin_is_reported_by_the_test_and_the_system_check(monkeypatch: pytest.MonkeyPatch) -> None:
    dotted = "django.utils.deprecation.MiddlewareMixin.__acall__"
    monkeypatch.setitem(forks.PINS, dotted, "0" * 64)  # as if Django's code had changed under it

    assert forks.changed_pins() == {dotted: forks.source_hash(dotted)}
    [warning] = forks.check_pins()
    assert warning.id == "quotes.W002" and dotted in warning.msg


def test_another_python_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The freeze's gain was measured on one interpreter's collector."""
    monkeypatch.setattr(forks, "PYTHON", (3, 99))
    assert "python" in forks.changed_pins()


def test_the_served_app_freezes_its_start_up_heap() -> None:
    import config.asgi  # noqa: F401  (the app as daphne loads it)

    assert gc.get_freeze_count() > 0


def test_source_hash_follows_the_source() -> None:
    assert forks.source_hash("quotes.forks.inline_acall") != forks.source_hash("quotes.forks.session_acall")
    with pytest.raises(AttributeError):
        forks.source_hash("quotes.forks.no_such_function")


def test_every_middleware_runs_on_the_event_loop() -> None:
    """A sync-capable MiddlewareMixin that is not inlined would cost two thread hops a request,
    the SSE stream's included."""
    for dotted in settings.MIDDLEWARE:
        cls = import_string(dotted)
        async_only = getattr(cls, "async_capable", False) and not getattr(cls, "sync_capable", True)
        # Sync- and async-capable, and not Django's MiddlewareMixin (whose async path hops to a
        # thread per method): under ASGI Django runs it as a coroutine (django-axes').
        dual = getattr(cls, "async_capable", False) and not issubclass(cls, MiddlewareMixin)
        inlined = cls in forks.INLINED and cls.__acall__ in (forks.inline_acall, forks.session_acall)
        assert inlined or async_only or dual, dotted


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
    recording(csrf.CsrfViewMiddleware, "_accept")  # process_view's, for a GET
    page = AsgiStream("GET", "/")
    response = await page.start()
    await page.read_all()

    assert response.status == 200
    assert response.headers["x-frame-options"] == "DENY"
    assert seen and set(seen.values()) == {threading.current_thread().name}, seen


def test_the_inline_middleware_check_passes_on_this_app() -> None:
    assert forks.check_inline_middleware() == []


async def test_the_inline_middleware_check_says_so_when_it_cannot_compare() -> None:
    """Inside an event loop async_to_sync cannot drive the two chains: no silent pass."""
    [info] = forks.check_inline_middleware()
    assert info.id == "quotes.I001"


def test_the_inline_middleware_check_catches_middleware_left_to_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(security.SecurityMiddleware, "__acall__", MiddlewareMixin.__acall__)

    [error] = forks.check_inline_middleware()
    assert error.id == "quotes.E001" and "SecurityMiddleware is not run inline" in error.msg


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


def test_the_checks_are_registered() -> None:
    registered = registry.get_checks(include_deployment_checks=True)
    assert forks.check_inline_middleware in registered and forks.check_pins in registered
