"""A real daphne server in a subprocess, and Debian's chromium driven by Playwright.

pytest-django's daphne_server is threaded WSGI and cannot stream, so the browser tests start
daphne themselves, on a SQLite file of their own, with the embedded model.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True
    )
    port = _free_port()
    log_path = tmp_dir / "daphne.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(url + "/", timeout=2).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"daphne did not start; see {log_path}") from None
                    time.sleep(0.2)
            yield DaphneServer(url=url, db_path=db_path, log_path=log_path)
        finally:
            process.terminate()
            process.wait(timeout=15)


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
