"""Every benchmark in bench/, run the way a reader runs it (`python -m bench.<name> --smoke`: a
few streams, a few seconds) and its printed tables read back: it exits 0, reports no error and
no lost log row, its counts add up, and its ratios and times are positive and finite. A bench
that no longer works with the app (a module it imports moved, a layout written by hand that the
deploy files outgrew, a count that misreads the log) then fails here, not in the hands of its
next reader. No figure is compared with a bound: speed belongs in the benches themselves.

Every bench module (a bench/*.py with a command line) is smoked here:
`test_every_bench_is_smoked` fails for a new bench until it is. bench/faults.py runs in this
process on the production layout the system layer shares (harness.scaleout.shared: started once
for test_scaleout.py and tests/faults too); the others in a subprocess each.

The benches start their own servers (daphne, and for the production-layout ones PostgreSQL,
Redis and nginx; local_model and voice load the embedded model): system layer, run once, not
again on PostgreSQL + Redis. They write their raw outputs under BENCH_ARTIFACTS (here a temporary
directory, not artifacts/bench/).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from bench.load import PATHS
from bench.proxy_overhead import APP, BARE, DIRECT, HIT, NEW_CONNECTION, STACK

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]

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


def fraction(text: str, separator: str = "/") -> tuple[int, int]:
    a, b = text.split(separator)
    return int(a), int(b)


# -- what each bench must show ---------------------------------------------------------------------


def check_load(output: str) -> None:
    summary = table_with(output, "tokens recv/expected")
    assert [r["path"] for r in summary] == list(PATHS.values()), summary
    for r in summary:
        assert r["completed"] == f"{r['streams']}/{r['streams']}", r
        assert (r["503"], r["errors"]) == ("0", "0"), r
        assert number(r["tokens recv/expected"]) == 1.0, r
        for column in ("added p50 ms", "added p99 ms", "daphne CPU %", "CPU µs/token", "threads"):
            positive(r[column])
        for column in ("CPU / bare naive's", "CPU / same-stack naive's"):
            positive(r[column])
        number(r["RSS KiB/stream"])  # a few streams' worth is noise, either side of 0
        number(r["threads/stream"])
    assert row(summary, "path", PATHS["naive"])["CPU / bare naive's"] == "1.00"
    assert row(summary, "path", PATHS["stack"])["CPU / same-stack naive's"] == "1.00"
    app = summary[-1]
    assert (app["lost rows"], app["extra rows"]) == ("0", "0"), app


def check_scaleout_load(output: str) -> None:
    [r] = table_with(output, "rows/admitted")
    streams = int(r["streams"])
    completed, offered = fraction(r["completed"])
    refused = int(r["503"])
    assert offered == streams and completed + refused == streams, r
    # The smoke run's cap (3 per process) refuses some, and nginx tries the other process first.
    assert refused > 0 and r["503 with Retry-After"] == r["503"], r
    assert r["other errors"] == "0", r
    assert fraction(r["rows/admitted"]) == (completed, completed), r
    assert (r["lost rows"], r["extra rows"]) == ("0", "0"), r
    counted, answered = fraction(r["refusals counted/answered"])
    # At most: two processes writing an hour's first count at once lose one's (quotes/rows.py's
    # update-or-create against the unique constraint), and a count written as a process exits
    # can be missed.
    assert 0 < counted <= answered and answered >= refused, r
    for column in ("503 p99 ms", "added p50 ms", "added p99 ms", "daphne CPU %", "CPU µs/token"):
        positive(r[column])


def check_rolling_restart(output: str) -> None:
    [r] = table_with(output, "resume failed")
    quotes = int(r["quotes (during the restart)"].split()[0])
    whole = int(r["whole (during)"].split()[0])
    assert quotes > 0 and whole + int(r["resumed"]) == quotes, r
    assert (r["resume failed"], r["lost"]) == ("0", "0"), r
    rows, expected = fraction(r["rows / expected"], " / ")
    assert rows == expected == quotes, r
    assert (r["lost rows"], r["extra rows"]) == ("0", "0"), r
    # Refused while draining: counted by the app (nginx's log, which gives `answered`, misses a
    # refusal whose client had already gone).
    counted, _ = fraction(r["refusals counted / answered"], " / ")
    assert counted > 0, r
    restarts = table_with(output, "drain + exit s")
    assert [p["daphne"] for p in restarts] == ["1", "2"], restarts
    assert all(p["exit code"] == "0" for p in restarts), restarts


def check_proxy_overhead(output: str) -> None:
    ttft = table_with(output, "added / same-stack naive's")
    assert [r["path"] for r in ttft] == [DIRECT, NEW_CONNECTION, BARE, STACK, APP, HIT], ttft
    for r in ttft:
        positive(r["TTFT p50 ms"])
    for r in ttft[2:]:
        positive(r["added / bare naive's"])
        positive(r["added / same-stack naive's"])
    assert row(ttft, "path", BARE)["added / bare naive's"] == "1.00"
    assert row(ttft, "path", STACK)["added / same-stack naive's"] == "1.00"
    connections = {r["path"]: r["upstream connections/request"] for r in ttft}
    assert (connections[DIRECT], connections[NEW_CONNECTION]) == ("0.00", "1.00"), ttft
    assert all(0 <= number(connections[p]) <= 1 for p in (BARE, APP)), ttft
    ratios = re.search(r"added TTFT p50: (\S+)x the same-stack naive proxy's .*?, (\S+)x the bare", output)
    assert ratios, output[-3000:]
    positive(ratios[1])
    positive(ratios[2])
    rate = table_with(output, "ratio to direct")
    assert [r["path"] for r in rate] == [DIRECT, BARE, STACK, APP], rate
    for r in rate:
        for column in (
            "tokens/s",
            "ratio to direct",
            "tokens/s, request to last",
            "ratio to direct, request to last",
            "TTFT p50 ms",
        ):
            positive(r[column])
        assert r["tokens"] == "20", r
    assert "## py-spy profile of daphne" in output, output[-3000:]
    assert shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None or "busy samples" in output
    costs = table_with(output, "wall p50 ms")
    for name in (
        "stream: POST /api/quotes/stream to its first token",
        "refusal: 503 over_capacity, whole answer",
        "a whole 40-token quote, start to end",
        "the same-stack naive proxy's",
    ):
        r = row(costs, "request", name)
        for column in ("wall p50 ms", "wall p90 ms", "CPU p50 ms", "CPU p90 ms"):
            positive(r[column])
    in_process = re.search(r"TTFT direct p50 (\S+) ms; through the ASGI app in-process p50 (\S+) ms", output)
    assert in_process, output[-3000:]
    positive(in_process[1])
    positive(in_process[2])
    whole = re.search(r"CPU of a whole 40-token quote p50: (\S+)x the same-stack naive proxy's", output)
    assert whole, output[-3000:]
    positive(whole[1])
    headers = re.search(r"The refusal's headers: (.*)", output)
    assert headers and "Retry-After" in headers[1].split(", "), output[-3000:]


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
    positive(row(memory, "state", "after the model loads (the warm-up)")["added"])


def check_voice(output: str) -> None:
    figures = {r["figure"]: r["value"] for r in table_with(output, "figure")}
    assert figures["quotes (errors or empty)"] == "2 (0)", figures
    for name in ("on topic", "ending cleanly"):
        assert 0 <= number(figures[name].removesuffix("%")) <= 100, figures
    assert 0 < number(figures["mean length, words"]) <= 8 + 1, figures  # the budget, and the lead
    assert number(figures["longest run copied from an example, words"]) < 8, figures
    positive(figures["TTFT warm p50 / p90 (frame in a slot), ms"])
    assert number(figures["frame, prompt tokens p50"]) > 100, figures
    sheet = re.search(r"Blind sheet, key and raw quotes: (\S+)", output)
    assert sheet, output[-2000:]
    numbered = [
        line for line in (Path(sheet[1]) / "sheet.md").read_text().splitlines() if re.match(r"\d+\. ", line)
    ]
    assert len(numbered) == 2, numbered


def check_faults(output: str) -> None:
    from bench.faults import CHECKS, SMOKE_FAULTS

    for name in SMOKE_FAULTS:
        assert f"### {name}" in output, output[-3000:]
        figures = {r["figure"]: r["value"] for r in tables(output.split(f"### {name}")[1])[0]}
        seen, with_row = fraction(figures["generations seen / with one row"], " / ")
        assert seen == with_row > 0, figures
    verdicts = table_with(output, "fault")
    assert [r["fault"] for r in verdicts] == list(SMOKE_FAULTS), verdicts
    baseline = row(verdicts, "fault", "baseline")
    assert [baseline[check] for check in CHECKS] == ["PASS", "PASS", "PASS", "-", "PASS"], baseline


SUBPROCESS_SMOKES = ("load", "local_model", "proxy_overhead", "rolling_restart", "scaleout_load", "voice")


@pytest.fixture(scope="module")
def smokes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[str]]]:
    """Every subprocess smoke, two at a time (their figures mean nothing: only their tables are
    read), started when the first is asked for."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(smoke, name, tmp_path_factory.mktemp(name)) for name in SUBPROCESS_SMOKES}


def smoke(name: str, artifacts: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--smoke"],
        cwd=ROOT,
        env={**os.environ, "BENCH_ARTIFACTS": str(artifacts)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    return result.stdout


def faults_run(tmp_path: Path) -> str:
    """bench/faults.py's smoke on the shared production layout (its QUOTES_TTFT_TIMEOUT kept)."""
    import contextlib
    import io

    from bench import faults
    from harness import scaleout

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        faults.main(["--smoke", "--json", str(tmp_path / "faults.json")], layout=scaleout.shared())
    raw = json.loads((tmp_path / "faults.json").read_text())
    assert [run["fault"] for run in raw] == list(faults.SMOKE_FAULTS), raw
    return output.getvalue()


CHECKS: dict[str, Callable[[str], None]] = {
    "load": check_load,
    "scaleout_load": check_scaleout_load,
    "rolling_restart": check_rolling_restart,
    "proxy_overhead": check_proxy_overhead,
    "local_model": check_local_model,
    "voice": check_voice,
    "faults": check_faults,
}


def bench_modules() -> set[str]:
    """bench/*.py modules with a command line (`if __name__ == "__main__":`); bench/common.py is
    their helpers."""
    return {
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M)
    }


def test_every_bench_is_smoked() -> None:
    assert bench_modules() == set(CHECKS), "a bench in bench/ needs a --smoke run in CHECKS"


def test_tables_are_read_by_header() -> None:
    output = "intro\n| a | b c |\n|---|---|\n| 1 | x, y |\n| 2 | z |\nafter\n| a |\n|---|\n| 3 |\n"
    assert tables(output) == [[{"a": "1", "b c": "x, y"}, {"a": "2", "b c": "z"}], [{"a": "3"}]]
    assert table_with(output, "b c") == [{"a": "1", "b c": "x, y"}, {"a": "2", "b c": "z"}]


@pytest.mark.parametrize("name", SUBPROCESS_SMOKES)
def test_bench_runs_in_smoke_mode(name: str, smokes: dict[str, Future[str]]) -> None:
    CHECKS[name](smokes[name].result())


def test_faults_bench_runs_in_smoke_mode(smokes: dict[str, Future[str]], tmp_path: Path) -> None:
    wait(smokes.values())  # after the others: it shares the machine with the layout it runs on
    check_faults(faults_run(tmp_path))
