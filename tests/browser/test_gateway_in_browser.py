"""What a visitor sees of the gateway: cached quotes, a fresh one on request, and the limit."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect

from .conftest import DaphneServer, start_daphne

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def cached_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaphneServer]:
    with start_daphne(
        tmp_path_factory.mktemp("daphne-cached"),
        QUOTES_CACHE_TTL="3600",
        QUOTES_RATE_LIMIT="3/h",  # an hour: a minute could turn over mid-test
    ) as server:
        yield server


def wait_quote(page: Page) -> str:
    expect(page.get_by_test_id("quote-card")).to_have_attribute(
        "data-state", re.compile("done|error"), timeout=30_000
    )
    return page.get_by_test_id("quote-text").text_content() or ""


def write_quote(page: Page) -> str:
    page.get_by_test_id("generate").click()
    return wait_quote(page)


def test_browser_cache_fresh_quote_and_rate_limit(cached_site: DaphneServer, page: Page) -> None:
    # Opening the page writes a quote at once.
    page.goto(f"{cached_site.url}/personas/lao-tzu/")
    first = wait_quote(page)
    expect(page.get_by_test_id("cache-note")).to_be_hidden()

    # A visitor who comes back to the page gets the same quote from the cache, and is told so.
    page.reload()
    assert wait_quote(page) == first
    expect(page.get_by_test_id("cache-note")).to_be_visible()

    # "Another quote" asks for a new one: not from the cache.
    expect(page.get_by_test_id("generate")).to_have_text("Another quote")
    write_quote(page)
    expect(page.get_by_test_id("cache-note")).to_be_hidden()
    rows = cached_site.query("SELECT cache_status FROM quotes_generation ORDER BY id")
    assert rows == [("miss",), ("hit",), ("bypass",)]

    # The fourth request in a minute is over the limit (3/m): a readable message and a countdown.
    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("error")).to_contain_text("Try again")
    countdown = page.get_by_test_id("retry-after")
    expect(countdown).to_have_text(re.compile(r"Try again in \d+ s"))
    first_reading = int(re.findall(r"\d+", countdown.text_content() or "")[0])
    page.wait_for_timeout(1500)
    assert int(re.findall(r"\d+", countdown.text_content() or "")[0]) < first_reading
    expect(page.get_by_test_id("generate")).to_be_disabled()
    assert cached_site.query("SELECT status FROM quotes_generation ORDER BY id DESC LIMIT 1") == [
        ("rate_limited",)
    ]
