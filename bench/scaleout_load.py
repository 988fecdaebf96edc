"""bench/load.py in the production layout: daphne processes behind nginx, sharing PostgreSQL and
Redis, as docs/deployment.md runs them (harness/services.py starts the same servers).

    .venv/bin/python -m bench.scaleout_load --processes 1,2 --ladder 200,300,400 --duration 20
    .venv/bin/python -m bench.scaleout_load --processes 2 --streams 1000 --duration 60   # graceful

Each run starts fresh servers (one to N daphne processes as deploy/systemd/persona-quotes@.service
starts them, and nginx in front of them with deploy/nginx's upstream block and locations:
harness.daphne) against one PostgreSQL and one Redis for the whole invocation, and the stamping
upstream of bench/load.py (50 tokens/s per stream, each token stamped with the time it left).
The load client is load.py's: one asyncio loop, raw sockets, 200 new streams/s, all through
nginx. Figures as in load.py, summed over the daphne processes. Log rows are counted in
PostgreSQL and compared with the requests the daphnes answered, from nginx's log of its
attempts: a refusal has its row too (shared with the other refusals of its window: its
`request_count`), and a request nginx retried on the other process after a 503 was answered,
and counted, by both (bench.common.row_accounting).

The per-client limits are raised (the load comes from one address, as no real visitor would);
the per-process open-stream limit is left as configured (by default adaptive, following each
process's event-loop lag, with no static ceiling: quotes/ai/gateway/capacity.py): it is what
turns the streams a process cannot hold into quick 503s. Pass --env NAME=VALUE to change it
(QUOTES_LOOP_LAG_TARGET_MS=0 and no QUOTES_MAX_OPEN_STREAMS: no limit at all, for the raw
capacity). Each daphne's limit, open streams and lag (its /metrics, once a second) and every
process's CPU during the plateau are in the report's "admission".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.common import (
    ARTIFACTS,
    ROWS_BY_STATUS,
    HasApiBaseUrl,
    attempts_site,
    machine,
    nginx_attempts,
    parse_args,
    settled_counts,
    table,
    workers_ai_env,
)
from bench.load import StampingUpstream, build_report, capacity_lines, drive, raise_fd_limit
from harness.daphne import migrate, production_base_env, start_daphne, wait_until_healthy
from harness.services import free_port, nginx, postgres, redis, stop_process

if TYPE_CHECKING:
    import psycopg


def production_env(
    database_url: str, redis_url: str, upstream: HasApiBaseUrl, extra: list[str]
) -> dict[str, str]:
    env = production_base_env(
        database_url=database_url,
        redis_url=redis_url,
        DJANGO_LOG_LEVEL="WARNING",
        **workers_ai_env(upstream),
        AI_MAX_CONNECTIONS="2000",
        QUOTES_METRICS_TOKEN=METRICS_TOKEN,
        QUOTES_CACHE_TTL="0",
        QUOTES_RATE_LIMIT="1000000/s",
        QUOTES_MAX_CONCURRENT_STREAMS="1000000",
    )
    for item in extra:
        name, _, value = item.partition("=")
        env[name] = value
    return env


@contextlib.contextmanager
def daphnes(
    count: int, env: dict[str, str], workdir: Path
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """`count` daphne processes started as deploy/systemd/persona-quotes@.service starts them
    (`python -m quotes.ops.server`, harness/daphne.py), each on its own 127.0.0.1 port."""
    started: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        for index in range(count):
            port = free_port()
            log = workdir / f"daphne-{index}.log"
            started.append((start_daphne(port, env, log), f"127.0.0.1:{port}", log))
        for process, address, log in started:
            wait_until_healthy(f"http://{address}", process, log)
        yield [(process, address) for process, address, _ in started]
    finally:
        for process, _, _ in started:
            stop_process(process)


def _connect(database_url: str) -> psycopg.Connection[Any]:
    import psycopg

    return psycopg.connect(database_url.replace("postgres://", "postgresql://", 1))


def count_rows(database_url: str, expected: int, timeout_s: float = 120.0) -> dict[str, int]:
    """Rows by status in the PostgreSQL log, once they are all there (bench.common.settled_counts)."""

    def fetch() -> dict[str, int]:
        with _connect(database_url) as connection:
            return dict(connection.execute(ROWS_BY_STATUS).fetchall())

    return settled_counts(fetch, expected, timeout_s)


def truncate(database_url: str) -> None:
    with _connect(database_url) as connection:
        connection.execute("TRUNCATE quotes_generation CASCADE")


def one_run(
    processes: int, streams: int, args: argparse.Namespace, database_url: str, redis_url: str, workdir: Path
) -> dict[str, Any]:
    tokens = int(args.duration * args.tokens_per_second)
    upstream = StampingUpstream(tokens, args.tokens_per_second)
    truncate(database_url)
    load_before = os.getloadavg()
    try:
        env = production_env(database_url, redis_url, upstream, args.env)
        with daphnes(processes, env, workdir) as servers:
            port = free_port()
            nginx_dir = workdir / f"nginx-{processes}-{streams}-{time.time_ns()}"
            nginx_dir.mkdir()
            access_log = nginx_dir / "attempts.log"
            site = attempts_site(port, [address for _, address in servers], access_log)
            with (
                nginx(
                    nginx_dir,
                    site=site,
                    port=port,
                    worker_connections=2 * streams + 256,
                ) as proxy,
                AdmissionWatch([address for _, address in servers], roots=layout_roots(workdir)) as watch,
            ):
                run, plateau = asyncio.run(
                    drive(
                        proxy.url,
                        [p.pid for p, _ in servers],
                        upstream,
                        streams,
                        args.duration,
                        args.ramp_per_second,
                    )
                )
                # Each attempt a daphne answered has its row; a refused request nginx then tried
                # on the other process has one in each (bench.common.row_accounting).
                attempts = nginx_attempts(access_log)
                answered = sum(attempts["answered_by_daphne"].values())
                rows = count_rows(database_url, expected=answered)
    finally:
        upstream.close()
    report = build_report(
        run,
        plateau,
        rows,
        expected_rows=answered,
        path=f"app x{processes}",
        streams=streams,
        tokens=tokens,
        args=args,
        load_before=load_before,
    )
    report["processes"] = processes
    report["nginx"] = attempts
    report["admission"] = watch.summary((plateau["ramp_s"] + 1, args.duration - 1))
    return report


def layout_roots(workdir: Path) -> list[int]:
    """This process (the load client, and under it the upstream, the daphnes and nginx) and
    PostgreSQL's postmaster (pg_ctl starts it on its own)."""
    roots = [os.getpid()]
    with contextlib.suppress(OSError, ValueError):
        roots.append(int((workdir / "postgres" / "data" / "postmaster.pid").read_text().split()[0]))
    return roots


METRICS_TOKEN = "bench-scaleout-metrics-token-0123456789"


class AdmissionWatch(threading.Thread):
    """Once a second for the whole run: each daphne's admission as its /metrics shows it
    (quotes.ai.gateway.capacity: the limit, the open streams, the smoothed event-loop lag),
    scraped from each process directly (not through nginx); and the CPU time of every process
    of the layout (this load client, the upstream, nginx, the daphnes, Redis, PostgreSQL), to
    say where the machine's cores go during the plateau."""

    def __init__(self, addresses: list[str], roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.addresses = addresses
        self.roots = roots
        self.samples: list[dict[str, float]] = []
        self.cpu: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()
        self.started = time.monotonic()

    def __enter__(self) -> AdmissionWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(5)

    def run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self.stop.wait(1.0):
            self.cpu.append((time.monotonic() - self.started, cpu_by_role(self.roots)))
            for address in self.addresses:
                try:
                    response = httpx.get(
                        f"http://{address}/metrics",
                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                        timeout=5,
                    )
                except httpx.HTTPError:
                    continue
                sample = {"process": float(self.addresses.index(address))}
                for family in text_string_to_metric_families(response.text):
                    if family.name in ADMISSION_GAUGES:
                        sample[family.name] = sum(s.value for s in family.samples)
                self.samples.append(sample)

    def summary(self, plateau: tuple[float, float]) -> dict[str, Any]:
        """Per gauge: min, median and max over the samples with a stream open (all processes);
        and each role's CPU (% of one core) between `plateau`'s two times (s from the start)."""
        busy = [s for s in self.samples if s.get("quotes_admission_open_streams", 0) > 0]
        out: dict[str, Any] = {"samples": len(busy)}
        for name in ADMISSION_GAUGES:
            values = sorted(s[name] for s in busy if name in s)
            if values:
                # The middle sample, not an interpolated median: with no limit the limit reads
                # +Inf, and inf - inf is nan.
                out[name] = [round(values[0], 4), round(values[len(values) // 2], 4), round(values[-1], 4)]
        inside = [(t, cpu) for t, cpu in self.cpu if plateau[0] <= t <= plateau[1]]
        if len(inside) >= 2:
            (t0, first), (t1, last) = inside[0], inside[-1]
            out["cpu_pct"] = {
                role: round(100 * (last.get(role, 0.0) - first.get(role, 0.0)) / (t1 - t0), 1)
                for role in sorted(last)
            }
        return out


def cpu_by_role(roots: list[int]) -> dict[str, float]:
    """CPU seconds used so far by `roots` and every process under them, summed by role; how much
    of all that was in the kernel (system time: loopback TCP, mostly); and how long the daphnes'
    event-loop threads were ready to run but waited for a core (the run queue)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    kernel: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        kernel[int(entry)] = int(fields[12]) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    totals: dict[str, float] = {}
    todo = [pid for pid in roots if pid in used]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = next((name for key, name in ROLES if key in command), "other")
        if pid == os.getpid():
            role = "load client"
        totals[role] = totals.get(role, 0.0) + used[pid]
        if role == "daphne":
            # The event loop's thread, ready to run but waiting for a core (schedstat's second
            # field, in ns): what a busy machine adds to every token.
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/schedstat") as schedstat:
                    waited = int(schedstat.read().split()[1]) / 1e9
                totals[WAITED] = totals.get(WAITED, 0.0) + waited
        totals["of which in the kernel"] = totals.get("of which in the kernel", 0.0) + kernel[pid]
    return totals


WAITED = "daphne loops waiting for a core"
#: (a piece of the command line, the role it names), first match wins
ROLES = (
    ("quotes.ops.server", "daphne"),
    ("nginx", "nginx"),
    ("redis-server", "redis"),
    ("postgres", "postgres"),
    ("spawn_main", "upstream"),
)


ADMISSION_GAUGES = (
    "quotes_admission_limit",
    "quotes_admission_open_streams",
    "quotes_event_loop_lag_seconds",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2", help="comma-separated daphne process counts")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--ladder", default="", help="comma-separated stream counts, one run each")
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--tokens-per-second", type=float, default=50)
    parser.add_argument("--ramp-per-second", type=float, default=200)
    parser.add_argument("--bound-ms", type=float, default=50.0)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    # A cap of 3 per process: the smoke run's 10 streams meet refusals, and nginx's retry of
    # each on the other process (their rows counted on both).
    args = parse_args(
        parser,
        argv,
        smoke={"processes": "2", "streams": 10, "duration": 2, "env": ["QUOTES_MAX_OPEN_STREAMS=3"]},
    )
    counts = [int(x) for x in args.ladder.split(",")] if args.ladder else [args.streams]
    process_counts = [int(x) for x in args.processes.split(",")]
    print(machine(), f"; open files limit {raise_fd_limit(6 * max(counts) + 512)}", flush=True)
    reports = []
    with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as tmp:
        workdir = Path(tmp)
        with postgres(workdir) as pg, redis(workdir) as redis_url:
            env = production_env(pg.url, redis_url, StampingUpstreamStub(), args.env)
            migrate(env)
            for processes in process_counts:
                for streams in counts:
                    report = one_run(processes, streams, args, pg.url, redis_url, workdir)
                    reports.append(report)
                    print(json.dumps(report, indent=1), flush=True)
    rows = [
        [
            r["processes"],
            r["streams"],
            f"{r['completed']}/{r['streams']}",
            r["refused_503"],
            r["refused_with_retry_after"],
            r["refusal_ms"]["p99"],
            r["errors"],
            f"{r['rows_total']}/{r['rows_expected']}",
            r["lost_rows"],
            r["extra_rows"],
            r["added_delay_ms"]["p50"],
            r["added_delay_ms"]["p99"],
            r["daphne_cpu_pct"],
            r["cpu_per_token_us"],
            round(r["rss_per_stream_kib"]),
            r["daphne_threads_max"],
            "/".join(f"{x:.1f}" for x in r["load_average_before"]),
        ]
        for r in reports
    ]
    print(
        table(
            [
                "daphnes",
                "streams",
                "completed",
                "503",
                "503 with Retry-After",
                "503 p99 ms",
                "other errors",
                "rows/answered",
                "lost rows",
                "extra rows",
                "added p50 ms",
                "added p99 ms",
                "daphne CPU %",
                "CPU µs/token",
                "RSS KiB/stream",
                "threads",
                "load avg before",
            ],
            rows,
        )
    )
    print("\n".join(capacity_lines(reports, args.bound_ms)))
    for r in reports:
        print(
            f"{r['processes']} daphnes, {r['streams']} streams: admission (min/median/max) {r['admission']}"
        )
    out = ARTIFACTS / "scaleout-load.json"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=1) + "\n")
    print(f"raw: {out}", file=sys.stderr)


class StampingUpstreamStub:
    """For `migrate`, which needs the settings to load but no upstream."""

    api_base_url = "http://127.0.0.1:9/client/v4"


if __name__ == "__main__":
    main()
