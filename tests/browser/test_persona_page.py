"""A visitor streams a quote in a real browser (Debian's chromium) from a real daphne server,
over htmx (the page's default) and over the fetch client (`?transport=fetch`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from harness.daphne import wait_for

from .conftest import RECORDER, DaphneServer, assert_streamed_in_steps, streamed_in_steps, watch_console

pytestmark = pytest.mark.system

TRANSPORTS = pytest.mark.parametrize("transport", ["htmx", "fetch"])


def persona_url(server: DaphneServer, transport: str, slug: str = "alan-watts") -> str:
    query = "?transport=fetch" if transport == "fetch" else ""
    return f"{server.url}/personas/{slug}/{query}"


def wait_done(page: Page) -> None:
    expect(page.get_by_test_id("quote-card")).to_have_attribute(
        "data-state", re.compile("done|error"), timeout=30_000
    )


def shown_quote_id(page: Page) -> str:
    """The public id of the quote on the card (from its Permalink link), as SQLite stores it."""
    href = page.get_by_test_id("permalink").get_attribute("href") or ""
    match = re.fullmatch(r"/q/([0-9a-f-]{36})/", href)
    assert match, href
    return match[1].replace("-", "")


def shared_at(server: DaphneServer, public_id: str) -> object:
    [(value,)] = server.query("SELECT shared_at FROM quotes_generation WHERE public_id = ?", public_id)
    return value


@TRANSPORTS
def test_browser_quote_starts_at_once_and_streams_in_token_by_token(
    daphne_server: DaphneServer, page: Page, screenshot_dir: Path, transport: str
) -> None:
    problems = watch_console(page)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.add_init_script(RECORDER)
    page.goto(persona_url(daphne_server, transport))

    # No click: opening the page starts a quote. (The recorder proves the streaming steps; a
    # short quote may already be done when this looks, so either state will do here.)
    card = page.get_by_test_id("quote-card")
    expect(card).to_have_attribute("data-state", re.compile("streaming|done"))
    if transport == "htmx" and card.get_attribute("data-state") == "streaming":
        page.screenshot(path=screenshot_dir / "persona-streaming-desktop.png")
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=30_000)
    if transport == "htmx":
        page.screenshot(path=screenshot_dir / "persona-done-desktop.png")

    # A quote of a few words may come in one network read, and so in one step; on a busy machine
    # a longer one now and then does too. The steps are looked for in a quote of ten words or
    # more, and another quote is asked for (five at most) until one shows them: a page that
    # buffers the stream shows none in any.
    final = page.get_by_test_id("quote-text").text_content() or ""
    for attempt in range(5):
        changes = page.evaluate("window.__changes")
        if len(final.split()) >= 10 and (streamed_in_steps(changes, 3) or attempt == 4):
            break
        page.evaluate("window.__changes = []")
        page.get_by_test_id("generate").click()
        expect(card).to_have_attribute("data-state", "done", timeout=30_000)
        final = page.get_by_test_id("quote-text").text_content() or ""
    growing = assert_streamed_in_steps(page.evaluate("window.__changes"), 3)
    assert final.startswith(growing[-1]) and len(final.split()) >= 10

    credit = page.get_by_test_id("credit")
    expect(credit).to_be_visible()
    expect(credit).to_contain_text("as Alan Watts")
    expect(page.get_by_test_id("model-link")).to_have_attribute(
        "href", "https://huggingface.co/google/gemma-3-270m"
    )
    rows = daphne_server.query(
        "SELECT status, text, public_id FROM quotes_generation ORDER BY id DESC LIMIT 1"
    )
    assert rows[0][:2] == ("ok", final)
    public_id = str(rows[0][2]).replace("-", "")
    href = page.get_by_test_id("permalink").get_attribute("href") or ""
    assert href.replace("-", "") == f"/q/{public_id}/"
    expect(page.get_by_test_id("copy")).to_be_visible()
    assert problems == []


@TRANSPORTS
def test_browser_follow_up_question_streams_an_answer_with_the_conversation(
    daphne_server: DaphneServer, page: Page, screenshot_dir: Path, transport: str
) -> None:
    problems = watch_console(page)
    for width, height, name in ((1280, 800, "desktop"), (390, 844, "phone")):
        page.set_viewport_size({"width": width, "height": height})
        page.goto(persona_url(daphne_server, transport))
        wait_done(page)
        quote = page.get_by_test_id("quote-text").text_content() or ""

        page.get_by_test_id("question").fill("What do you mean by that?")
        page.get_by_test_id("question").press("Enter")  # the keyboard is enough

        answer = page.get_by_test_id("answer")
        expect(answer).to_have_attribute("data-state", "done", timeout=30_000)
        text = page.get_by_test_id("answer-text").text_content() or ""
        assert len(text.strip()) > 3
        [(request,)] = daphne_server.query("SELECT request FROM quotes_generation ORDER BY id DESC LIMIT 1")
        assert "What do you mean by that?" in str(request)
        assert quote.strip()[:20] in str(request)
        if transport == "htmx":
            page.screenshot(path=screenshot_dir / f"persona-follow-up-{name}.png", full_page=True)
            assert page.evaluate("document.documentElement.scrollWidth") <= width
    assert problems == []


def test_browser_permalink_page_and_feedback(
    daphne_server: DaphneServer, page: Page, screenshot_dir: Path
) -> None:
    problems = watch_console(page)
    page.goto(persona_url(daphne_server, "htmx"))
    wait_done(page)
    quote = (page.get_by_test_id("quote-text").text_content() or "").strip()

    page.get_by_test_id("feedback-up").click()
    expect(page.get_by_test_id("feedback-up")).to_have_attribute("aria-pressed", "true")
    page.get_by_test_id("feedback-down").click()
    expect(page.get_by_test_id("feedback-down")).to_have_attribute("aria-pressed", "true")
    expect(page.get_by_test_id("feedback-up")).to_have_attribute("aria-pressed", "false")
    assert daphne_server.query("SELECT feedback FROM quotes_generation ORDER BY id DESC LIMIT 1") == [(-1,)]

    # Copy shares the quote: kept past the log's retention (issue 20, point 8). Until then it is not.
    copied = shown_quote_id(page)
    assert shared_at(daphne_server, copied) is None
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.get_by_test_id("copy").click()
    expect(page.get_by_test_id("action-status")).to_contain_text("Copied")
    assert quote in page.evaluate("navigator.clipboard.readText()")
    wait_for(lambda: shared_at(daphne_server, copied) is not None, "the copied quote marked shared")

    # So does following the Permalink link (a POST as it navigates away), for another quote.
    copied_href = page.get_by_test_id("permalink").get_attribute("href") or ""
    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("permalink")).not_to_have_attribute("href", copied_href, timeout=30_000)
    wait_done(page)
    quote = (page.get_by_test_id("quote-text").text_content() or "").strip()
    linked = shown_quote_id(page)
    assert linked != copied and shared_at(daphne_server, linked) is None
    page.get_by_test_id("permalink").click()
    expect(page.get_by_test_id("permalink-text")).to_have_text(quote)
    wait_for(lambda: shared_at(daphne_server, linked) is not None, "the linked quote marked shared")
    expect(page.get_by_test_id("permalink-persona")).to_have_text("Alan Watts")
    expect(page.get_by_test_id("permalink-model")).to_have_attribute(
        "href", "https://huggingface.co/google/gemma-3-270m"
    )
    assert page.locator("meta[property='og:description']").get_attribute("content") == quote
    assert page.locator("meta[property='og:url']").get_attribute("content") == page.url
    for width, height, name in ((1280, 800, "desktop"), (390, 844, "phone")):
        page.set_viewport_size({"width": width, "height": height})
        page.screenshot(path=screenshot_dir / f"permalink-{name}.png", full_page=True)
    assert problems == []


@TRANSPORTS
def test_browser_shows_a_readable_error_for_a_failed_request(
    daphne_server: DaphneServer, page: Page, transport: str
) -> None:
    problems = watch_console(page)
    page.goto(persona_url(daphne_server, transport))
    wait_done(page)

    page.get_by_test_id("topic").evaluate(
        "(el) => { el.removeAttribute('maxlength'); el.value = 'x'.repeat(300); }"
    )
    page.get_by_test_id("generate").click()

    error = page.get_by_test_id("error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("too long")
    expect(page.get_by_test_id("loading")).to_be_hidden()
    # The browser logs the 400 response itself; nothing else may have gone wrong.
    assert [p for p in problems if "400" not in p] == []


def test_browser_phone_layout(daphne_server: DaphneServer, page: Page, screenshot_dir: Path) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{daphne_server.url}/")
    expect(page.get_by_role("link", name="Alan Watts")).to_be_visible()
    page.screenshot(path=screenshot_dir / "index-phone.png", full_page=True)
    page.goto(f"{daphne_server.url}/personas/alan-watts/")
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=30_000)
    page.screenshot(path=screenshot_dir / "persona-done-phone.png", full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390  # nothing overflows sideways on a phone


def test_browser_eventsource_writes_exactly_one_quote(daphne_server: DaphneServer, page: Page) -> None:
    """EventSource reconnects when a body ends: the final `done` event makes the client close, so
    one call is one generation, even with the page left open well past the reconnect delay."""
    page.goto(f"{daphne_server.url}/")
    before = daphne_server.query("SELECT count(*) FROM quotes_generation")[0][0]
    result = page.evaluate(
        """async () => {
          const { streamQuoteEventSource } = await import('/static/js/quote-stream.js');
          const tokens = [];
          const result = await streamQuoteEventSource({
            url: '/api/quotes/stream', params: { persona: 'alan-watts' }, onToken: (t) => tokens.push(t),
          });
          return { ...result, tokens: tokens.length };
        }"""
    )
    assert result["tokens"] >= 3 and result["text"]
    page.wait_for_timeout(4000)  # EventSource's default reconnect delay is ~3 s
    rows = daphne_server.query("SELECT status, text, public_id FROM quotes_generation ORDER BY id")
    assert len(rows) == before + 1
    assert rows[-1][0] == "ok" and rows[-1][1] == result["text"]
    assert str(rows[-1][2]).replace("-", "") == result["id"].replace("-", "")

    # A raw EventSource that ignores `done` is the failure mode this guards against: it reconnects.
    count = page.evaluate(
        """() => new Promise((resolve) => {
          let opens = 0;
          const source = new EventSource('/api/quotes/stream?persona=alan-watts');
          source.addEventListener('open', () => { opens += 1; if (opens === 2) { source.close(); resolve(opens); } });
          setTimeout(() => { source.close(); resolve(opens); }, 15000);
        })"""
    )
    assert count == 2
