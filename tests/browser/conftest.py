"""A real daphne server in a subprocess, and Debian's chromium driven by Playwright.

pytest-django's daphne_server is threaded WSGI and cannot stream, so the browser tests start
daphne themselves, on a SQLite file of their own, with the embedded model.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.daphne import ROOT, migrate, running
from harness.services import free_port
from harness.workers_ai import FakeWorkersAI

ARTIFACTS = ROOT / "artifacts"
ACCOUNT_ID = "acct-test"
#: A secret-looking credential the Workers AI sites are started with: it must never reach a page.
API_TOKEN = "cfut_BROWSER-4c1d9e8f7a6b5c4d3e2f1a0b9c8d7e6fQQ"


@dataclass
class DaphneServer:
    url: str
    db_path: Path
    log_path: Path

    def query(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        with sqlite3.connect(self.db_path) as connection:
            return connection.execute(sql, params).fetchall()

    def execute(self, sql: str, *params: object) -> None:
        with sqlite3.connect(self.db_path) as connection:
            connection.execute(sql, params)


@contextmanager
def start_daphne(tmp_dir: Path, **extra_env: str) -> Iterator[DaphneServer]:
    """Migrate a fresh SQLite file and serve the app on it with daphne, in a subprocess."""
    db_path = tmp_dir / "db.sqlite3"
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{db_path}",
        "AI_BACKEND": "local",
        "DJANGO_DEBUG": "true",
        "LOCAL_MODEL_PRELOAD": "true",
        # Servers are shared by several tests: no answer cache and a generous rate limit, so
        # one test's quote or request count never decides another's. Tests of those opt in.
        "QUOTES_CACHE_TTL": "0",
        "QUOTES_RATE_LIMIT": "1000/m",
        "QUOTES_MAX_CONCURRENT_STREAMS": "50",
        **extra_env,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    migrate(env)
    port = free_port()
    log_path = tmp_dir / "daphne.log"
    command = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"]
    with running(command, port, env, log_path, path="/", any_status=True) as (_, url):
        yield DaphneServer(url=url, db_path=db_path, log_path=log_path)


def workers_ai_env(fake: FakeWorkersAI) -> dict[str, str]:
    """start_daphne's settings for the site on AI_BACKEND=workers-ai against `fake`."""
    return {
        "AI_BACKEND": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": ACCOUNT_ID,
        "CLOUDFLARE_API_TOKEN": API_TOKEN,
        "CLOUDFLARE_API_BASE_URL": fake.api_base_url,
        "LOCAL_MODEL_PRELOAD": "false",
        # One attempt: each scripted upstream answer is what the visitor sees (no retry).
        "QUOTES_MAX_ATTEMPTS": "1",
    }


@pytest.fixture(scope="session")
def daphne_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaphneServer]:
    """The site on the embedded model."""
    with start_daphne(tmp_path_factory.mktemp("daphne-local")) as server:
        yield server


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, object]) -> dict[str, object]:
    return {
        **browser_type_launch_args,
        "executable_path": "/usr/bin/chromium",
        "args": [
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ],
    }


@pytest.fixture
def screenshot_dir() -> Path:
    path = ARTIFACTS / "screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


# Records every change to the card's state and the quote text, with the loading indicator's
# visibility at that moment, so a test can tell "streamed" from "appeared all at once". An init
# script: the page starts its quote as soon as its scripts run, so this must be in place first.
RECORDER = """document.addEventListener('readystatechange', () => {
  if (document.readyState !== 'interactive') return;  // parsed; the page's scripts run next
  const card = document.querySelector('[data-testid=quote-card]');
  const text = document.querySelector('[data-testid=quote-text]');
  const loading = document.querySelector('[data-testid=loading]');
  if (!card) return;
  window.__changes = [];
  const record = () => window.__changes.push({
    state: card.dataset.state, text: text.textContent, loadingVisible: !loading.hidden && loading.offsetParent !== null,
  });
  const observer = new MutationObserver(record);
  observer.observe(card, {attributes: true, attributeFilter: ['data-state']});
  observer.observe(text, {childList: true, characterData: true, subtree: true});
});"""


def watch_console(page: Any) -> list[str]:
    """Console errors and uncaught exceptions on `page`."""
    problems: list[str] = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    return problems


def streamed_in_steps(changes: list[dict[str, Any]], steps: int) -> bool:
    """Whether `assert_streamed_in_steps` holds."""
    try:
        assert_streamed_in_steps(changes, steps)
    except (AssertionError, ValueError):
        return False
    return True


def assert_streamed_in_steps(changes: list[dict[str, Any]], steps: int) -> list[str]:
    """What RECORDER saw shows a quote streamed: the card went loading, streaming, done; the
    loading animation showed until the first token, then hid; and the text grew in at least
    `steps` visible steps while the stream was open, each extending the last. Returns those texts."""
    states = [c["state"] for c in changes]
    assert states.index("loading") < states.index("streaming") < states.index("done")
    assert all(c["loadingVisible"] for c in changes if c["state"] == "loading")
    assert not any(c["loadingVisible"] for c in changes if c["state"] in ("streaming", "done"))
    growing = [c["text"] for c in changes if c["state"] == "streaming" and c["text"]]
    assert len(set(growing)) >= steps, growing
    for before, after in itertools.pairwise(growing):
        assert after.startswith(before)
    return growing
