"""An admin tries a draft persona version on half the readers in chromium: visitors with different
cookies reach both arms and keep theirs, their votes land on their arm, the analytics page shows
the arms side by side, and promoting the draft makes it live for everyone (issue 42)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Browser, Page, expect

from harness.workers_ai import FakeWorkersAI, Scenario

from .conftest import SCREENSHOTS, TOKENS, Site, besides, card_state, log_in, open_persona, with_superuser

pytestmark = pytest.mark.system

PASSWORD = "experimenter-password-for-tests"
DRAFT_PROMPT = "You are Alan Watts, on a rainy afternoon by the sea."
READERS = 16


@pytest.fixture(scope="module")
def admin_site(workers_site: Site) -> Site:
    return with_superuser(workers_site, "experimenter", PASSWORD)


def system_prompt(fake: FakeWorkersAI) -> str:
    return str(fake.requests[-1].json["messages"][0]["content"])


def read_a_quote(browser: Browser, site: Site, fake: FakeWorkersAI, reader: int, vote: str = "") -> str:
    """Reader number `reader` (their own browser: a cookie of their own, kept between visits)
    reads a quote: the prompt the upstream was sent. With `vote`, they rate it."""
    context = browser.new_context()
    context.add_cookies([{"name": "csrftoken", "value": f"reader{reader:026d}", "url": site.url}])
    page = context.new_page()
    try:
        open_persona(page, site)
        card_state(page, "done")
        if vote:
            button = page.get_by_test_id(f"feedback-{vote}")
            button.click()
            expect(button).to_have_attribute("aria-pressed", "true")
        return system_prompt(fake)
    finally:
        context.close()


def test_browser_admin_tries_a_draft_on_half_the_readers_then_promotes_it(
    admin_site: Site, fake: FakeWorkersAI, browser: Browser, page: Page, problems: list[str]
) -> None:
    site = admin_site
    fake.default = Scenario(tokens=TOKENS)  # no pace: 40 quotes to read
    failed: list[str] = []
    page.on("response", lambda response: failed.append(response.url) if response.status >= 400 else None)
    page.set_viewport_size({"width": 1280, "height": 1000})
    [(pk, live_prompt, live_number)] = site.query(
        "SELECT p.id, p.system_prompt, MAX(v.number) FROM quotes_persona p "
        "JOIN quotes_personaversion v ON v.persona_id = p.id WHERE p.slug = 'alan-watts'"
    )
    log_in(page, site, "experimenter", PASSWORD, f"/admin/quotes/persona/{pk}/change/")

    # A draft: the form's values saved aside; readers still get the live version.
    page.locator("#id_system_prompt").fill(DRAFT_PROMPT)
    page.get_by_test_id("save-draft").click()
    page.wait_for_url(re.compile(r"/history-versions/#v\d+$"))
    expect(page.get_by_text("readers still get the live version")).to_be_visible()
    [(draft,)] = site.query("SELECT number FROM quotes_personaversion WHERE persona_id = ? AND is_draft", pk)
    assert read_a_quote(browser, site, fake, 999) == live_prompt

    # An experiment at 50%.
    page.get_by_test_id(f"share-{draft}").fill("50")
    page.get_by_test_id(f"start-{draft}").click()
    expect(page.get_by_text("now goes to 50%")).to_be_visible()

    # Readers with different cookies reach both arms, each keeps theirs; a draft reader votes up,
    # a live reader votes down.
    arms: dict[int, str] = {}
    for reader in range(READERS):
        prompt = read_a_quote(browser, site, fake, reader)
        arms[reader] = "draft" if prompt == DRAFT_PROMPT else "live"
        assert prompt in (DRAFT_PROMPT, live_prompt)
        again = read_a_quote(browser, site, fake, reader, vote="up" if arms[reader] == "draft" else "down")
        assert again == prompt, f"reader {reader} changed arms"
    on_draft = sum(arm == "draft" for arm in arms.values())
    assert 3 <= on_draft <= READERS - 3, arms  # half, give or take what 16 readers make of it
    rows = site.query(
        "SELECT arm, COUNT(*) FROM quotes_generation WHERE experiment_id IS NOT NULL GROUP BY arm ORDER BY arm"
    )
    assert rows == [("draft", 2 * on_draft), ("live", 2 * (READERS - on_draft))]

    # The analytics page sets the arms side by side, each with its own votes.
    page.goto(f"{site.url}/admin/quotes/generation/analytics/")
    draft_arm, live_arm = page.get_by_test_id("arm-draft"), page.get_by_test_id("arm-live")
    expect(draft_arm.get_by_test_id("quotes")).to_have_text(str(2 * on_draft))
    expect(draft_arm.get_by_test_id("up")).to_have_text(str(on_draft))
    expect(draft_arm.get_by_test_id("down")).to_have_text("0")
    expect(live_arm.get_by_test_id("quotes")).to_have_text(str(2 * (READERS - on_draft)))
    expect(live_arm.get_by_test_id("down")).to_have_text(str(READERS - on_draft))
    expect(live_arm.get_by_test_id("up")).to_have_text("0")

    # Promoted: the draft is live for every reader, those of the live arm included.
    page.goto(f"{site.url}/admin/quotes/persona/{pk}/history-versions/")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)  # docs/img/persona-experiment.png is this one
    page.get_by_test_id("experiment").screenshot(
        path=SCREENSHOTS / "persona-experiment.png", animations="disabled"
    )
    page.get_by_test_id("promote").click()
    expect(page.get_by_text("every reader gets it now")).to_be_visible()
    expect(page.get_by_test_id("experiment")).to_have_attribute("data-state", "promoted")
    for reader in [*[r for r, arm in arms.items() if arm == "live"][:3], 1000]:
        assert read_a_quote(browser, site, fake, reader) == DRAFT_PROMPT

    # The persona as it was, for the other tests on this site.
    page.get_by_test_id(f"rollback-{live_number}").click()
    expect(page.get_by_text(f"Rolled “Alan Watts” back to v{live_number}")).to_be_visible()
    assert failed == [] and besides(problems) == []
