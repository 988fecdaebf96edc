"""The site on AI_BACKEND=workers-ai, in chromium, against the fake Workers AI upstream: directly
and through AI Gateway, daphne in a subprocess, the fake in this process."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from harness.daphne import wait_for
from harness.workers_ai import FakeWorkersAI, Scenario

from .conftest import (
    ACCOUNT_ID,
    API_TOKEN,
    RECORDER,
    DaphneServer,
    assert_streamed_in_steps,
    start_daphne,
    watch_console,
    workers_ai_env,
)

pytestmark = pytest.mark.system

MODEL = "@cf/meta/llama-3.1-8b-instruct"
MODEL_URL = "https://developers.cloudflare.com/workers-ai/models/llama-3.1-8b-instruct/"
#: Secret-looking credentials the site is started with (API_TOKEN in tests/browser/conftest.py):
#: they must never reach a page.
GATEWAY_TOKEN = "cfgw_BROWSER-7e6d5c4b3a2918f7e6d5c4b3a2918f70RR"
SECRETS = (API_TOKEN, GATEWAY_TOKEN)

#: No token ends in "c" or "cf": those are held back until the next one (they could start a token).
QUOTE_TOKENS = (
    "The",
    " work",
    " you",
    " do",
    " is",
    " the",
    " play",
    " you",
    " have",
    " not",
    " yet",
    " noticed",
    ".",
)
QUOTE = "".join(QUOTE_TOKENS)
SLOW = Scenario(tokens=QUOTE_TOKENS, token_delay_s=0.05, headers={"cf-aig-log-id": "log-browser"})


def _not_http_status_logs(problems: list[str], status: int) -> list[str]:
    """Console errors other than the browser's own log line for a `status` response."""
    return [p for p in problems if f"status of {status}" not in p]


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, where
        assert secret[:16] not in text, where


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI() as fake:
        yield fake


@pytest.fixture
def fake(fake_upstream: FakeWorkersAI) -> Iterator[FakeWorkersAI]:
    """The module's fake, reset, answering every unscripted request with a slow quote."""
    fake_upstream.reset()
    fake_upstream.default = SLOW
    yield fake_upstream
    fake_upstream.reset()


@pytest.fixture(scope="module")
def direct_site(
    fake_upstream: FakeWorkersAI, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaphneServer]:
    with start_daphne(
        tmp_path_factory.mktemp("daphne-workers-ai"), **workers_ai_env(fake_upstream)
    ) as server:
        yield server


@pytest.fixture(scope="module")
def gateway_site(
    fake_upstream: FakeWorkersAI, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaphneServer]:
    env = {
        **workers_ai_env(fake_upstream),
        "AI_GATEWAY_ID": "gw-browser",
        "AI_GATEWAY_BASE_URL": fake_upstream.gateway_base_url,
        "AI_GATEWAY_TOKEN": GATEWAY_TOKEN,
        "AI_GATEWAY_CACHE_TTL": "3600",
    }
    with start_daphne(tmp_path_factory.mktemp("daphne-workers-ai-gateway"), **env) as server:
        yield server


@pytest.fixture(params=["direct", "gateway"])
def site(request: pytest.FixtureRequest) -> DaphneServer:
    return request.getfixturevalue(f"{request.param}_site")


def open_persona(page: Page, site: DaphneServer, transport: str = "htmx") -> None:
    """Open the page, which starts a quote at once."""
    query = "?transport=fetch" if transport == "fetch" else ""
    page.goto(f"{site.url}/personas/alan-watts/{query}")
    expect(page.locator("form[data-ready=true]")).to_have_count(1)


def rows_of(site: DaphneServer) -> list[tuple[object, ...]]:
    """The log's rows, the newest first."""
    return site.query(
        "SELECT backend, model, status, error_code, text FROM quotes_generation ORDER BY id DESC"
    )


def last_row(site: DaphneServer) -> tuple[object, ...]:
    rows = rows_of(site)
    assert rows, "no Generation row"
    return rows[0]


def test_workers_ai_site_streams_a_quote_token_by_token(
    site: DaphneServer, fake: FakeWorkersAI, page: Page
) -> None:
    problems = watch_console(page)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.add_init_script(RECORDER)
    open_persona(page, site)

    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "streaming")
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)

    assert_streamed_in_steps(page.evaluate("window.__changes"), 5)
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)

    credit = page.get_by_test_id("credit")
    expect(credit).to_be_visible()
    expect(credit).to_contain_text(f"{MODEL} as Alan Watts")
    link = page.get_by_test_id("model-link")
    expect(link).to_have_text(MODEL)
    expect(link).to_have_attribute("href", MODEL_URL)
    expect(page.get_by_test_id("model-note-link")).to_have_attribute("href", MODEL_URL)

    assert last_row(site) == ("workers-ai", MODEL, "ok", "", QUOTE)
    [upstream] = fake.requests
    assert upstream.headers["authorization"] == f"Bearer {API_TOKEN}"
    if upstream.route == "gateway":
        assert upstream.path == f"/gateway/v1/{ACCOUNT_ID}/gw-browser/workers-ai/{MODEL}"
        assert upstream.headers["cf-aig-authorization"] == f"Bearer {GATEWAY_TOKEN}"
        assert upstream.headers["cf-aig-cache-ttl"] == "3600"
    else:
        assert upstream.path == f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{MODEL}"
        assert not [name for name in upstream.headers if name.startswith("cf-aig-")]
    assert_no_secret(page.content(), "page HTML")
    assert problems == []


def test_workers_ai_site_screenshot(
    direct_site: DaphneServer, fake: FakeWorkersAI, page: Page, screenshot_dir: Path
) -> None:
    page.set_viewport_size({"width": 1280, "height": 800})
    open_persona(page, direct_site)
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)
    path = screenshot_dir / "workers-ai-desktop.png"
    page.screenshot(path=path)
    assert path.stat().st_size > 10_000


def test_workers_ai_site_never_shows_a_token(site: DaphneServer, fake: FakeWorkersAI, page: Page) -> None:
    for path in ("/", "/personas/alan-watts/"):
        with urllib.request.urlopen(site.url + path, timeout=10) as response:
            assert_no_secret(response.read().decode(), f"HTML of {path}")
    # An upstream that echoes our request headers back as the quote.
    fake.script(Scenario(echo_headers=True, token_delay_s=0.01))
    open_persona(page, site)
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)

    expect(page.get_by_test_id("quote-text")).to_contain_text("authorization: Bearer [redacted]")
    assert_no_secret(page.content(), "page HTML after the quote")
    assert_no_secret(str(last_row(site)), "Generation row")


def test_workers_ai_site_shows_a_readable_error_before_the_stream(
    site: DaphneServer, fake: FakeWorkersAI, page: Page
) -> None:
    problems = watch_console(page)
    fake.script(Scenario.out_of_capacity())
    open_persona(page, site)

    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "error")
    error = page.get_by_test_id("error")
    expect(error).to_be_visible()
    expect(page.get_by_test_id("error-message")).to_contain_text("out of capacity right now")
    expect(page.get_by_test_id("loading")).to_be_hidden()
    expect(page.get_by_test_id("quote")).to_be_hidden()
    expect(page.get_by_test_id("retry")).to_be_visible()
    assert last_row(site)[2:4] == ("error", "upstream_capacity")
    # The browser logs the 429 response itself; nothing else may have gone wrong.
    assert _not_http_status_logs(problems, 429) == []

    # Retry once the model has capacity again: the quote streams.
    page.get_by_test_id("retry").click()
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    expect(error).to_be_hidden()


def test_workers_ai_site_shows_connection_lost_when_the_upstream_drops(
    site: DaphneServer, fake: FakeWorkersAI, page: Page
) -> None:
    problems = watch_console(page)
    fake.script(Scenario(tokens=QUOTE_TOKENS, token_delay_s=0.05, drop_after_tokens=4))
    open_persona(page, site)

    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "error", timeout=15_000)
    expect(page.get_by_test_id("error")).to_be_visible()
    message = page.get_by_test_id("error-message")
    expect(message).to_contain_text("connection")
    expect(message).to_contain_text("lost")
    expect(page.get_by_test_id("retry")).to_be_visible()
    # The words that did arrive stay on the card.
    partial = "".join(QUOTE_TOKENS[:4])
    expect(page.get_by_test_id("quote")).to_be_visible()
    expect(page.get_by_test_id("quote-text")).to_have_text(partial)
    expect(page.get_by_test_id("credit")).to_be_hidden()
    assert last_row(site)[2:] == ("error", "upstream_dropped", partial)
    assert problems == []

    page.get_by_test_id("retry").click()
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    assert problems == []


@pytest.mark.parametrize("transport", ["htmx", "fetch"])
def test_workers_ai_site_stop_cancels_the_upstream_and_logs_cancelled(
    direct_site: DaphneServer, fake: FakeWorkersAI, page: Page, transport: str
) -> None:
    problems = watch_console(page)
    ticks = Scenario(tokens=["tick "] * 400, token_delay_s=0.05)
    fake.script(ticks)
    open_persona(page, direct_site, transport)
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "streaming")
    expect(page.get_by_test_id("quote-text")).to_contain_text("tick tick")  # visible, stream still open

    page.get_by_test_id("stop").click()

    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "stopped")
    expect(page.get_by_test_id("stopped")).to_be_visible()
    # The quote's own upstream call (a late request of an earlier test's may come after it).
    [upstream] = [request for request in fake.requests if request.scenario is ticks]
    assert upstream.client_disconnected.wait(5), [(r.received_at, r.scenario) for r in fake.requests]
    wait_for(lambda: (rows_of(direct_site) or [("",)])[0][2:3] == ("cancelled",), "the row says cancelled")
    row = last_row(direct_site)
    assert (row[2], row[3]) == ("cancelled", "stopped")  # the stop endpoint, not a drop
    assert str(row[4]).startswith("tick tick") and len(str(row[4])) < 5 * 400
    # Escape works as well as the button, and a new quote can be written after a stop.
    fake.script(Scenario(tokens=QUOTE_TOKENS, token_delay_s=0.02))
    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    assert problems == []


def test_workers_ai_site_fetch_transport_streams_too(
    direct_site: DaphneServer, fake: FakeWorkersAI, page: Page
) -> None:
    problems = watch_console(page)
    page.add_init_script(RECORDER)
    open_persona(page, direct_site, "fetch")
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=15_000)
    changes = page.evaluate("window.__changes")
    growing = [c["text"] for c in changes if c["state"] == "streaming" and c["text"]]
    assert len(set(growing)) >= 5, growing
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    expect(page.get_by_test_id("model-link")).to_have_attribute("href", MODEL_URL)
    assert problems == []
