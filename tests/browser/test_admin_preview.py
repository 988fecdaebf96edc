"""An admin previews unsaved persona edits in the browser (a stream), saves them, and rolls back."""

from __future__ import annotations

import itertools
import json

import pytest
from playwright.sync_api import Page, expect

from .conftest import Site, besides, log_in, screenshot, with_superuser

pytestmark = pytest.mark.system

PASSWORD = "admin-password-for-tests"
NEW_PROMPT = "You are Alan Watts, speaking from a small boat at dawn."
# The preview panel's state and text at each change: "streamed" told from "appeared".
RECORDER = """() => {
  const panel = document.querySelector('[data-persona-preview]');
  const text = panel.querySelector('[data-testid=preview-text]');
  window.__changes = [];
  const observer = new MutationObserver(() => window.__changes.push({state: panel.dataset.state, text: text.textContent}));
  observer.observe(panel, {attributes: true, attributeFilter: ['data-state']});
  observer.observe(text, {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def admin_site(local_site: Site) -> Site:
    """The embedded model's site, with a superuser `admin` (the test leaves the persona as it was)."""
    return with_superuser(local_site, "admin", PASSWORD)


def test_browser_admin_previews_unsaved_edits_then_saves_and_rolls_back(
    admin_site: Site, page: Page, problems: list[str]
) -> None:
    failed: list[str] = []
    page.on("response", lambda response: failed.append(response.url) if response.status >= 400 else None)
    page.set_viewport_size({"width": 1280, "height": 900})
    [(pk, saved_prompt)] = admin_site.query(
        "SELECT id, system_prompt FROM quotes_persona WHERE slug = 'alan-watts'"
    )
    change_path = f"/admin/quotes/persona/{pk}/change/"
    log_in(page, admin_site, "admin", PASSWORD, change_path)
    expect(page.locator("[data-persona-preview][data-ready=true]")).to_have_count(1)

    page.locator("#id_system_prompt").fill(NEW_PROMPT)
    page.get_by_test_id("preview-topic").fill("the tide")
    page.evaluate(RECORDER)
    page.get_by_test_id("preview-button").click()
    expect(page.locator("[data-persona-preview]")).to_have_attribute("data-state", "done", timeout=30_000)
    expect(page.get_by_test_id("preview-meta")).to_contain_text("not saved")
    changes = page.evaluate("window.__changes")
    states = [c["state"] for c in changes]
    assert states.index("loading") < states.index("streaming") < states.index("done")
    growing = [c["text"] for c in changes if c["state"] == "streaming" and c["text"]]
    assert len(set(growing)) >= 3 and all(b.startswith(a) for a, b in itertools.pairwise(growing)), growing
    shown = page.get_by_test_id("preview-text").text_content() or ""
    screenshot(page, "admin-preview", full_page=True)

    is_preview, request, text, topic = admin_site.last_row("is_preview, request, text, topic")[1:]
    assert (is_preview, topic, str(text).strip()) == (1, "the tide", shown.strip())
    assert json.loads(request)["messages"][0]["content"] == NEW_PROMPT
    assert admin_site.query("SELECT system_prompt FROM quotes_persona WHERE id = ?", pk) == [(saved_prompt,)]

    # Save: a new version by "admin", on top of the seeded ones. Then roll back to the last of those.
    [(seeded,)] = admin_site.query("SELECT COUNT(*) FROM quotes_personaversion WHERE persona_id = ?", pk)
    page.locator("#id_temperature").fill("0.9")
    page.locator("input[name=_continue]").click()
    expect(page.locator(".messagelist")).to_contain_text("was changed successfully")
    page.get_by_test_id("versions-link").click()
    expect(page.get_by_test_id("version")).to_have_count(seeded + 1)
    expect(page.get_by_test_id("version").first).to_contain_text(NEW_PROMPT)
    expect(page.get_by_test_id("version").first.locator(".persona-diff__line--remove")).to_contain_text(
        ["You are Alan Watts", "0.7"]
    )
    page.get_by_test_id(f"rollback-{seeded}").click()
    expect(page.locator(".messagelist")).to_contain_text(f"back to v{seeded}; saved as v{seeded + 2}")
    expect(page.get_by_test_id("version")).to_have_count(seeded + 2)
    assert admin_site.query("SELECT system_prompt FROM quotes_persona WHERE id = ?", pk) == [(saved_prompt,)]
    assert failed == [] and besides(problems) == []
