"""Debian's chromium, driven by Playwright, against a real daphne: `python -m quotes.ops.server`
with deploy/'s flags (harness/daphne.py), in a subprocess on a SQLite file of its own. The sites
run the embedded model, or the workers-ai backend on the fake Cloudflare (harness/workers_ai.py)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from harness.daphne import ROOT, Site, environment, manage, start_site, workers_ai_env
from harness.workers_ai import FakeWorkersAI, Scenario

SCREENSHOTS = ROOT / "artifacts" / "screenshots"
#: Whole words: a token ending in "c" or "cf" is held back until the next (it could start a credential).
QUOTE = "The work you do is the play you have not yet noticed."
TOKENS = tuple(re.findall(r"\.|\s?\w+", QUOTE))


@pytest.fixture(scope="session")
def local_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The site on the embedded model (gemma-3-270m)."""
    with start_site(tmp_path_factory.mktemp("local"), AI_BACKEND="local") as site:
        yield site


@pytest.fixture(scope="session")
def upstream() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI() as fake:
        yield fake


@pytest.fixture
def fake(upstream: FakeWorkersAI) -> Iterator[FakeWorkersAI]:
    """The fake Cloudflare, reset, answering each unscripted request with a slow quote."""
    upstream.reset()
    upstream.default = Scenario(tokens=TOKENS, token_delay_s=0.05)
    yield upstream
    upstream.reset()


@pytest.fixture(scope="session")
def workers_site(upstream: FakeWorkersAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The site on AI_BACKEND=workers-ai, against the fake Cloudflare."""
    with start_site(tmp_path_factory.mktemp("workers-ai"), **workers_ai_env(upstream)) as site:
        yield site


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, object]) -> dict[str, object]:
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    return {**browser_type_launch_args, "executable_path": "/usr/bin/chromium", "args": flags}


@pytest.fixture
def problems(page: Page) -> list[str]:
    """The page's console errors and uncaught exceptions."""
    seen: list[str] = []
    page.on("console", lambda message: seen.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: seen.append(str(error)))
    return seen


def besides(problems: list[str], *expected: str) -> list[str]:
    """The problems other than those naming one of `expected` (the browser's own log of a 429, say)."""
    return [p for p in problems if not any(e in p for e in expected)]


def with_superuser(site: Site, username: str, password: str) -> Site:
    """`site` with a superuser `username` (created as an operator would: manage.py)."""
    env = environment(
        DJANGO_DEBUG="true", DATABASE_URL=f"sqlite:///{site.db_path}", DJANGO_SUPERUSER_PASSWORD=password
    )
    manage(env, "createsuperuser", "--noinput", f"--username={username}", f"--email={username}@example.com")
    return site


def log_in(page: Page, site: Site, username: str, password: str, path: str) -> None:
    """Log in to the admin through its form, landing on `path`."""
    page.goto(f"{site.url}/admin/login/?next={path}")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{site.url}{path}")


def open_persona(page: Page, site: Site, transport: str = "htmx") -> Any:
    """Open Alan Watts's page, which starts a quote at once; the page's response."""
    return page.goto(
        f"{site.url}/personas/alan-watts/" + ("?transport=fetch" if transport == "fetch" else "")
    )


def card_state(page: Page, state: str, timeout: float = 30_000) -> None:
    card = page.get_by_test_id("quote-card")
    expect(card).to_have_attribute("data-state", re.compile(state), timeout=timeout)


def screenshot(page: Page, name: str, **options: Any) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{name}.png", animations="disabled", **options)


# Records each change of the card's state and of the quote's text, with whether the loading
# animation showed then: "streamed" told from "appeared at once". An init script, in place
# before the page's own scripts start the quote.
RECORDER = """document.addEventListener('readystatechange', () => {
  const card = document.querySelector('[data-testid=quote-card]');
  if (document.readyState !== 'interactive' || !card) return;
  const text = document.querySelector('[data-testid=quote-text]');
  const loading = document.querySelector('[data-testid=loading]');
  window.__changes = [];
  const record = () => window.__changes.push({
    state: card.dataset.state, text: text.textContent, loading: !loading.hidden && loading.offsetParent !== null,
  });
  const observer = new MutationObserver(record);
  observer.observe(card, {attributes: true, attributeFilter: ['data-state']});
  observer.observe(text, {childList: true, characterData: true, subtree: true});
});"""


def streamed(page: Page, steps: int) -> list[str]:
    """What RECORDER saw shows a stream: loading, streaming, done; the loading animation until
    the first text only; the text grown in at least `steps` steps, each extending the last."""
    changes = page.evaluate("window.__changes")
    states = [c["state"] for c in changes]
    assert states.index("loading") < states.index("streaming") < states.index("done"), states
    assert all(c["loading"] == (c["state"] == "loading") for c in changes), changes
    growing = [c["text"] for c in changes if c["state"] == "streaming" and c["text"]]
    assert len(set(growing)) >= steps, growing
    assert all(b.startswith(a) for a, b in itertools.pairwise(growing)), growing
    return growing
