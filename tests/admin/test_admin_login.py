"""Admin login throttling: django-axes through the real admin login form, posted by Django's
AsyncClient (the ASGI handler and the whole middleware chain, CSRF enforced)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from axes.models import AccessAttempt
from django.contrib.auth.models import User
from django.test import AsyncClient

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.services]

LOGIN = "/admin/login/"
PASSWORD = "a-long-admin-password-for-tests-42"


class Browser(AsyncClient):
    """A browser at `address` (the ASGI scope's client), with CSRF enforced as a real one is."""

    def __init__(self, address: str) -> None:
        super().__init__(enforce_csrf_checks=True)
        self.address = address

    def _base_scope(self, **request: Any) -> dict[str, Any]:
        scope: dict[str, Any] = super()._base_scope(**request)
        scope["client"] = [self.address, 0]
        return scope


@pytest.fixture(autouse=True)
async def admin(settings: Any) -> User:
    settings.AXES_FAILURE_LIMIT = 3
    return await User.objects.acreate_superuser("boss", "boss@example.com", PASSWORD)


async def log_in(browser: AsyncClient, password: str, path: str = LOGIN, **extra: str) -> Any:
    page = await browser.get(LOGIN)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token, page.content[:500]
    fields = {"username": "boss", "password": password, "next": "/admin/", "csrfmiddlewaretoken": token[1]}
    return await browser.post(path, fields | extra)


async def is_logged_in(browser: AsyncClient) -> bool:
    return (await browser.get("/admin/")).status_code == 200


async def test_admin_login_is_refused_after_n_failures_even_with_the_right_password() -> None:
    browser = Browser("198.51.100.20")

    first_failures = [await log_in(browser, "wrong") for _ in range(2)]
    locking = await log_in(browser, "wrong")
    right_password = await log_in(browser, PASSWORD)

    for response in first_failures:
        assert response.status_code == 200
        assert b"Please enter the correct username and password" in response.content
    for response in (locking, right_password):
        assert response.status_code == 429 and response["content-type"].startswith("text/html")
        page = response.content.decode()
        assert "Too many failed logins" in page and "even with the right password" in page
        assert 0 < int(response["Retry-After"]) <= 15 * 60
    assert not await is_logged_in(browser)

    elsewhere = Browser("198.51.100.21")  # another address is not locked out
    assert (await log_in(elsewhere, PASSWORD)).status_code == 302
    assert await is_logged_in(elsewhere)


async def test_admin_login_lockout_counts_an_ipv6_64_as_one_address() -> None:
    for n in range(1, 4):
        await log_in(Browser(f"2001:db8:9:9::{n}"), "wrong")

    rotated = Browser("2001:db8:9:9::ffff")

    assert (await log_in(rotated, PASSWORD)).status_code == 429
    assert not await is_logged_in(rotated)


async def test_admin_login_success_resets_the_count() -> None:
    browser = Browser("198.51.100.22")
    for _ in range(2):
        await log_in(browser, "wrong")
    assert (await log_in(browser, PASSWORD)).status_code == 302
    await browser.alogout()

    for _ in range(2):
        assert (await log_in(browser, "wrong")).status_code == 200
    assert (await log_in(browser, PASSWORD)).status_code == 302


async def test_login_failures_keep_no_submitted_data_and_the_row_stays_small() -> None:
    """Axes would append every failed login's GET and POST fields to the client's row, during the
    lockout too, and keep the submitted username: the row holds nothing the client sent."""
    browser = Browser("198.51.100.23")
    typed = {"username": "boss-typed-a-secret", "filler": "f" * 2048}

    def row_size() -> int:
        text = ("username", "user_agent", "http_accept", "path_info", "get_data", "post_data")
        [row] = AccessAttempt.objects.filter(ip_address="198.51.100.23").values_list(*text)
        return sum(len(value or "") for value in row)

    path, typo = LOGIN + "?next=/admin/&query-secret=" + "q" * 500, "a-mistyped-secret-password"
    statuses = [(await log_in(browser, typo, path, **typed)).status_code for _ in range(4)]
    after_four = await sync_to_async(row_size)()
    statuses += [(await log_in(browser, typo, path, **typed)).status_code for _ in range(8)]

    assert statuses[:2] == [200, 200] and set(statuses[2:]) == {429}
    row = await AccessAttempt.objects.aget(ip_address="198.51.100.23")
    assert row.failures_since_start == 12
    assert await sync_to_async(row_size)() == after_four < 1024
    stored = " ".join(str(value) for value in (await AccessAttempt.objects.values().aget(pk=row.pk)).values())
    for submitted in (*typed.values(), typo, "query-secret", "csrfmiddlewaretoken"):
        assert submitted[:64] not in stored, submitted
    assert row.get_data == row.post_data == "" and row.username is None


async def test_async_login_works_with_the_throttling_backend() -> None:
    """aauthenticate() asks every backend for aauthenticate; a login from code (no request, no
    client address) is not throttled."""
    browser = AsyncClient()

    assert await browser.alogin(username="boss", password=PASSWORD)
    assert (await browser.get("/admin/")).status_code == 200
