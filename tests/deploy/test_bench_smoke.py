"""Every benchmark in bench/, run the way a reader runs it (`python -m bench.<name> --smoke`: a
few streams, a few seconds) and its printed figures read back: it exits 0, reports no error and
no lost log row, its counts add up, and its ratios and times are positive and finite. A bench
that no longer works with the app (a layout written by hand that the deploy files outgrew, a
count that misreads the log) then fails here, not in the hands of its next reader. No figure is
compared with a bound: speed belongs in the benches themselves.

Every bench module (a bench/*.py with a command line) is either smoked here or excused below
with its reason: `test_every_bench_is_smoked_or_excused` fails for a new bench until it is one
or the other.

Excused, and why:
- bench/faults.py and bench/voice.py: smoked by their own modules (tests/faults/test_faults.py on its
  production layout, tests/backends/test_voice.py on the embedded model).

Parts skipped where their tool is missing (requirements-bench.txt, not installed into .venv by
scripts/bootstrap): bench/proxy_overhead.py's uvicorn row (uvicorn) and its profile (py-spy).

The benches start their own servers (daphne, and for the production-layout ones PostgreSQL,
Redis and nginx): system layer, run once, not again on PostgreSQL + Redis. They write their raw
outputs under BENCH_ARTIFACTS (here a temporary directory, not artifacts/bench/).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(sys.executable)

Table = list[dict[str, str]]


def tables(output: str) -> list[Table]:
    """The Markdown tables a bench printed, each a list of rows by column header."""
    found: list[Table] = []
    block: list[str] = []
    for line in [*output.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2:
            cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in block]
            found.append([dict(zip(cells[0], row, strict=True)) for row in cells[2:]])
        block = []
    return found


def table_with(output: str, column: str) -> Table:
    """The last table printed with `column` (a bench may print a table as it goes and again in
    its report)."""
    matching = [t for t in tables(output) if t and column in t[0]]
    assert matching, f"no table with a {column!r} column in:\n{output[-4000:]}"
    return matching[-1]


def number(text: str) -> float:
    value = float(text.replace(",", "").removeprefix("+").split()[0])
    assert math.isfinite(value), text
    return value


def positive(text: str) -> float:
    value = number(text)
    assert value > 0, f"{text!r} is not a positive figure"
    return value


def row(table: Table, column: str, value: str) -> dict[str, str]:
    rows = [r for r in table if r[column] == value]
    assert len(rows) == 1, f"{column} = {value!r}: {table}"
    return rows[0]


# -- what each bench must show ---------------------------------------------------------------------


def check_load(output: str) -> None:
    summary = table_with(output, "tokens recv/expected")
    assert [r["path"] for r in summary] == ["naive", "app (metrics on)"], summary
    for r in summary:
        assert r["completed"] == f"{r['streams']}/{r['streams']}", r
        assert (r["503"], r["errors"]) == ("0", "0"), r
        assert number(r["tokens recv/expected"]) == 1.0, r
        for column in ("added p50 ms", "added p99 ms", "daphne CPU %", "CPU µs/token", "RSS KiB/stream"):
            positive(r[column])
    app = summary[1]
    assert (app["lost rows"], app["extra rows"]) == ("0", "0"), app


def check_scaleout_load(output: str) -> None:
    [r] = table_with(output, "rows/answered")
    streams = int(r["streams"])
    completed, offered = map(int, r["completed"].split("/"))
    refused = int(r["503"])
    assert offered == streams and completed + refused == streams, r
    # The smoke run's cap (3 per process) refuses some: the refusals' shared rows are counted.
    assert refused > 0 and r["503 with Retry-After"] == r["503"], r
    assert r["other errors"] == "0", r
    rows, answered = map(int, r["rows/answered"].split("/"))
    assert rows == answered >= completed + refused, r
    assert (r["lost rows"], r["extra rows"]) == ("0", "0"), r
    for column in ("503 p99 ms", "added p50 ms", "added p99 ms", "daphne CPU %", "CPU µs/token"):
        positive(r[column])


def check_rolling_restart(output: str) -> None:
    [r] = table_with(output, "resume failed")
    quotes = int(r["quotes (during the restart)"].split()[0])
    whole = int(r["whole (during)"].split()[0])
    assert quotes > 0 and whole + int(r["resumed"]) == quotes, r
    assert (r["resume failed"], r["lost"]) == ("0", "0"), r
    rows, expected = map(int, r["rows / expected"].split(" / "))
    assert rows == expected > 0, r
    assert (r["lost rows"], r["extra rows"]) == ("0", "0"), r
    restarts = table_with(output, "drain + exit s")
    assert [p["daphne"] for p in restarts] == ["1", "2"], restarts
    assert all(p["exit code"] == "0" for p in restarts), restarts


def check_cache(output: str) -> None:
    result = table_with(output, "cache header")
    assert [(r["path"], r["cache header"]) for r in result] == [("miss", "MISS"), ("hit", "HIT")], result
    for r in result:
        for column in ("TTFB p50 ms", "TTFT p50 ms", "to [DONE] p50 ms", "to [DONE] p99 ms"):
            positive(r[column])


def check_proxy_overhead(output: str) -> None:
    ttft = table_with(output, "added p50 / naive's")
    paths = [r["path"] for r in ttft]
    assert paths[:3] == ["direct (fake upstream)", "naive Django proxy under daphne", "app under daphne"]
    assert paths[-1] == "app under daphne, cache hit", paths
    for r in ttft:
        positive(r["TTFT p50 ms"])
    assert number(row(ttft, "path", "naive Django proxy under daphne")["added p50 / naive's"]) == 1.0
    positive(row(ttft, "path", "app under daphne")["added p50 / naive's"])
    rate = table_with(output, "ratio to direct")
    assert len(rate) == len(paths) - 1, rate  # no tokens/s row for a (paced) cache hit
    for r in rate:
        positive(r["tokens/s"])
        positive(r["ratio to direct"])
        assert r["tokens"] == "20", r
    reuse = table_with(output, "upstream connections/request")
    assert row(reuse, "path", "direct, new connection each")["upstream connections/request"] == "1.00"
    for r in reuse:
        positive(r["TTFT p50 ms"])
    attribution = re.search(r"TTFT direct p50 (\S+) ms; through the ASGI app in-process p50 (\S+) ms", output)
    assert attribution, output[-3000:]
    positive(attribution[1])
    positive(attribution[2])


def check_request_cost(output: str) -> None:
    costs = table_with(output, "wall p50")
    for name in (
        "stream: POST /api/quotes/stream to its first token",
        "refusal: the same at the open-stream cap (503)",
    ):
        r = row(costs, "request", name)
        for column in ("wall p50", "wall p90", "CPU p50", "CPU p90"):
            positive(r[column])
    headers = re.search(r"the refusal's headers: (.*)", output)
    assert headers and "Retry-After" in headers[1].split(", "), output[-2000:]


def check_metrics_cost(output: str) -> None:
    per_stream = dict(re.findall(r"metrics (on |off): (\S+) µs per stream", output))
    assert sorted(per_stream) == ["off", "on "], output
    for value in per_stream.values():
        positive(value)


def check_local_model(output: str) -> None:
    speed = table_with(output, "ratio to raw")
    assert [r["path"] for r in speed] == [
        "raw xllamacpp (handle_completions)",
        "LocalBackend.stream() in-process",
        "HTTP endpoint under daphne",
    ], speed
    for r in speed:
        for column in ("tokens/s p50 (request to last token)", "ratio to raw", "TTFT p50 ms"):
            positive(r[column])
        # the smoke run's budget, and the mark that ends a quote cut short by it
        assert 0 < number(r["tokens p50"]) <= 4 + 1, r
    slots = table_with(output, "aggregate tokens/s")
    assert [r["requests at once"] for r in slots] == ["1", "2", "4"], slots
    for r in slots:
        for column in ("aggregate tokens/s", "one at a time, tokens/s", "ratio", "tokens/s per stream"):
            positive(r[column])
    memory = table_with(output, "RssFile")
    for r in memory:
        positive(r["VmRSS"])
    positive(row(memory, "state", "after the model loads (one generation)")["added"])
    streams = table_with(output, "KiB/stream")
    assert [r["open streams"] for r in streams] == ["0", "2", "4"], streams
    for r in streams:
        positive(r["VmRSS"])


def proxy_overhead_args() -> list[str]:
    args = []
    if importlib.util.find_spec("uvicorn") is None:
        args.append("--no-uvicorn")
    if not (PYTHON.parent / "py-spy").exists():
        args += ["--profile-seconds", "0"]
    return args


#: bench module -> (extra arguments beside --smoke, what its output must show)
SMOKED: dict[str, tuple[Callable[[], list[str]], Callable[[str], None]]] = {
    "load": (list, check_load),
    "scaleout_load": (list, check_scaleout_load),
    "rolling_restart": (list, check_rolling_restart),
    "cache": (list, check_cache),
    "proxy_overhead": (proxy_overhead_args, check_proxy_overhead),
    "request_cost": (list, check_request_cost),
    "metrics_cost": (list, check_metrics_cost),
    "local_model": (list, check_local_model),
}

#: bench module -> why it is not smoked (the module's docstring says more)
EXCUSED = {
    "voice": "smoked by tests/backends/test_voice.py (one quote per persona, small max_tokens)",
    "faults": "smoked by tests/faults/test_faults.py (test_faults_bench_tiny_mode_prints_a_table_per_fault), on that module's layout",
}


def bench_modules() -> set[str]:
    """bench/*.py modules with a command line (`if __name__ == "__main__":`); bench/common.py is
    their helpers."""
    return {
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M)
    }


def test_every_bench_is_smoked_or_excused() -> None:
    assert not set(SMOKED) & set(EXCUSED)
    assert bench_modules() == set(SMOKED) | set(EXCUSED), (
        "a bench in bench/ needs a --smoke run in SMOKED (or a reason in EXCUSED and the docstring)"
    )


def test_tables_are_read_by_header() -> None:
    output = "intro\n| a | b c |\n|---|---|\n| 1 | x, y |\n| 2 | z |\nafter\n| a |\n|---|\n| 3 |\n"
    assert tables(output) == [[{"a": "1", "b c": "x, y"}, {"a": "2", "b c": "z"}], [{"a": "3"}]]
    assert table_with(output, "b c") == [{"a": "1", "b c": "x, y"}, {"a": "2", "b c": "z"}]


@pytest.mark.parametrize("name", sorted(SMOKED))
def test_bench_runs_in_smoke_mode(name: str, tmp_path: Path) -> None:
    extra, check = SMOKED[name]
    env = {**os.environ, "BENCH_ARTIFACTS": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--smoke", *extra()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    check(result.stdout)
