"""Faults in the production layout (harness/faults: two daphnes behind deploy/nginx, a real
PostgreSQL and Redis, the fake Workers AI upstream; harness.scaleout.shared, one for the run), 20
clients each on a loopback address of its own asking for one 1 s quote after another through
nginx while the fault lasts. After each run, harness/faults/faults.py's checks: every generation a client saw has
exactly one row, completed (but a killed process's), no 500, no HTML from the API, no request
silent for more than a few seconds, no ERROR line or traceback in the logs.

- PostgreSQL stopped for 35 s (past the 30 s for which a process trusts the personas it loaded):
  every quote is still served whole, and the rows, waiting in memory, are written once it is back;
- PostgreSQL read-only: the same, with no ERROR line (a refused write waits like an unreachable one);
- Redis stopped: the site keeps serving (the cache and the rate limits fall back to each process);
- a process killed with SIGKILL: every generation it held has its row, `running`, which
  gateway_stats counts as lost once older than the total deadline.

bench/faults.py runs these and more (Redis hung, the upstream hung) longer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from harness import scaleout
from harness.daphne import ROOT
from harness.faults import faults
from harness.faults.layout import Layout

pytestmark = pytest.mark.system

CLIENTS = 20


@pytest.fixture(scope="module")
def layout() -> Layout:
    layout = scaleout.shared()
    layout.use_tokens(20, 20)  # 1 s quotes
    return layout


def run(layout: Layout, name: str, fault_s: float) -> faults.Report:
    report = faults.run(layout, faults.FAULTS[name], clients=CLIENTS, fault_s=fault_s, after_s=2.0)
    figures = "\n".join(f"  {key}: {value}" for key, value in faults.summary(report).items())
    assert not report.failed(), "\n".join(report.failed()) + f"\n{name}:\n{figures}"
    assert len(report.during()) >= CLIENTS, f"few quotes started during the fault:\n{figures}"
    return report


def test_postgres_restarted_after_35_s_every_quote_is_served_and_every_row_written(layout: Layout) -> None:
    report = run(layout, "postgres-stopped", fault_s=35.0)
    assert Counter(q.outcome for q in report.quotes) == {"done": len(report.quotes)}
    assert {status for _, status, _ in report.rows.values()} == {"ok"}


def test_redis_stopped_the_site_keeps_serving(layout: Layout) -> None:
    report = run(layout, "redis-stopped", fault_s=3.0)
    assert Counter(q.outcome for q in report.during()) == {"done": len(report.during())}


def test_a_read_only_database_keeps_the_rows_waiting_without_an_error(layout: Layout) -> None:
    """Reads work and writes fail (PostgreSQL's InternalError, no OperationalError): quotes are
    served whole, their rows wait in memory and are written once it takes writes again."""
    report = run(layout, "database-read-only", fault_s=3.0)
    assert Counter(q.outcome for q in report.quotes) == {"done": len(report.quotes)}
    assert {status for _, status, _ in report.rows.values()} == {"ok"}


def test_a_killed_process_leaves_a_running_row_for_every_generation_it_held(layout: Layout) -> None:
    first_row = layout.last_row_id()
    report = run(layout, "daphne-killed", fault_s=1.0)
    cut = report.cut()
    assert cut, "no stream was cut by the kill"
    running = {
        public_id
        for (public_id,) in layout.sql(
            "SELECT public_id::text FROM quotes_generation WHERE id > %s AND status = 'running'", [first_row]
        )
    }
    # Those of the cut streams it had not ended yet, and maybe some whose headers no client had yet.
    assert running and running <= cut | {public_id for public_id, _, _ in report.unseen}
    # Once older than the total deadline (here made so), the analytics count them as lost.
    layout.sql(
        "UPDATE quotes_generation SET created_at = created_at - interval '1 hour' "
        "WHERE id > %s AND status = 'running' RETURNING id",
        [first_row],
    )
    stats = subprocess.run(
        [sys.executable, "manage.py", "gateway_stats", "--json"],
        cwd=ROOT,
        env=layout.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["by_status"]["lost"] == len(running)
