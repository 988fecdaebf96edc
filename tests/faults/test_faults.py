"""The fault suite (issue 21) in CI: the production layout (two daphnes behind nginx with the
deploy rules, a real PostgreSQL and Redis, the fake Workers AI upstream; harness/faults/layout.py),
30 clients each on its own loopback address, and each fault injected for a few seconds under
their load: PostgreSQL stopped, the database read-only, Redis stopped, Redis hung, a daphne
killed, the upstream hung before its first token. After each: every generation has exactly one
row, no 500 and no HTML from the API, no request silent for more than a few seconds, no client
slot left in Redis, and with Redis down 90% of the quotes started meanwhile complete
(harness/faults/faults.py says how each is checked). bench/faults.py runs the same longer.

Needs the Debian packages nginx, postgresql and redis-server (scripts/bootstrap --dev installs
them); it starts its own servers: system layer, run once, not again on PostgreSQL + Redis. One layout
serves every fault (each ends with the layout whole again, and each run waits until it is).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import faults as bench_faults
from harness.faults import faults
from harness.faults.layout import Layout, Settings, started

pytestmark = pytest.mark.system

#: Short runs: CI's budget is a couple of minutes for the whole module.
CLIENTS = 30
FAULT_S = 3.0
AFTER_S = 2.0
#: QUOTES_TTFT_TIMEOUT: the bound on a request's wait for a hung upstream.
TTFT_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def layout() -> Iterator[Layout]:
    # The clients' thousands of requests are not worth a log line each in a failure's report.
    httpx_logger = logging.getLogger("httpx")
    level = httpx_logger.level
    httpx_logger.setLevel(logging.WARNING)
    try:
        with started(Settings(ttft_timeout_s=TTFT_TIMEOUT_S, tokens=40, tokens_per_second=20)) as layout:
            yield layout
    finally:
        httpx_logger.setLevel(level)


def run_and_check(layout: Layout, name: str) -> faults.Report:
    report = faults.run(layout, faults.FAULTS[name], clients=CLIENTS, fault_s=FAULT_S, after_s=AFTER_S)
    figures = "\n".join(f"  {key}: {value}" for key, value in faults.summary(report).items())
    assert not report.failed(), "\n".join(report.failed()) + f"\n{name}:\n{figures}"
    return report


def test_faults_postgres_stopped_passes_every_check(layout: Layout) -> None:
    run_and_check(layout, "postgres-stopped")


def test_faults_database_read_only_passes_every_check(layout: Layout) -> None:
    run_and_check(layout, "database-read-only")


def test_faults_redis_stopped_passes_every_check(layout: Layout) -> None:
    report = run_and_check(layout, "redis-stopped")
    assert report.during(), "no quote started while Redis was down: the check proved nothing"


def test_faults_redis_hung_passes_every_check(layout: Layout) -> None:
    report = run_and_check(layout, "redis-hung")
    assert report.during(), "no quote started while Redis was hung: the check proved nothing"


def test_faults_daphne_killed_passes_every_check(layout: Layout) -> None:
    report = run_and_check(layout, "daphne-killed")
    # The fault hit streams under way: some were cut, and their rows came from the live process.
    assert any(quote.outcome == "cut" for quote in report.quotes), "no stream was cut by the kill"


def test_faults_upstream_hung_passes_every_check(layout: Layout) -> None:
    report = run_and_check(layout, "upstream-hung")
    assert any(quote.code == "upstream_timeout" for quote in report.quotes), "nobody waited for the upstream"


def test_faults_bench_tiny_mode_prints_a_table_per_fault(
    layout: Layout, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """bench/faults.py in its smoke (tiny) mode, on this module's layout, so it cannot rot."""
    bench_faults.main(["--smoke", "--json", str(tmp_path / "faults.json")], layout=layout)

    out = capsys.readouterr().out
    for name in bench_faults.TINY_FAULTS:
        assert f"### {name}" in out, out
    verdicts = [line for line in out.splitlines() if line.startswith("| baseline ")]
    assert len(verdicts) == 1 and "FAIL" not in verdicts[0], out  # no fault: every check passes
    raw = json.loads((tmp_path / "faults.json").read_text())
    assert [run["fault"] for run in raw] == list(bench_faults.TINY_FAULTS)
