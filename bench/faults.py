"""Faults under load (issues 21, 34), longer than CI runs them: the production layout of
harness/faults (two daphnes behind nginx with the deploy rules, PostgreSQL, Redis, the fake
Workers AI upstream), N clients each on its own loopback address asking for one quote after
another, and each fault injected in turn for --fault-seconds:

    .venv/bin/python -m bench.faults --clients 40 --fault-seconds 10
    .venv/bin/python -m bench.faults --faults postgres-stopped --fault-seconds 35
    .venv/bin/python -m bench.faults --smoke       # a few seconds each: the smoke test's run

Faults (harness/faults/faults.py): baseline (none), postgres-stopped, database-read-only,
redis-stopped, redis-hung, daphne-killed, rolling-restart, upstream-hung. Prints, per fault, its
figures (quotes and their outcomes, the quotes started during the fault and how many completed,
the longest silence per request, generations and their rows, /healthz during the fault, log
lines) and the problems its checks found; then one table of every check per fault (PASS, or
FAIL). The raw figures go to artifacts/bench/faults.json. Nothing here fails on a figure: a
failed check is printed, and the exit status is 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import ARTIFACTS, machine, parse_args, table
from harness.faults import faults
from harness.faults.layout import Layout, Settings, started

#: --smoke: the faults it runs (tests/deploy/test_bench_smoke.py reads their tables back).
SMOKE_FAULTS = ("baseline", "upstream-hung")
CHECKS = ("rows", "answers", "silence", "redis outage", "logs")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--fault-seconds", type=float, default=10.0)
    parser.add_argument("--after-seconds", type=float, default=5.0, help="load after each fault ends")
    parser.add_argument(
        "--faults", default="all", help=f"comma-separated, or all: {', '.join(faults.FAULTS)}"
    )
    parser.add_argument("--tokens", type=int, default=100, help="tokens per quote")
    parser.add_argument("--tokens-per-second", type=float, default=20.0)
    parser.add_argument(
        "--ttft-timeout", type=float, default=10.0, help="QUOTES_TTFT_TIMEOUT (of a layout of its own)"
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="more settings for the daphnes"
    )
    parser.add_argument("--json", type=Path, default=ARTIFACTS / "faults.json", help="the raw figures")
    smoke = {"clients": 3, "fault_seconds": 1.0, "after_seconds": 0.5, "tokens": 10, "ttft_timeout": 2.0}
    args = parse_args(parser, argv, smoke={**smoke, "faults": ",".join(SMOKE_FAULTS)})
    names = list(faults.FAULTS) if args.faults == "all" else args.faults.split(",")
    unknown = [name for name in names if name not in faults.FAULTS]
    if unknown:
        parser.error(f"unknown faults: {', '.join(unknown)}")
    args.names = names
    return args


def run_all(layout: Layout, args: argparse.Namespace) -> list[faults.Report]:
    reports = []
    for name in args.names:
        started_at = time.monotonic()
        report = faults.run(
            layout,
            faults.FAULTS[name],
            clients=args.clients,
            fault_s=args.fault_seconds,
            after_s=args.after_seconds,
        )
        print_report(report, time.monotonic() - started_at)
        reports.append(report)
    return reports


def print_report(report: faults.Report, seconds: float) -> None:
    fault = report.fault
    print(f"\n### {fault.name}\n\n{fault.what}; {report.clients} clients, {report.fault_s:g} s.\n")
    rows = [[key, value] for key, value in faults.summary(report).items()]
    rows.append(["run took (s)", f"{seconds:.1f}"])
    print(table(["figure", "value"], rows))
    for problem in report.failed():
        print(f"- FAIL {problem[:1000]}")
    sys.stdout.flush()


def verdicts(reports: list[faults.Report]) -> str:
    rows = []
    for report in reports:
        cells = []
        for check in CHECKS:
            if check not in report.problems:
                cells.append("-")
            else:
                cells.append("FAIL" if report.problems[check] else "PASS")
        rows.append([report.fault.name, *cells])
    return table(["fault", *CHECKS], rows)


def main(argv: list[str] | None = None, *, layout: Layout | None = None) -> None:
    """Run the faults on a layout of their own, or on `layout` (the tests' shared one, for the
    smoke test: its QUOTES_TTFT_TIMEOUT is kept, its quotes' length changed for the run)."""
    args = parse(argv)
    print(machine(), flush=True)
    if layout is None:
        settings = Settings(
            ttft_timeout_s=args.ttft_timeout,
            tokens=args.tokens,
            tokens_per_second=args.tokens_per_second,
            env=dict(item.split("=", 1) for item in args.env),
        )
        with started(settings) as own:
            reports = run_all(own, args)
    else:
        kept = layout.settings.tokens, layout.settings.tokens_per_second
        layout.use_tokens(args.tokens, args.tokens_per_second)
        try:
            reports = run_all(layout, args)
        finally:
            layout.use_tokens(*kept)
    print("\n" + verdicts(reports))
    out = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            [
                {
                    "fault": r.fault.name,
                    "clients": r.clients,
                    "fault_s": r.fault_s,
                    "figures": faults.summary(r),
                    "problems": r.problems,
                }
                for r in reports
            ],
            indent=1,
        )
        + "\n"
    )
    print(f"raw: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
