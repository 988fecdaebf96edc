"""An admin previews unsaved persona edits in a real browser, then reads the version history."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from .conftest import ROOT, DaphneServer, start_daphne, watch_console

pytestmark = pytest.mark.system

PASSWORD = "admin-password-for-tests"
NEW_PROMPT = "You are Alan Watts, speaking from a small boat at dawn."

# Records the preview panel's state and text on every change, to tell "streamed" from "appeared".
RECORDER = """() => {
  const panel = document.querySelector('[data-persona-preview]');
  const text = panel.querySelector('[data-testid=preview-text]');
  window.__changes = [];
  const record = () => window.__changes.push({state: panel.dataset.state, text: text.textContent});
  const observer = new MutationObserver(record);
  observer.observe(panel, {attributes: true, attributeFilter: ['data-state']});
  observer.observe(text, {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaphneServer]:
    """The site on the embedded model, with a superuser `admin` in its database."""
    with start_daphne(tmp_path_factory.mktemp("daphne-admin")) as server:
        env = {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{server.db_path}",
            "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        }
        env.pop("DJANGO_SETTINGS_MODULE", None)
        subprocess.run(
            [
                sys.executable,
                "manage.py",
                "createsuperuser",
                "--noinput",
                "--username=admin",
                "--email=admin@example.com",
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        yield server


def _log_in(page: Page, server: DaphneServer, next_path: str) -> None:
    page.goto(f"{server.url}/admin/login/?next={next_path}")
    page.get_by_label("Username").fill("admin")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{server.url}{next_path}")


def test_browser_admin_previews_unsaved_edits_then_reads_the_history(
    admin_server: DaphneServer, page: Page, screenshot_dir: Path
) -> None:
    problems = watch_console(page)
    failed: list[str] = []
    page.on("response", lambda response: failed.append(response.url) if response.status >= 400 else None)
    page.set_viewport_size({"width": 1280, "height": 900})
    [(pk, saved_prompt)] = admin_server.query(
        "SELECT id, system_prompt FROM quotes_persona WHERE slug = 'alan-watts'"
    )
    change_path = f"/admin/quotes/persona/{pk}/change/"
    _log_in(page, admin_server, change_path)
    expect(page.locator("[data-persona-preview][data-ready=true]")).to_have_count(1)
    page.locator("#toggle-nav-sidebar").click()  # a wider form, and tidier screenshots

    page.locator("#id_system_prompt").fill(NEW_PROMPT)
    page.get_by_test_id("preview-topic").fill("the tide")
    page.evaluate(RECORDER)
    page.get_by_test_id("preview-button").click()
    panel = page.locator("[data-persona-preview]")
    # The recorder below proves the streaming steps: a short preview can pass "streaming"
    # between two polls of a live expectation.
    expect(panel).to_have_attribute("data-state", "done", timeout=30_000)
    expect(page.get_by_test_id("preview-meta")).to_contain_text("not saved")

    changes = page.evaluate("window.__changes")
    states = [c["state"] for c in changes]
    assert states.index("loading") < states.index("streaming") < states.index("done")
    growing = [c["text"] for c in changes if c["state"] == "streaming" and c["text"]]
    assert len(set(growing)) >= 3, growing
    for before, after in itertools.pairwise(growing):
        assert after.startswith(before)
    shown = page.get_by_test_id("preview-text").text_content() or ""
    assert len(shown) > 10

    # The log row is written as the stream closes, just after the browser has the last token.
    deadline = time.monotonic() + 10
    while not (rows := admin_server.query("SELECT is_preview, request, text, topic FROM quotes_generation")):
        assert time.monotonic() < deadline, "no log row"
        time.sleep(0.05)
    [(is_preview, request, text, topic)] = rows
    assert (is_preview, topic) == (1, "the tide")
    assert json.loads(str(request))["messages"][0]["content"] == NEW_PROMPT
    assert str(text).strip() == shown.strip()
    # Nothing was saved.
    assert admin_server.query("SELECT system_prompt FROM quotes_persona WHERE id = ?", pk) == [
        (saved_prompt,)
    ]

    page.screenshot(path=screenshot_dir / "admin-preview.png", full_page=True)

    # Save the edit (and a warmer temperature): a new version by "admin", on top of the versions
    # the seed migrations made (the persona, then its voice examples).
    [(seeded,)] = admin_server.query("SELECT COUNT(*) FROM quotes_personaversion WHERE persona_id = ?", pk)
    page.locator("#id_temperature").fill("0.9")
    page.locator("input[name=_continue]").click()
    expect(page.locator(".messagelist")).to_contain_text("was changed successfully")
    page.get_by_test_id("versions-link").click()
    expect(page.get_by_test_id("version")).to_have_count(int(seeded) + 1)
    newest = page.get_by_test_id("version").first
    expect(newest).to_contain_text("admin")
    expect(newest).to_contain_text(NEW_PROMPT)
    expect(newest.locator(".persona-diff__line--remove")).to_contain_text(["You are Alan Watts", "0.7"])
    expect(page.get_by_test_id("rollback-1")).to_be_visible()
    page.screenshot(path=screenshot_dir / "admin-history.png", full_page=True)

    # Roll back: one more version, with the first one's settings.
    page.get_by_test_id("rollback-1").click()
    expect(page.locator(".messagelist")).to_contain_text(f"back to v1; saved as v{int(seeded) + 2}")
    expect(page.get_by_test_id("version")).to_have_count(int(seeded) + 2)
    assert admin_server.query("SELECT system_prompt FROM quotes_persona WHERE id = ?", pk) == [
        (saved_prompt,)
    ]
    # The admin has no favicon link, so the browser asks for /favicon.ico and logs its 404.
    assert [url for url in failed if not url.endswith("/favicon.ico")] == []
    assert [p for p in problems if "404" not in p] == []
