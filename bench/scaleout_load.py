"""bench/load.py in the production layout: daphne processes behind nginx, sharing PostgreSQL and
Redis, as docs/deployment.md runs them (harness/services.py starts the same servers).

    .venv/bin/python -m bench.scaleout_load --processes 2 --streams 1000 --duration 20   # overload
    .venv/bin/python -m bench.scaleout_load --processes 1,2 --ladder 60,100,150 --duration 20 \
        --env QUOTES_MAX_OPEN_STREAMS=100000 --env DJANGO_SETTINGS_MODULE=bench.naive.stack_settings

Each run starts fresh servers (one to N daphne processes as deploy/systemd/persona-quotes@.service
starts them, and nginx in front of them with deploy/nginx's upstream block and locations:
harness.daphne) against one PostgreSQL and one Redis for the whole invocation, and the stamping
upstream of bench/load.py (50 tokens/s per stream, each token stamped with the time it left).
The load client is load.py's: one asyncio loop, raw sockets, 200 new streams/s, each from a
loopback address and with a csrftoken cookie of its own (nginx hashes on the cookie and limits
connections per address), all through nginx. Figures as in load.py, summed over the daphne
processes.

Admission is as deployed: each process's static cap (QUOTES_MAX_OPEN_STREAMS, 100 by default)
answers 503 over_capacity with Retry-After; nginx tries the other process after a 503, and
answers its own 503 once both have max_conns requests in flight. The per-client rate limits are
raised (the load is one machine's). Log rows are counted in PostgreSQL against the streams the
daphnes admitted, and the refusals counted (quotes_refusal) against the 503s they answered, both
from nginx's log of its attempts: a request refused by one process and then by the other is
counted by each (bench.common.nginx_attempts). Every process's CPU during the plateau, by role,
is in the report's "cpu_pct".
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
from typing import Any

import httpx

from bench.common import (
    ARTIFACTS,
    PERSONA,
    STREAM_PATH,
    HasApiBaseUrl,
    Log,
    attempts_site,
    machine,
    nginx_attempts,
    parse_args,
    table,
    workers_ai_env,
)
from bench.load import StampingUpstream, build_report, capacity_lines, drive, raise_fd_limit
from harness.daphne import migrate, production_base_env, start_daphne, wait_until_healthy
from harness.services import free_port, nginx, postgres, redis, stop_process


def production_env(
    database_url: str, redis_url: str, upstream: HasApiBaseUrl, extra: list[str]
) -> dict[str, str]:
    env = production_base_env(
        database_url=database_url,
        redis_url=redis_url,
        DJANGO_LOG_LEVEL="WARNING",
        **workers_ai_env(upstream),
        QUOTES_CACHE_TTL="0",
        QUOTES_RATE_LIMIT="1000000/minute",
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
            warm_up(f"http://{address}")
        yield [(process, address) for process, address, _ in started]
    finally:
        for process, _, _ in started:
            stop_process(process)


def warm_up(url: str) -> None:
    """A quote straight from the process (not through nginx), as a process in service has
    written some: the persona in its memory, its upstream pool and row writer started."""
    response = httpx.post(url + STREAM_PATH, json={"persona": PERSONA, "topic": "warm"}, timeout=60)
    if response.status_code != 200 or not response.text.endswith("data: [DONE]\n\n"):
        raise RuntimeError(f"{url}: the warm-up quote failed: {response.text[:300]}")


def one_run(
    processes: int, streams: int, args: argparse.Namespace, database_url: str, redis_url: str, workdir: Path
) -> dict[str, Any]:
    tokens = int(args.duration * args.tokens_per_second)
    upstream = StampingUpstream(tokens, args.tokens_per_second)
    load_before = os.getloadavg()
    try:
        env = production_env(database_url, redis_url, upstream, args.env)
        with daphnes(processes, env, workdir) as servers:
            log = Log(database_url)  # after the warm-up quotes
            port = free_port()
            nginx_dir = workdir / f"nginx-{processes}-{streams}-{time.time_ns()}"
            nginx_dir.mkdir()
            access_log = nginx_dir / "attempts.log"
            site = attempts_site(port, [address for _, address in servers], access_log)
            with (
                nginx(nginx_dir, site=site, port=port, worker_connections=2 * streams + 256) as proxy,
                CPUWatch(layout_roots(workdir)) as watch,
            ):
                run, plateau = asyncio.run(
                    drive(
                        proxy.url + STREAM_PATH,
                        [p.pid for p, _ in servers],
                        upstream,
                        streams,
                        args.duration,
                        args.ramp_per_second,
                    )
                )
                attempts = nginx_attempts(access_log)
            # While the daphnes run: their refusals are written every 5 s.
            rows = log.settled(attempts["generations"], attempts["refusals"])
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
    report["nginx"] = attempts
    report["cpu_pct"] = watch.summary((plateau["ramp_s"] + 1, args.duration - 1))
    return report


def layout_roots(workdir: Path) -> list[int]:
    """This process (the load client, and under it the upstream, the daphnes and nginx) and
    PostgreSQL's postmaster (pg_ctl starts it on its own)."""
    roots = [os.getpid()]
    with contextlib.suppress(OSError, ValueError):
        roots.append(int((workdir / "postgres" / "data" / "postmaster.pid").read_text().split()[0]))
    return roots


class CPUWatch(threading.Thread):
    """Once a second for the whole run: the CPU time of every process of the layout (this load
    client, the upstream, nginx, the daphnes, Redis, PostgreSQL), to say where the machine's
    cores go during the plateau."""

    def __init__(self, roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots = roots
        self.cpu: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()
        self.started = time.monotonic()

    def __enter__(self) -> CPUWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(5)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.cpu.append((time.monotonic() - self.started, cpu_by_role(self.roots)))

    def summary(self, plateau: tuple[float, float]) -> dict[str, float]:
        """Each role's CPU (% of one core) between `plateau`'s two times (s from the start)."""
        inside = [(t, cpu) for t, cpu in self.cpu if plateau[0] <= t <= plateau[1]]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {
            role: round(100 * (last.get(role, 0.0) - first.get(role, 0.0)) / (t1 - t0), 1)
            for role in sorted(last)
        }


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
    # each on the other process (counted by both).
    args = parse_args(
        parser,
        argv,
        smoke={"processes": "2", "streams": 10, "duration": 1, "env": ["QUOTES_MAX_OPEN_STREAMS=3"]},
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
            f"{r['refusals_counted']}/{r['refusals_expected']}",
            r["added_delay_ms"]["p50"],
            r["added_delay_ms"]["p99"],
            r["daphne_cpu_pct"],
            r["cpu_per_token_us"],
            round(r["rss_per_stream_kib"]),
            r["threads_max"],
            "/".join(f"{x:.1f}" for x in r["load_average_before"]),
        ]
        for r in reports
    ]
    headers = ["daphnes", "streams", "completed", "503", "503 with Retry-After", "503 p99 ms", "other errors"]
    headers += ["rows/admitted", "lost rows", "extra rows", "refusals counted/answered", "added p50 ms"]
    headers += [
        "added p99 ms",
        "daphne CPU %",
        "CPU µs/token",
        "RSS KiB/stream",
        "threads",
        "load avg before",
    ]
    print(table(headers, rows))
    print("\n".join(capacity_lines(reports, args.bound_ms)))
    for r in reports:
        print(f"{r['processes']} daphnes, {r['streams']} streams: CPU % of a core by role {r['cpu_pct']}")
    out = ARTIFACTS / "scaleout-load.json"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=1) + "\n")
    print(f"raw: {out}", file=sys.stderr)


class StampingUpstreamStub:
    """For `migrate`, which needs the settings to load but no upstream."""

    api_base_url = "http://127.0.0.1:9/client/v4"


if __name__ == "__main__":
    main()
