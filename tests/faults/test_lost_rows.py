"""Rows a killed process leaves `running` (issue 39): nothing will ever complete them, so once
older than the longest a generation lives (the total deadline plus the resume grace, and a minute
for a row waiting for the database) the next server to start, and the daily prune, mark them lost:
status `error`, code `lost`, counted among the errors by the analytics."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from harness.daphne import ROOT, start_site, wait_for, workers_ai_env
from harness.workers_ai import FakeWorkersAI, Scenario

pytestmark = pytest.mark.system


def killed_mid_stream(fake: FakeWorkersAI, tmp_path: Path, topic: str) -> None:
    """A quote streaming when its daphne is killed with SIGKILL: its row stays `running`."""
    held = threading.Event()
    fake.script(Scenario(tokens=["a", "b"], stall_after_tokens=1, hold=held))
    with start_site(tmp_path, **workers_ai_env(fake)) as site, httpx.Client(timeout=30) as client:
        try:
            with client.stream(
                "POST", f"{site.url}/api/quotes/stream", json={"persona": "alan-watts", "topic": topic}
            ) as r:
                next(r.iter_lines())
                wait_for(
                    lambda: (
                        site.query("SELECT status FROM quotes_generation WHERE topic = ?", topic)
                        == [("running",)]
                    ),
                    "its row, running",
                )
                assert site.process is not None
                site.process.send_signal(signal.SIGKILL)
                site.process.wait(10)
        except httpx.HTTPError:
            pass
    held.set()


def test_rows_a_killed_process_left_running_are_marked_lost_at_the_next_start_and_by_the_prune(
    tmp_path: Path,
) -> None:
    with FakeWorkersAI() as fake:
        killed_mid_stream(fake, tmp_path, "first")
        killed_mid_stream(fake, tmp_path, "second")
        db = tmp_path / "db.sqlite3"

        def rows() -> dict[str, tuple[str, str]]:
            with sqlite3.connect(db) as connection:
                return {
                    t: (s, c)
                    for t, s, c in connection.execute(
                        "SELECT topic, status, error_code FROM quotes_generation"
                    )
                }

        def older(
            topic: str, minutes: int
        ) -> None:  # the time that passes (the longest life: 120 + 10 + 60 s)
            with sqlite3.connect(db) as connection:
                connection.execute(
                    "UPDATE quotes_generation SET created_at = datetime(created_at, ?) WHERE topic = ?",
                    (f"-{minutes} minutes", topic),
                )

        assert rows() == {"first": ("running", ""), "second": ("running", "")}
        older("first", 4)
        older("second", 2)  # 120 s: it could still be alive (a deadline of 120 s, a grace of 10)
        with start_site(tmp_path, **workers_ai_env(fake)) as site:  # a process starts: it sweeps
            assert rows() == {"first": ("error", "lost"), "second": ("running", "")}
            log = site.log_path.read_text()
        assert "1 log rows left running by a process that died were marked lost" in log
        older("second", 2)
        env = {"DJANGO_DEBUG": "true", "DATABASE_URL": f"sqlite:///{db}", "PATH": "/usr/bin:/bin"}
        prune = subprocess.run(
            [sys.executable, "manage.py", "prune_generations"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert "Marked 1 rows lost" in prune.stdout, prune.stderr
        assert rows() == {"first": ("error", "lost"), "second": ("error", "lost")}
        stats = subprocess.run(
            [sys.executable, "manage.py", "gateway_stats"], cwd=ROOT, env=env, capture_output=True, text=True
        ).stdout
        assert "Error rate       100.0%  (2 failed requests)" in stats and "lost" in stats, stats
