"""A visitor on the persona page, on the embedded model: over htmx (the page's default) and over
the fetch client (`?transport=fetch`)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from harness.daphne import wait_for

from .conftest import RECORDER, Site, besides, card_state, open_persona, screenshot, streamed

pytestmark = pytest.mark.system

TRANSPORTS = pytest.mark.parametrize("transport", ["htmx", "fetch"])
GEMMA_URL = "https://huggingface.co/google/gemma-3-270m"


def shown_id(page: Page) -> str:
    """The quote's public id, from its Permalink, as SQLite stores it."""
    href = page.get_by_test_id("permalink").get_attribute("href") or ""
    match = re.fullmatch(r"/q/([0-9a-f-]{36})/", href)
    assert match, href
    return match[1].replace("-", "")


def column(site: Site, name: str, public_id: str) -> object:
    return site.query(f"SELECT {name} FROM quotes_generation WHERE public_id = ?", public_id)[0][0]


@TRANSPORTS
def test_browser_quote_streams_in_token_by_token_and_ends_on_a_credited_card(
    local_site: Site, page: Page, problems: list[str], transport: str
) -> None:
    page.set_viewport_size({"width": 1280, "height": 800})
    page.add_init_script(RECORDER)
    csp = open_persona(page, local_site, transport).headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.locator("script:not([src]), [style]").count() == 0  # nothing inline to allow

    # No click: opening the page starts a quote. A few words may come in one network read, so
    # the steps are looked for in a quote of ten words or more: up to five are asked for, and a
    # page that buffers the stream shows steps in none.
    card = page.get_by_test_id("quote-card")
    for attempt in range(5):
        card_state(page, "^done$")
        final = page.get_by_test_id("quote-text").text_content() or ""
        try:
            growing = streamed(page, 3)
            assert len(final.split()) >= 10
            break
        except (AssertionError, ValueError):
            if attempt == 4:
                raise
        page.evaluate("window.__changes = []")
        page.get_by_test_id("generate").click()
        expect(card).not_to_have_attribute("data-state", "done")
    assert final.startswith(growing[-1])
    screenshot(page, f"persona-done-{transport}")

    expect(page.get_by_test_id("credit")).to_contain_text("gemma-3-270m as Alan Watts")
    expect(page.get_by_test_id("model-link")).to_have_attribute("href", GEMMA_URL)
    assert local_site.last_row("error_code, text, public_id") == ("ok", "", final, shown_id(page))
    expect(page.get_by_test_id("copy")).to_be_visible()

    # The CSP is enforced, not only sent: a script the page did not load does not run.
    page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = 'window.__ran = 1';"
        " document.body.append(s); }"
    )
    assert page.evaluate("window.__ran") is None
    assert besides(problems, "Content Security Policy") == [] and len(problems) == 1


@TRANSPORTS
def test_browser_follow_up_question_phone_layout_and_bad_input(
    local_site: Site, page: Page, problems: list[str], transport: str
) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    open_persona(page, local_site, transport)
    card_state(page, "^done$")
    quote = (page.get_by_test_id("quote-text").text_content() or "").strip()

    page.get_by_test_id("question").fill("What do you mean by that?")
    page.get_by_test_id("question").press("Enter")  # the keyboard is enough
    expect(page.get_by_test_id("answer")).to_have_attribute("data-state", "done", timeout=30_000)
    assert len((page.get_by_test_id("answer-text").text_content() or "").strip()) > 3
    request = local_site.last_row("request")[1]
    assert "What do you mean by that?" in request and quote[:20] in request
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing overflows sideways
    screenshot(page, f"persona-follow-up-phone-{transport}", full_page=True)

    # Bad input reads well (the field's own limit taken off, as a script could).
    page.get_by_test_id("topic").evaluate(
        "(el) => { el.removeAttribute('maxlength'); el.value = 'x'.repeat(300) }"
    )
    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("error-message")).to_contain_text("too long")
    expect(page.get_by_test_id("loading")).to_be_hidden()
    expect(page.get_by_test_id("retry")).to_be_visible()
    assert besides(problems, "status of 400") == []  # the browser logs the 400 itself


def test_browser_feedback_copy_and_permalink(local_site: Site, page: Page, problems: list[str]) -> None:
    open_persona(page, local_site)
    card_state(page, "^done$")
    page.get_by_test_id("feedback-up").click()
    expect(page.get_by_test_id("feedback-up")).to_have_attribute("aria-pressed", "true")
    page.get_by_test_id("feedback-down").click()
    expect(page.get_by_test_id("feedback-up")).to_have_attribute("aria-pressed", "false")
    copied = shown_id(page)
    wait_for(lambda: column(local_site, "feedback", copied) == -1, "the thumbs down saved")

    # Copy and Permalink share a quote: it is kept past the log's retention. Until then it is not.
    assert column(local_site, "shared_at", copied) is None
    quote = (page.get_by_test_id("quote-text").text_content() or "").strip()
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.get_by_test_id("copy").click()
    expect(page.get_by_test_id("action-status")).to_contain_text("Copied")
    assert quote in page.evaluate("navigator.clipboard.readText()")
    wait_for(lambda: column(local_site, "shared_at", copied) is not None, "the copied quote shared")

    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("permalink")).not_to_have_attribute("href", re.compile(copied[:8]))
    card_state(page, "^done$")
    quote, linked = (page.get_by_test_id("quote-text").text_content() or "").strip(), shown_id(page)
    assert column(local_site, "shared_at", linked) is None
    page.get_by_test_id("permalink").click()
    expect(page.get_by_test_id("permalink-text")).to_have_text(quote)
    wait_for(lambda: column(local_site, "shared_at", linked) is not None, "the linked quote shared")
    expect(page.get_by_test_id("permalink-persona")).to_have_text("Alan Watts")
    expect(page.get_by_test_id("permalink-model")).to_have_attribute("href", GEMMA_URL)
    assert page.locator("meta[property='og:description']").get_attribute("content") == quote
    screenshot(page, "permalink", full_page=True)
    assert problems == []


def test_browser_eventsource_client_writes_exactly_one_quote(local_site: Site, page: Page) -> None:
    """EventSource reconnects when a body ends: the final `done` event makes the client close."""
    page.goto(f"{local_site.url}/")
    [(before,)] = local_site.query("SELECT count(*) FROM quotes_generation")
    result = page.evaluate("""async () => {
      const { streamQuoteEventSource } = await import('/static/js/quote-stream.js');
      let tokens = 0;
      const result = await streamQuoteEventSource(
        { url: '/api/quotes/stream', params: { persona: 'alan-watts' }, onToken: () => tokens++ });
      return { ...result, tokens };
    }""")
    assert result["tokens"] >= 3 and result["text"]
    page.wait_for_timeout(4000)  # past EventSource's reconnect delay
    assert local_site.query("SELECT count(*) FROM quotes_generation") == [(before + 1,)]
    assert local_site.last_row("text, public_id") == ("ok", result["text"], result["id"].replace("-", ""))
