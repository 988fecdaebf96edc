"""bench/load.py in the production layout: daphne processes behind nginx, sharing PostgreSQL and
Redis, as docs/deployment.md runs them (tests/scaleout starts the same servers).

    .venv/bin/python -m bench.scaleout_load --processes 1,2 --ladder 200,300,400 --duration 20
    .venv/bin/python -m bench.scaleout_load --processes 2 --streams 1000 --duration 60   # graceful

Each run starts fresh servers (one to N daphne processes and nginx in front of them, least_conn,
keep-alive to daphne) against one PostgreSQL and one Redis for the whole invocation, and the
stamping upstream of bench/load.py (50 tokens/s per stream, each token stamped with the time it
left). The load client is load.py's: one asyncio loop, raw sockets, 200 new streams/s, all through
nginx. Figures as in load.py, summed over the daphne processes; log rows are counted in
PostgreSQL and compared with the responses (a 503 refusal has its row too).

The per-client limits are raised (the load comes from one address, as no real visitor would);
the per-process open-stream cap (QUOTES_MAX_OPEN_STREAMS) is left as configured: it is what
turns the streams a process cannot hold into quick 503s. Pass --env NAME=VALUE to change it.
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import (
    ARTIFACTS,
    PYTHON,
    ROOT,
    ROWS_BY_STATUS,
    HasApiBaseUrl,
    machine,
    settled_counts,
    table,
    workers_ai_env,
)
from bench.load import StampingUpstream, build_report, capacity_lines, drive, raise_fd_limit
from tests.deployed import deploy_upstream, start_daphne, wait_until_healthy
from tests.scaleout.run import production_base_env
from tests.scaleout.services import free_port, nginx, postgres, redis, stop_process

if TYPE_CHECKING:
    import psycopg

LOCATIONS_CONF = ROOT / "deploy" / "nginx" / "persona-quotes-locations.conf"


def production_env(
    database_url: str, redis_url: str, upstream: HasApiBaseUrl, extra: list[str]
) -> dict[str, str]:
    env = production_base_env(
        database_url=database_url,
        redis_url=redis_url,
        DJANGO_LOG_LEVEL="WARNING",
        **workers_ai_env(upstream),
        AI_MAX_CONNECTIONS="2000",
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
    (`python -m quotes.server`, tests/deployed.py), each on its own 127.0.0.1 port."""
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


def nginx_site(port: int, addresses: list[str]) -> str:
    # The deploy file's upstream block (max_fails=0 among its parameters: the app's 503s must
    # not take a process out of rotation), pointed at these processes.
    return f"""
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}
    {deploy_upstream(addresses)}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        server_name 127.0.0.1;
        include {LOCATIONS_CONF};
    }}
"""


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
            site = nginx_site(port, [address for _, address in servers])
            nginx_dir = workdir / f"nginx-{processes}-{streams}-{time.time_ns()}"
            nginx_dir.mkdir()
            with nginx(
                nginx_dir,
                site=site,
                port=port,
                worker_connections=2 * streams + 256,
            ) as proxy:
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
                answered = sum(1 for r in run.results if r.status)
                rows = count_rows(database_url, expected=answered)
    finally:
        upstream.close()
    report = build_report(
        run,
        plateau,
        rows,
        path=f"app x{processes}",
        streams=streams,
        tokens=tokens,
        args=args,
        load_before=load_before,
    )
    report["processes"] = processes
    return report


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
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.ladder.split(",")] if args.ladder else [args.streams]
    process_counts = [int(x) for x in args.processes.split(",")]
    print(machine(), f"; open files limit {raise_fd_limit(6 * max(counts) + 512)}", flush=True)
    reports = []
    with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as tmp:
        workdir = Path(tmp)
        with postgres(workdir) as pg, redis(workdir) as redis_url:
            env = production_env(pg.url, redis_url, StampingUpstreamStub(), args.env)
            subprocess.run(
                [PYTHON, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True
            )
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
            r["lost_rows"],
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
                "lost rows",
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
    out = ARTIFACTS / "scaleout-load.json"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=1) + "\n")
    print(f"raw: {out}", file=sys.stderr)


class StampingUpstreamStub:
    """For `migrate`, which needs the settings to load but no upstream."""

    api_base_url = "http://127.0.0.1:9/client/v4"


if __name__ == "__main__":
    main()
