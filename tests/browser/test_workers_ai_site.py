"""The site on AI_BACKEND=workers-ai in chromium, the fake Cloudflare (in this process) scripting
each answer: a quote, Stop, an upstream failing before or during the stream, and a spent budget
next to a rate limit."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect

from harness.daphne import ACCOUNT_ID, API_TOKEN, Site, start_site, wait_for, workers_ai_env
from harness.workers_ai import FakeWorkersAI, Scenario

from .conftest import QUOTE, RECORDER, TOKENS, besides, card_state, open_persona, screenshot, streamed

pytestmark = pytest.mark.system

MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
MODEL_URL = "https://developers.cloudflare.com/workers-ai/models/llama-3.1-8b-instruct-fp8/"

TRANSPORTS = pytest.mark.parametrize("transport", ["htmx", "fetch"])


@TRANSPORTS
def test_workers_ai_quote_streams_token_by_token(
    workers_site: Site, fake: FakeWorkersAI, page: Page, problems: list[str], transport: str
) -> None:
    page.add_init_script(RECORDER)
    open_persona(page, workers_site, transport)
    card_state(page, "^done$")
    streamed(page, 5)
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    expect(page.get_by_test_id("credit")).to_contain_text(f"{MODEL} as Alan Watts")
    expect(page.get_by_test_id("model-link")).to_have_attribute("href", MODEL_URL)
    expect(page.get_by_test_id("model-note-link")).to_have_attribute("href", MODEL_URL)
    assert workers_site.last_row("backend, model, text") == ("ok", "workers-ai", MODEL, QUOTE)
    [request] = fake.requests
    assert request.path == f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{MODEL}"
    assert request.headers["authorization"] == f"Bearer {API_TOKEN}"
    assert API_TOKEN[:16] not in page.content()
    assert problems == []


def test_workers_ai_upstream_failures_read_well_and_retry_works(
    workers_site: Site, fake: FakeWorkersAI, page: Page, problems: list[str]
) -> None:
    # Out of capacity before the first token (every attempt): the real status and a readable error.
    fake.script(Scenario.out_of_capacity(), Scenario.out_of_capacity())
    open_persona(page, workers_site)
    card_state(page, "^error$")
    expect(page.get_by_test_id("error-message")).to_contain_text("out of capacity right now")
    expect(page.get_by_test_id("loading")).to_be_hidden()
    expect(page.get_by_test_id("quote")).to_be_hidden()
    assert workers_site.last_row()[:2] == ("error", "upstream_capacity")
    page.get_by_test_id("retry").click()
    card_state(page, "^done$")
    expect(page.get_by_test_id("error")).to_be_hidden()
    assert besides(problems, "status of 429") == []  # the browser logs the 429 itself

    # The upstream drops mid-quote: the words that came stay, and the loss is said.
    fake.script(Scenario(tokens=TOKENS, token_delay_s=0.05, drop_after_tokens=4))
    page.get_by_test_id("generate").click()
    card_state(page, "^error$")
    expect(page.get_by_test_id("error-message")).to_contain_text(re.compile("connection.*lost", re.I))
    expect(page.get_by_test_id("quote-text")).to_have_text("".join(TOKENS[:4]))
    expect(page.get_by_test_id("credit")).to_be_hidden()
    assert workers_site.last_row() == ("error", "upstream_dropped", "".join(TOKENS[:4]))
    page.get_by_test_id("retry").click()
    card_state(page, "^done$")
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    assert besides(problems, "status of 429") == []


@TRANSPORTS
def test_workers_ai_stop_stops_the_upstream_and_logs_cancelled(
    workers_site: Site, fake: FakeWorkersAI, page: Page, problems: list[str], transport: str
) -> None:
    ticks = Scenario(tokens=["tick "] * 400, token_delay_s=0.05)
    fake.script(ticks)
    open_persona(page, workers_site, transport)
    expect(page.get_by_test_id("quote-text")).to_contain_text("tick tick")  # the stream still open
    page.keyboard.press("Escape") if transport == "fetch" else page.get_by_test_id("stop").click()

    card_state(page, "^stopped$")
    expect(page.get_by_test_id("stopped")).to_be_visible()
    [upstream] = [r for r in fake.requests if r.scenario is ticks]
    assert upstream.client_disconnected.wait(5)
    status, code, text = workers_site.last_row()
    assert (status, code) == ("cancelled", "stopped")  # the stop endpoint, not a dropped connection
    assert text.startswith("tick tick") and len(text) < 5 * 400
    page.get_by_test_id("generate").click()  # and the next quote comes as usual
    card_state(page, "^done$")
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    assert problems == []


@pytest.fixture
def budget_site(upstream: FakeWorkersAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A day's spend ceiling of a cent, the answer cache on, and three quotes a minute."""
    limits = {
        "QUOTES_DAILY_SPEND_LIMIT_USD": "0.01",
        "QUOTES_CACHE_TTL": "3600",
        "QUOTES_RATE_LIMIT": "3/minute",
    }
    with start_site(tmp_path_factory.mktemp("budget"), **workers_ai_env(upstream), **limits) as site:
        yield site


def test_budget_exhausted_is_a_calm_note_and_cached_quotes_still_work(
    budget_site: Site, fake: FakeWorkersAI, page: Page, problems: list[str], transport: str = "htmx"
) -> None:
    # The first quote fits under the ceiling; its usage (a million prompt tokens, $0.28) spends it.
    fake.script(Scenario(tokens=TOKENS, usage=(1_000_000, 0)))
    page.set_viewport_size({"width": 1280, "height": 800})
    open_persona(page, budget_site, transport)
    card_state(page, "^done$")
    expect(page.get_by_test_id("cache-note")).to_be_hidden()

    # A new quote: today's budget is spent. A calm note, no countdown, nothing disabled.
    page.get_by_test_id("generate").click()
    card_state(page, "^error$")
    note = page.get_by_test_id("budget-note")
    expect(note).to_be_visible()
    expect(note).to_contain_text(f"Today’s budget for new quotes from {MODEL} is spent.")
    expect(note).to_contain_text(re.compile("return tomorrow, after midnight UTC.*written still work"))
    expect(page.get_by_test_id("error")).to_be_hidden()
    expect(page.get_by_test_id("retry-after")).to_be_hidden()
    expect(page.get_by_test_id("generate")).to_be_enabled()
    expect(page.get_by_test_id("generate")).to_have_text("Write a quote")
    screenshot(page, f"budget-exhausted-{transport}")
    assert len(fake.requests) == 1  # the refused quote never reached Cloudflare
    wait_for(
        lambda: budget_site.query("SELECT code, count FROM quotes_refusal") == [("budget_exhausted", 1)],
        "the refusal counted",
    )

    # What was written still works: the same page again replays the cached quote, and its permalink.
    page.reload()
    card_state(page, "^done$")
    expect(page.get_by_test_id("quote-text")).to_have_text(QUOTE)
    expect(page.get_by_test_id("cache-note")).to_be_visible()
    expect(page.get_by_test_id("budget-note")).to_be_hidden()
    page.get_by_test_id("permalink").click()
    expect(page.get_by_test_id("permalink-text")).to_have_text(QUOTE)

    # A rate limit is another matter: a short wait, counted down, the button held meanwhile.
    open_persona(page, budget_site, transport)
    card_state(page, "^error$")  # the fourth request in a minute (3/minute)
    countdown = page.get_by_test_id("retry-after")
    expect(countdown).to_have_text(re.compile(r"^Try again in \d+ s$"))
    expect(page.get_by_test_id("error-message")).to_contain_text("Try again")
    expect(page.get_by_test_id("generate")).to_be_disabled()
    first = int(re.findall(r"\d+", countdown.text_content() or "")[0])
    assert 0 < first <= 60
    expect(countdown).not_to_have_text(f"Try again in {first} s", timeout=3000)
    assert len(fake.requests) == 1
    assert besides(problems, "status of 503", "status of 429") == []
