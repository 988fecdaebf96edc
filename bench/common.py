"""Shared pieces of the benchmarks: upstream servers in their own processes, the app and the naive
proxies under daphne in a subprocess, an incremental SSE reader that times the first token, the
log's rows and refusals counted, and percentiles.

Clocks: `time.perf_counter()` and `time.monotonic()` are both CLOCK_MONOTONIC on Linux, one
clock for the whole machine, so a time stamped by the upstream process (`received_at`) can be
compared with the driver's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import httpx

from harness.daphne import APP, SINGLE_UNIT, daphne_command, environment, migrate, running
from harness.services import deploy_site, free_port
from harness.sse import Reader
from harness.workers_ai import KeepAliveUpstream, backend_env

ROOT = Path(__file__).resolve().parents[1]
#: Raw outputs and logs; BENCH_ARTIFACTS moves them (the smoke test keeps a tiny run's away from
#: a real run's).
ARTIFACTS = Path(os.environ.get("BENCH_ARTIFACTS") or ROOT / "artifacts" / "bench")
PYTHON = sys.executable

ACCOUNT_ID = "bench-account"
API_TOKEN = "bench-token-0123456789abcdef"
PERSONA = "alan-watts"
#: the seeded personas' Workers AI model: the URL the naive proxies forward to is the app's
MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
STREAM_PATH = "/api/quotes/stream"
#: the same-stack naive proxy's path (bench/naive/stack_urls.py)
NAIVE_PATH = "/bench/naive"


# -- machine and numbers ---------------------------------------------------------------------------


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs ({model}), Python {platform.python_version()}, {platform.system()}; "
        f"load average {load} (other work on the machine skews absolute figures, less so ratios)"
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else ""


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (pasted as is into docs/benchmarks.md)."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])]
    )


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, smoke: dict[str, Any]
) -> argparse.Namespace:
    """`parser`'s arguments plus `--smoke`: a tiny run (`smoke` gives the defaults: a few
    streams, a few seconds) that shows the bench still works end to end; its figures mean
    nothing. Flags given explicitly still win. tests/deploy/test_bench_smoke.py runs every bench so."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that checks the bench works (figures meaningless): "
        + ", ".join(
            f"--{name.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
            for name, value in smoke.items()
        ),
    )
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and its split (anonymous memory vs mapped files such as the GGUF), in KiB; Threads."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM", "Threads"):
                values[name] = int(rest.split()[0])
    return values


# -- reading a stream --------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamTiming:
    """One stream, timed from just before the request is sent (seconds, perf_counter)."""

    started: float
    first_token: float = 0.0
    last_token: float = 0.0
    done: float = 0.0
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.started

    @property
    def tokens_per_s(self) -> float:
        """The streaming rate once the first token is in (TTFT is reported on its own)."""
        span = self.last_token - self.first_token
        return (self.tokens - 1) / span if span > 0 else float("nan")

    @property
    def end_to_end_tokens_per_s(self) -> float:
        """Tokens over the whole wait, request to last token (TTFT included)."""
        span = self.last_token - self.started
        return self.tokens / span if span > 0 else float("nan")


class SSETimer:
    """Times a Workers AI stream as harness.sse.Reader reads it: counts events whose `response`
    is non-empty and stamps the first, the last and `[DONE]`. The same code reads every path,
    so its own cost cancels out of the ratios."""

    __slots__ = ("_reader", "finished", "timing")

    def __init__(self, timing: StreamTiming) -> None:
        self.timing = timing
        self._reader = Reader()
        self.finished = False

    def feed(self, chunk: bytes) -> None:
        for event in self._reader.feed(chunk):
            if event["data"] == "[DONE]":
                self.timing.done = time.perf_counter()
                self.finished = True
            elif json.loads(event["data"]).get("response"):
                now = time.perf_counter()
                if not self.timing.tokens:
                    self.timing.first_token = now
                self.timing.last_token = now
                self.timing.tokens += 1


def read_stream(client: httpx.Client, url: str, *, content: bytes, headers: dict[str, str]) -> StreamTiming:
    """POST and read the whole response (so a keep-alive connection goes back to the pool)."""
    timing = StreamTiming(started=time.perf_counter())
    parser = SSETimer(timing)
    with client.stream("POST", url, content=content, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for chunk in response.iter_raw():
            parser.feed(chunk)
    if not parser.finished or not timing.tokens:
        raise RuntimeError(f"{url}: the stream ended without tokens and [DONE]")
    return timing


async def direct_ttft(
    client: httpx.AsyncClient, url: str, *, content: bytes, headers: dict[str, str]
) -> float:
    """Seconds from sending a request straight to the upstream to its first token (the
    reference the in-process figures are set beside)."""
    started = time.perf_counter()
    first = 0.0
    async with client.stream("POST", url, content=content, headers=headers) as response:
        async for chunk in response.aiter_raw():
            if not first and b'"response":"' in chunk:
                first = time.perf_counter()
    if not first:
        raise RuntimeError(f"{url}: no token")
    return first - started


# -- the app in-process (Django's ASGI handler, no server) ---------------------------------------------


@dataclass(slots=True)
class InProcessTiming:
    """One request through the ASGI app in-process: wall (perf_counter) and CPU (process_time)
    stamps, 0.0 for a moment that did not come (no token in a refusal)."""

    started: float = 0.0
    started_cpu: float = 0.0
    first_token: float = 0.0
    first_token_cpu: float = 0.0
    ended: float = 0.0
    ended_cpu: float = 0.0
    status: int = 0
    #: as the app sent them (decoding is left to who needs it: it would fall inside the window)
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)


async def stream_in_process(
    application: Callable[..., Awaitable[None]], body: bytes, path: str = STREAM_PATH
) -> InProcessTiming:
    """POST `body` to `path` through `application` (the ASGI HTTP scope a server would pass) and
    read the whole answer, timing its first token and its end."""
    done = asyncio.Event()
    timing = InProcessTiming()
    sent = False

    async def receive() -> dict[str, object]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            timing.status = int(message["status"])
            timing.raw_headers = message["headers"]
        chunk = message.get("body", b"")
        if (
            not timing.first_token
            and isinstance(chunk, bytes)
            and b'"response":"' in chunk
            and b'"response":""' not in chunk
        ):
            timing.first_token, timing.first_token_cpu = time.perf_counter(), time.process_time()
        if message["type"] == "http.response.body" and not message.get("more_body"):
            timing.ended, timing.ended_cpu = time.perf_counter(), time.process_time()
            done.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    # CPU clock first, so the wall-clock window (the TTFT) holds no clock call of its own.
    timing.started_cpu = time.process_time()
    timing.started = time.perf_counter()
    await application(scope, receive, send)
    return timing


# -- upstreams in their own process ------------------------------------------------------------------


def _upstream_main(conn: Connection, scenario: Any) -> None:
    """The upstream process: serve, and answer the driver's commands on `conn`."""
    upstream = KeepAliveUpstream(scenario)
    ready = threading.Event()
    threading.Thread(target=lambda: asyncio.run(upstream.serve(ready)), daemon=True).start()
    ready.wait(10)
    conn.send(upstream.port)
    while True:
        command, arg = conn.recv()
        if command == "scenario":
            upstream.scenario = arg
            conn.send(True)
        elif command == "stats":
            conn.send(
                {"requests": upstream.requests, "connections": upstream.connections, "last": upstream.last}
            )
        else:
            conn.send(True)
            return


class Upstream:
    """harness.workers_ai's KeepAliveUpstream (connections kept for the next request) in a
    process of its own, so its work does not share the driver's GIL."""

    def __init__(self, scenario: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_upstream_main, args=(child, scenario), daemon=True, name="upstream"
        )
        self._process.start()
        self.port: int = self._conn.recv()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_base_url(self) -> str:
        return f"{self.base_url}/client/v4"

    def set_scenario(self, scenario: Any) -> None:
        self._conn.send(("scenario", scenario))
        self._conn.recv()

    def stats(self) -> dict[str, Any]:
        self._conn.send(("stats", None))
        result: dict[str, Any] = self._conn.recv()
        return result

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send(("stop", None))
            self._conn.recv()
        self._process.join(5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)

    def __enter__(self) -> Upstream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- the app and the naive proxies in a subprocess ----------------------------------------------------


@dataclass
class AppServer:
    url: str
    process: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stream_url(self) -> str:
        return self.url + STREAM_PATH

    @property
    def naive_url(self) -> str:
        """The same-stack naive proxy (served with bench.naive.stack_settings)."""
        return self.url + NAIVE_PATH


#: What a machine keeps for itself, not a setting under test: where the embedded model lives.
MACHINE_SETTINGS = ("LOCAL_MODEL_PATH",)


def app_env(db_path: Path, **extra: str) -> dict[str, str]:
    """Production settings as the deploy tests give daphne (harness.daphne.environment: this
    shell's own app settings dropped, so none changes a figure unseen; pass them with --env
    where a bench takes it), on the SQLite file `db_path`, logging at WARNING."""
    settings = {
        **{name: os.environ[name] for name in MACHINE_SETTINGS if name in os.environ},
        "DATABASE_URL": f"sqlite:///{db_path}",
        "DJANGO_SECRET_KEY": "bench-only-secret-key-0123456789abcdefghijklmnopqrstuvwxyz",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "DJANGO_LOG_LEVEL": "WARNING",
        "LOCAL_MODEL_PRELOAD": "false",
        # Every request must reach the backend: no answer cache, no per-client limits (the
        # driver is one client sending thousands of requests). Distinct concurrent requests
        # are used where the coalescing of identical requests would matter.
        "QUOTES_CACHE_TTL": "0",
        "QUOTES_RATE_LIMIT": "1000000/minute",
        "QUOTES_MAX_CONCURRENT_STREAMS": "100000",
    }
    env = environment(**{**settings, **extra})
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


class HasApiBaseUrl(Protocol):
    @property
    def api_base_url(self) -> str: ...


def workers_ai_env(upstream: HasApiBaseUrl) -> dict[str, str]:
    """The workers-ai backend against `upstream` (any of the benchmarks' upstreams or the fake),
    and the naive proxies' upstream: the URL and headers the app's backend sends to."""
    return {
        **backend_env(upstream.api_base_url, ACCOUNT_ID, API_TOKEN),
        "BENCH_UPSTREAM_URL": f"{upstream.api_base_url}/accounts/{ACCOUNT_ID}/ai/run/{MODEL}",
        "BENCH_UPSTREAM_HEADERS": json.dumps(
            {"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"}
        ),
    }


@contextlib.contextmanager
def serve_app(
    *, stack: bool = False, migrate_sql: Sequence[str] = (), name: str = "app", **extra_env: str
) -> Iterator[AppServer]:
    """The app under daphne as deployed (deploy/systemd/persona-quotes.service's command:
    `python -m quotes.ops.server ... config.asgi:application`, harness.daphne), on a fresh
    migrated SQLite file. `stack`: with DJANGO_SETTINGS_MODULE=bench.naive.stack_settings, so the
    same process also serves the same-stack naive proxy at NAIVE_PATH."""
    with tempfile.TemporaryDirectory(prefix="bench-app-") as tmp:
        db_path = Path(tmp) / "db.sqlite3"
        env = app_env(db_path, **extra_env)
        migrate(env)
        with sqlite3.connect(db_path) as connection:
            for statement in migrate_sql:
                connection.execute(statement)
        if stack:
            env["DJANGO_SETTINGS_MODULE"] = "bench.naive.stack_settings"
        with serve_asgi(APP, env, name) as (process, url, _):
            yield AppServer(url, process, env)


@contextlib.contextmanager
def serve_naive(**extra_env: str) -> Iterator[AppServer]:
    """The bare naive proxy (bench/naive: no middleware, no database) under plain daphne with the
    app's daphne flags, forwarding every POST to /api/quotes/stream to BENCH_UPSTREAM_URL."""
    env = {**os.environ, **extra_env, "DJANGO_SETTINGS_MODULE": "bench.naive.settings"}
    with serve_asgi("bench.naive.asgi:application", env, "naive") as (process, url, _):
        yield AppServer(url, process, env)


@contextlib.contextmanager
def serve_asgi(
    application: str, env: dict[str, str], name: str
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`application` under daphne as deploy/systemd/persona-quotes.service runs it
    (harness.daphne.daphne_command) on a free port, logging to artifacts/bench/`name`.log (the
    latest server of each name): (the process, its URL, the log)."""
    port = free_port()
    log_path = ARTIFACTS / f"{name}.log"
    log_path.unlink(missing_ok=True)
    # /healthz, not /: the home page needs collected static files.
    with running(daphne_command(SINGLE_UNIT, port, application), port, env, log_path) as (process, url):
        yield process, url, log_path


# -- the log: rows and refusals ------------------------------------------------------------------------

RUNNING = "running"
REFUSALS = "refusals counted"
#: a generation's row per status, after the row with id `%s` (`?` for SQLite)
ROWS_BY_STATUS = "SELECT status, COUNT(*) FROM quotes_generation WHERE id > {} GROUP BY status"
REFUSALS_COUNTED = "SELECT COALESCE(SUM(count), 0) FROM quotes_refusal"
LAST_ROW = "SELECT COALESCE(MAX(id), 0) FROM quotes_generation"


class Log:
    """The log a run writes, read from its database (SQLite or PostgreSQL): the generations'
    rows after those there at the start, and the refusals counted (quotes.models.Refusal: a
    count per persona, hour and code, written every few seconds)."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.first_row, refusals = self._query(LAST_ROW)[0][0], self._query(REFUSALS_COUNTED)[0][0]
        self.refusals_before = int(refusals)

    def _query(self, statement: str, *params: object) -> list[tuple[Any, ...]]:
        if self.database_url.startswith("sqlite:///"):
            with contextlib.closing(sqlite3.connect(self.database_url.removeprefix("sqlite:///"))) as db:
                return db.execute(statement.format("?"), params).fetchall()
        import psycopg

        with psycopg.connect(self.database_url.replace("postgres://", "postgresql://", 1)) as db:
            return db.execute(statement.format("%s"), params).fetchall()  # type: ignore[arg-type]

    def counts(self) -> dict[str, int]:
        """Rows by status, and REFUSALS: the refusals counted since the start."""
        counts = {status: int(n) for status, n in self._query(ROWS_BY_STATUS, self.first_row)}
        counts[REFUSALS] = int(self._query(REFUSALS_COUNTED)[0][0]) - self.refusals_before
        return counts

    def settled(self, generations: int, refusals: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """The counts once `generations` rows are complete (not `running`) and `refusals` are
        counted, or the rows are complete and the counts stopped moving for 8 s (a refusal count
        is written up to 5 s after it), or `timeout_s` is up (a row may wait long for a database
        on a busy machine: the rows are never judged on stillness alone); and the accounting
        against what the daphnes answered: lost rows
        (answered generations without a complete row), extra rows, refusals counted against
        refusals answered (429 and 503 from a daphne)."""
        deadline = time.monotonic() + timeout_s
        previous: dict[str, int] = {}
        still_since = time.monotonic()
        while True:
            counts = self.counts()
            complete = sum(n for s, n in counts.items() if s not in (RUNNING, REFUSALS))
            if counts != previous:
                previous, still_since = counts, time.monotonic()
            now = time.monotonic()
            if complete >= generations and (counts[REFUSALS] >= refusals or now - still_since > 8):
                break
            if now > deadline:
                break
            time.sleep(0.25)
        total = sum(n for s, n in counts.items() if s != REFUSALS)
        return {
            "rows": {s: n for s, n in counts.items() if s != REFUSALS},
            "rows_expected": generations,
            "rows_total": total,
            "lost_rows": max(0, generations - complete),
            "extra_rows": max(0, total - generations),
            "refusals_expected": refusals,
            "refusals_counted": counts[REFUSALS],
        }


# -- nginx: every attempt on a daphne ---------------------------------------------------------------

#: An access log with each attempt nginx made on a daphne for a request (`$upstream_status` and
#: `$upstream_bytes_received` list one entry per attempt), for the row count; `access_log <file>
#: attempts;` in the server block.
NGINX_ATTEMPTS_FORMAT = (
    'log_format attempts \'$request_method $uri $status "$upstream_addr" "$upstream_status" \'\n'
    '                    \'"$upstream_bytes_received" $request_time $msec "$http_last_event_id"\';'
)
_ATTEMPT_LINE = re.compile(r'^(\S+) (\S+) (\d+) "([^"]*)" "([^"]*)" "([^"]*)" (\S+) (\S+) "([^"]*)"$')


def attempts_site(port: int, addresses: list[str], access_log: Path, *, server: str = "") -> str:
    """deploy/nginx's site (harness.services.deploy_site: its upstream block, hash, max_conns and
    all, and its locations) in front of `addresses`, with a backlog for the load, logging each
    attempt on a daphne to `access_log` for the row count (`nginx_attempts`); `server`: more
    directives for the server block."""
    return deploy_site(
        port,
        addresses,
        listen="backlog=4096",
        http=NGINX_ATTEMPTS_FORMAT,
        server=f"access_log {access_log} attempts;{server}",
    )


def nginx_attempts(access_log: Path, path: str = STREAM_PATH) -> dict[str, Any]:
    """Every attempt nginx made on a daphne for a POST to `path` (from a log in
    NGINX_ATTEMPTS_FORMAT): answered by the daphne (a status and bytes received) or not (a
    refused connection, a reset, nginx's own 503 at max_conns), by status; and the statuses the
    clients got. nginx tries the other process after a 503 (deploy/nginx's proxy_next_upstream),
    so one refused request can be refused, and counted, by each process. A resume (a
    Last-Event-ID) served is counted apart: it reads a generation whose one row is the
    generation's own. `generations` and `refusals`: what the log must then hold (Log.settled)."""
    answered: Counter[str] = Counter()
    resumes = 0
    unanswered: Counter[str] = Counter()
    client_statuses: Counter[str] = Counter()
    requests = 0
    for line in access_log.read_text().splitlines():
        match = _ATTEMPT_LINE.match(line)
        if not match or match.group(1) != "POST" or match.group(2) != path:
            continue
        requests += 1
        client_statuses[match.group(3)] += 1
        resume = match.group(9) not in ("", "-")
        statuses = re.split(r"\s*[,:]\s*", match.group(5))
        received = re.split(r"\s*[,:]\s*", match.group(6))
        for status, size in zip(statuses, received, strict=False):
            if resume and status == "200":
                resumes += 1
            elif status.isdigit() and size.isdigit() and int(size) > 0:
                answered[status] += 1
            else:
                unanswered[f"{status}/{size}B"] += 1
    return {
        "requests": requests,
        "client_statuses": dict(client_statuses),
        "answered_by_daphne": dict(answered),
        "resumes": resumes,
        "not_answered": dict(unanswered),
        "generations": answered["200"],
        "refusals": answered["429"] + answered["503"],
    }
