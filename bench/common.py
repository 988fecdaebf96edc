"""Shared pieces of the benchmarks: upstream servers in their own processes, the app under
daphne or uvicorn in a subprocess, an incremental SSE reader that times the first token, and
percentiles.

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
import shutil
import sqlite3
import ssl
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
from typing import Any, Literal, Protocol

import httpx

from harness.daphne import APP, SINGLE_UNIT, daphne_command, environment, migrate, running
from harness.services import deploy_site, free_port
from harness.sse import Reader
from harness.workers_ai import FakeWorkersAI, KeepAliveUpstream

ROOT = Path(__file__).resolve().parents[1]
#: Raw outputs and logs; BENCH_ARTIFACTS moves them (the smoke test keeps a tiny run's away from
#: a real run's).
ARTIFACTS = Path(os.environ.get("BENCH_ARTIFACTS") or ROOT / "artifacts" / "bench")
PYTHON = sys.executable

ACCOUNT_ID = "bench-account"
API_TOKEN = "bench-token-0123456789abcdef"
PERSONA = "alan-watts"

Server = Literal["daphne", "uvicorn"]
UpstreamKind = Literal["fake", "keepalive", "keepalive-tls"]


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
    #: the client's local address: tells whether a keep-alive connection was reused
    local_addr: str = ""

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
    is non-empty and stamps the first, the last and `[DONE]`. The same code reads both paths,
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
        stream = response.extensions.get("network_stream")
        if stream is not None:
            timing.local_addr = str(stream.get_extra_info("client_addr"))
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


def stream_scope(body: bytes) -> dict[str, object]:
    """The ASGI HTTP scope a server would pass the app for `POST /api/quotes/stream` with a JSON
    `body`."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/quotes/stream",
        "raw_path": b"/api/quotes/stream",
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


async def stream_in_process(application: Callable[..., Awaitable[None]], body: bytes) -> InProcessTiming:
    """POST `body` to /api/quotes/stream through `application` and read the whole answer, timing
    its first token."""
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

    scope = stream_scope(body)
    # CPU clock first, so the wall-clock window (the TTFT) holds no clock call of its own.
    timing.started_cpu = time.process_time()
    timing.started = time.perf_counter()
    await application(scope, receive, send)
    return timing


# -- upstreams in their own process ------------------------------------------------------------------


def _upstream_main(conn: Connection, kind: UpstreamKind, scenario: Any, tls: tuple[str, str] | None) -> None:
    """The upstream process: serve, and answer the driver's commands on `conn`."""
    if kind == "fake":
        fake = FakeWorkersAI().start()
        fake.default = scenario
        conn.send(fake.port)
        while True:
            command, arg = conn.recv()
            if command == "scenario":
                fake.default = arg
                conn.send(True)
            elif command == "stats":
                requests = fake.requests
                last = requests[-1] if requests else None
                conn.send(
                    {
                        "requests": len(requests),
                        "connections": len(requests),  # one connection per request, always
                        "last": {
                            "path": last.path,
                            "headers": last.headers,
                            "body": last.body,
                            "received_at": last.received_at,
                        }
                        if last
                        else {},
                    }
                )
            else:
                fake.stop()
                conn.send(True)
                return
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
    upstream = KeepAliveUpstream(scenario, context)
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
    """An upstream server in a process of its own (so its work does not share the driver's GIL)."""

    def __init__(self, kind: UpstreamKind, scenario: Any, tls: tuple[str, str] | None = None) -> None:
        self.kind = kind
        self.tls = tls
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_upstream_main, args=(child, kind, scenario, tls), daemon=True, name=f"upstream-{kind}"
        )
        self._process.start()
        self.port: int = self._conn.recv()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

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


def self_signed_cert(directory: Path) -> tuple[str, str] | None:
    """A throw-away certificate for 127.0.0.1 (None when the openssl CLI is missing)."""
    if shutil.which("openssl") is None:
        return None
    cert, key = directory / "cert.pem", directory / "key.pem"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    command += ["-keyout", str(key), "-out", str(cert), "-days", "1", "-nodes", "-subj", "/CN=127.0.0.1"]
    command += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


# -- the app in a subprocess -------------------------------------------------------------------------


@dataclass
class AppServer:
    server: Server
    url: str
    process: subprocess.Popen[bytes]
    db_path: Path
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stream_url(self) -> str:
        return f"{self.url}/api/quotes/stream"

    def sql(self, statement: str, *params: object) -> None:
        with sqlite3.connect(self.db_path) as connection:
            connection.execute(statement, params)


#: What a machine keeps for itself, not a setting under test: where the embedded model lives.
MACHINE_SETTINGS = ("QUOTES_CACHE_DIR", "LOCAL_MODEL_PATH")


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
        # are used where the gateway's coalescing of identical requests would matter.
        "QUOTES_CACHE_TTL": "0",
        "QUOTES_RATE_LIMIT": "1000000/s",
        "QUOTES_MAX_CONCURRENT_STREAMS": "100000",
    }
    env = environment(**{**settings, **extra})
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


class HasApiBaseUrl(Protocol):
    @property
    def api_base_url(self) -> str: ...


def workers_ai_env(upstream: HasApiBaseUrl) -> dict[str, str]:
    """The workers-ai backend against `upstream` (any of the benchmarks' upstreams or the fake)."""
    return {
        "AI_BACKEND": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": ACCOUNT_ID,
        "CLOUDFLARE_API_TOKEN": API_TOKEN,
        "CLOUDFLARE_API_BASE_URL": upstream.api_base_url,
    }


@contextlib.contextmanager
def serve_app(
    server: Server,
    *,
    migrate_sql: Sequence[str] = (),
    root: Path = ROOT,
    name: str = "",
    **extra_env: str,
) -> Iterator[AppServer]:
    """Migrate a fresh SQLite file and serve the app on it, in a subprocess. `root`: the source
    tree to serve (another checkout of the app, for a side-by-side comparison: see `trees`)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{server}-") as tmp:
        db_path = Path(tmp) / "db.sqlite3"
        env = app_env(db_path, **extra_env)
        migrate(env, cwd=root)
        with sqlite3.connect(db_path) as connection:
            for statement in migrate_sql:
                connection.execute(statement)
        log_name = f"{server}-{name}" if name else server
        with serve_asgi(server, APP, env, log_name, cwd=root) as (
            process,
            url,
            log_path,
        ):
            yield AppServer(server, url, process, db_path, log_path, env)


def trees(items: Sequence[str]) -> dict[str, Path]:
    """`--tree NAME=DIR` options: other source trees of the app (say, `git archive` of another
    commit, or this tree with one change reverted), each served beside this one in the same run."""
    found: dict[str, Path] = {}
    for item in items:
        name, _, directory = item.partition("=")
        path = Path(directory).resolve()
        if not name or not (path / "manage.py").is_file():
            raise SystemExit(f"--tree {item!r}: want NAME=DIR, DIR a source tree of the app (with manage.py)")
        found[name] = path
    return found


@contextlib.contextmanager
def serve_naive(upstream_url: str, headers: dict[str, str], server: Server = "daphne") -> Iterator[AppServer]:
    """The naive Django proxy (bench/naive) under daphne, forwarding every POST to `upstream_url`
    with `headers`: the baseline row."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.naive.settings",
        "BENCH_UPSTREAM_URL": upstream_url,
        "BENCH_UPSTREAM_HEADERS": json.dumps(headers),
    }
    with serve_asgi(server, "bench.naive.asgi:application", env, f"naive-{server}") as (
        process,
        url,
        log_path,
    ):
        yield AppServer(server, url, process, Path(os.devnull), log_path, env)


@contextlib.contextmanager
def serve_asgi(
    server: Server, application: str, env: dict[str, str], name: str, *, cwd: Path = ROOT
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`application` under daphne (as deploy/systemd/persona-quotes.service runs it:
    harness.daphne.daphne_command) or uvicorn (no deploy file runs it: a comparison row) on a
    free port, logging to artifacts/bench/`name`.log (the latest server of each name): (the
    process, its URL, the log)."""
    port = free_port()
    if server == "daphne":
        command = daphne_command(SINGLE_UNIT, port, application)
    else:
        command = [PYTHON, "-m", "uvicorn", application, "--host", "127.0.0.1"]
        command += ["--port", str(port), "--log-level", "warning", "--no-access-log", "--lifespan", "off"]
    log_path = ARTIFACTS / f"{name}.log"
    log_path.unlink(missing_ok=True)
    # /healthz, not /: the home page needs collected static files.
    with running(command, port, env, log_path, cwd=cwd) as (process, url):
        yield process, url, log_path


# -- the log ---------------------------------------------------------------------------------------


#: log rows by status (a refusal's row counts the requests it stands for)
ROWS_BY_STATUS = "SELECT status, SUM(request_count) FROM quotes_generation GROUP BY status"


def settled_counts(
    fetch: Callable[[], dict[str, int]], expected: int, timeout_s: float = 120.0
) -> dict[str, int]:
    """`fetch()` (rows by status, each row counted as its `request_count`), polled each second
    until the rows add up to `expected` or the counts have stopped moving for 10 s (a saturated
    server writes the cancelled streams' rows last; a refusal's count reaches its row a second
    after the last refusal of its window), or `timeout_s` is up."""
    deadline = time.monotonic() + timeout_s
    previous: dict[str, int] | None = None
    still = 0
    while True:
        counts = fetch()
        still = still + 1 if counts == previous else 0
        if sum(counts.values()) >= expected or still >= 10 or time.monotonic() > deadline:
            return counts
        previous = counts
        time.sleep(1.0)


def row_accounting(expected: int, rows: dict[str, int]) -> dict[str, int]:
    """The log rows against the requests a daphne answered (`expected`), each of which has its
    row. Refusals share rows: those of one client and window are one row whose `request_count`
    says how many (quotes/ai/refusals.py), and `rows` sums that count. Behind nginx, `expected`
    is what nginx's log says the daphnes answered (`nginx_attempts`), not what the client
    received: nginx tries the other process after a 503 (deploy/nginx's proxy_next_upstream),
    so one refused request can be refused, and counted, by each process. Lost rows: answered
    requests with no row; extra rows: rows counting requests no daphne answered (a miscount)."""
    total = sum(rows.values())
    return {
        "rows_expected": expected,
        "rows_total": total,
        "lost_rows": max(0, expected - total),
        "extra_rows": max(0, total - expected),
    }


# -- nginx: every attempt on a daphne ---------------------------------------------------------------

STREAM_PATH = "/api/quotes/stream"

#: An access log with each attempt nginx made on a daphne for a request (`$upstream_status` and
#: `$upstream_bytes_received` list one entry per attempt), for the row count; `access_log <file>
#: attempts;` in the server block.
NGINX_ATTEMPTS_FORMAT = (
    'log_format attempts \'$request_method $uri $status "$upstream_addr" "$upstream_status" \'\n'
    '                    \'"$upstream_bytes_received" $request_time $msec "$http_last_event_id"\';'
)
_ATTEMPT_LINE = re.compile(r'^(\S+) (\S+) (\d+) "([^"]*)" "([^"]*)" "([^"]*)" (\S+) (\S+) "([^"]*)"$')


def attempts_site(port: int, addresses: list[str], access_log: Path, *, server: str = "") -> str:
    """deploy/nginx's site (harness.services.deploy_site: its upstream block, max_fails and all,
    and its locations) in front of `addresses`, with a backlog for the load, logging each
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
    NGINX_ATTEMPTS_FORMAT): answered by the daphne (a status and bytes received: it has a log
    row) or not (a refused connection, a reset), by status; and the statuses the clients got. A
    resume (a Last-Event-ID) served is counted apart: it reads a generation whose one row is the
    generation's own (docs/architecture.md), so it needs no row of its own (a refused one does)."""
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
    }
