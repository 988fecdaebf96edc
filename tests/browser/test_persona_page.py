"""A visitor streams a quote in a real browser (Debian's chromium) from a real daphne server."""

from __future__ import annotations

import itertools
from pathlib import Path

from playwright.sync_api import ConsoleMessage, Page, expect

from .conftest import DaphneServer

# Records every change to the card's state and the quote text, with the loading indicator's
# visibility at that moment, so the test can tell "streamed" from "appeared all at once".
RECORDER = """() => {
  const card = document.querySelector('[data-testid=quote-card]');
  const text = document.querySelector('[data-testid=quote-text]');
  const loading = document.querySelector('[data-testid=loading]');
  window.__changes = [];
  const record = () => window.__changes.push({
    state: card.dataset.state, text: text.textContent, loadingVisible: !loading.hidden && loading.offsetParent !== null,
  });
  const observer = new MutationObserver(record);
  observer.observe(card, {attributes: true, attributeFilter: ['data-state']});
  observer.observe(text, {childList: true, characterData: true, subtree: true});
}"""


def _watch_console(page: Page) -> list[str]:
    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            problems.append(message.text)

    page.on("console", on_console)
    page.on("pageerror", lambda error: problems.append(str(error)))
    return problems


def test_browser_quote_streams_in_token_by_token(
    daphne_server: DaphneServer, page: Page, screenshot_dir: Path
) -> None:
    problems = _watch_console(page)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{daphne_server.url}/personas/alan-watts/")
    expect(page.locator("form[data-ready=true]")).to_have_count(1)
    page.evaluate(RECORDER)

    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "streaming")
    page.screenshot(path=screenshot_dir / "persona-streaming-desktop.png")
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=30_000)
    page.screenshot(path=screenshot_dir / "persona-done-desktop.png")

    changes = page.evaluate("window.__changes")
    states = [c["state"] for c in changes]
    assert states.index("loading") < states.index("streaming") < states.index("done")
    # The loading animation shows until the first token, then hides.
    assert all(c["loadingVisible"] for c in changes if c["state"] == "loading")
    assert not any(c["loadingVisible"] for c in changes if c["state"] in ("streaming", "done"))
    # The text grew in several visible steps while the stream was open, each extending the last.
    growing = [c["text"] for c in changes if c["state"] == "streaming" and c["text"]]
    assert len(set(growing)) >= 3, growing
    for before, after in itertools.pairwise(growing):
        assert after.startswith(before)
    final = page.get_by_test_id("quote-text").text_content() or ""
    assert final.startswith(growing[-1]) and len(final) > 10

    credit = page.get_by_test_id("credit")
    expect(credit).to_be_visible()
    expect(credit).to_contain_text("as Alan Watts")
    expect(page.get_by_test_id("model-link")).to_have_attribute(
        "href", "https://huggingface.co/google/gemma-3-270m"
    )
    rows = daphne_server.query("SELECT status, text FROM quotes_generation ORDER BY id DESC LIMIT 1")
    assert rows == [("ok", final)]
    assert problems == []


def test_browser_shows_a_readable_error_for_a_failed_request(daphne_server: DaphneServer, page: Page) -> None:
    problems = _watch_console(page)
    page.goto(f"{daphne_server.url}/personas/alan-watts/")
    expect(page.locator("form[data-ready=true]")).to_have_count(1)

    page.get_by_test_id("topic").fill("x" * 150)
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
    expect(page.locator("form[data-ready=true]")).to_have_count(1)
    page.get_by_test_id("generate").click()
    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=30_000)
    page.screenshot(path=screenshot_dir / "persona-done-phone.png", full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390  # nothing overflows sideways on a phone
