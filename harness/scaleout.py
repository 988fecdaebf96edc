"""Scale-out, proven on one machine: two daphne processes behind a real nginx, one PostgreSQL,
one Redis, production settings (DJANGO_DEBUG=false, collectstatic, JSON logs).

    .venv/bin/python -m harness.scaleout

The processes (A and B) answer from the fake Workers AI upstream (harness/workers_ai.py),
which writes one token every TOKEN_DELAY_S so streaming is visible in the timestamps. Checks,
one PASS/FAIL/SKIPPED line each:

1. an SSE quote streams through nginx token by token, uncompressed (Accept-Encoding: gzip sent);
2. an answer process A generated is a cache hit on process B (Redis cache; upstream called once;
   both log rows in the shared PostgreSQL);
3. the rate limit holds across processes (QUOTES_RATE_LIMIT=3/h: 2 on A, then B says 429 on
   the 4th request);
4. a WebSocket quote streams through nginx frame by frame (/ws/quotes/);
5. static files through nginx are collectstatic's hashed, pre-compressed files; /healthz is ok;
6. Prometheus's view: each process's /metrics on its own nginx port (token required), adding up
   to the log rows in PostgreSQL; /metrics on the public site is 404.

Exits 1 when any check fails. nginx's config includes deploy/nginx/persona-quotes-locations.conf,
the same proxy rules docs/deployment.md tells you to install.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.daphne import ROOT, manage, production_base_env, start_daphne, wait_until_healthy
from harness.services import (
    Nginx,
    ServiceError,
    deploy_site,
    free_port,
    nginx,
    postgres,
    redis,
    stop_process,
    tail,
)
from harness.sse import Reader
from harness.workers_ai import FakeWorkersAI, Scenario

METRICS_CONF = ROOT / "deploy" / "nginx" / "persona-quotes-metrics.conf"
METRICS_TOKEN = secrets.token_urlsafe(24)
TOKENS = ("The", " river", " does", " not", " hurry", ",", " yet", " it", " arrives", ".")
TOKEN_DELAY_S = 0.08
PERSONA = "alan-watts"
RATE_LIMIT = 3


@dataclass
class Daphne:
    name: str
    url: str
    log: Path
    process: subprocess.Popen[bytes]


class CheckFailed(AssertionError):
    pass


class Skipped(Exception):
    pass


def check(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# --- setting up -----------------------------------------------------------------------------------


def production_env(
    *, database_url: str, redis_url: str, fake: FakeWorkersAI, static_root: Path
) -> dict[str, str]:
    return production_base_env(
        database_url=database_url,
        redis_url=redis_url,
        DJANGO_STATIC_ROOT=str(static_root),
        CLOUDFLARE_ACCOUNT_ID="acct-scaleout",
        CLOUDFLARE_API_TOKEN="cfut_SCALEOUT-" + secrets.token_hex(16),
        CLOUDFLARE_API_BASE_URL=fake.api_base_url,
        QUOTES_RATE_LIMIT=f"{RATE_LIMIT}/h",  # an hour: a minute may turn over mid-check
        QUOTES_CACHE_TTL="3600",
        QUOTES_MAX_ATTEMPTS="1",
        QUOTES_METRICS_TOKEN=METRICS_TOKEN,
    )


@contextlib.contextmanager
def daphne(name: str, env: dict[str, str], workdir: Path) -> Iterator[Daphne]:
    """One daphne process as deploy/systemd/persona-quotes@.service starts it (harness/daphne.py;
    the app believes nginx's X-Forwarded-For because nginx connects from loopback, a trusted
    proxy by default)."""
    port = free_port()
    log = workdir / f"daphne-{name}.log"
    process = start_daphne(port, env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, process, log)
        except RuntimeError as exc:
            raise ServiceError(f"daphne {name}: {exc}") from None
        yield Daphne(name=name, url=url, log=log, process=process)
    finally:
        stop_process(process)


def nginx_site(port: int, upstreams: list[Daphne], metrics_ports: list[int]) -> str:
    # One port per process for Prometheus, as deploy/nginx/persona-quotes.conf sets them up.
    metrics = "".join(
        f"""
    server {{
        listen 127.0.0.1:{metrics_port};
        set $persona_quotes_host 127.0.0.1;
        include {METRICS_CONF};
        location = /metrics {{ proxy_pass {d.url}; }}
    }}"""
        for d, metrics_port in zip(upstreams, metrics_ports, strict=True)
    )
    return deploy_site(port, [d.url.removeprefix("http://") for d in upstreams], http=metrics)


# --- a small SSE and WebSocket client -------------------------------------------------------------


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    tokens: list[tuple[float, str]]
    raw: bytes
    events: list[str]


def post_quote(base_url: str, topic: str, *, headers: dict[str, str] | None = None) -> Stream:
    """POST /api/quotes/stream and read the SSE body, noting when each token arrived."""
    started = time.perf_counter()
    tokens: list[tuple[float, str]] = []
    events: list[str] = []
    raw = b""
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            base_url + "/api/quotes/stream",
            json={"persona": PERSONA, "topic": topic},
            headers={"Accept-Encoding": "gzip, br", **(headers or {})},
        ) as response,
    ):
        reader = Reader()
        for chunk in response.iter_raw():
            now = time.perf_counter() - started
            raw += chunk
            for event in reader.feed(chunk):
                events.append(event["data"])
                with contextlib.suppress(ValueError):
                    payload = json.loads(event["data"])
                    if isinstance(payload, dict) and payload.get("response"):
                        tokens.append((now, payload["response"]))
        return Stream(response.status_code, response.headers, tokens, raw, events)


class WebSocket:
    """Just enough RFC 6455 for the check: a handshake, masked text frames out, frames in."""

    def __init__(self, host: str, port: int, path: str, origin: str) -> None:
        self.sock = socket.create_connection((host, port), timeout=15)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                f"Origin: {origin}\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed during the handshake")
            head += chunk
        head, self.buffer = head.split(b"\r\n\r\n", 1)
        self.status_line = head.split(b"\r\n", 1)[0].decode()

    @property
    def upgraded(self) -> bool:
        return " 101 " in self.status_line + " "

    def send_json(self, value: object) -> None:
        payload = json.dumps(value).encode()
        mask = os.urandom(4)
        header = bytes([0x81])
        if len(payload) < 126:
            header += bytes([0x80 | len(payload)])
        else:
            header += bytes([0x80 | 126]) + struct.pack("!H", len(payload))
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _read(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the socket")
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def receive_json(self) -> Any:
        while True:
            first, second = self._read(2)
            length = second & 0x7F
            if length == 126:
                length = struct.unpack("!H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self._read(8))[0]
            payload = self._read(length)
            opcode = first & 0x0F
            if opcode == 0x1:
                return json.loads(payload)
            if opcode == 0x8:
                raise ConnectionError(f"the server closed the socket: {payload!r}")
            # pings and pongs: ignored here

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(bytes([0x88, 0x80]) + os.urandom(4))
        self.sock.close()


# --- the checks -----------------------------------------------------------------------------------


def spread(times: list[float]) -> float:
    return times[-1] - times[0] if len(times) > 1 else 0.0


def assert_streamed(times: list[float], what: str) -> str:
    check(len(times) >= len(TOKENS) - 1, f"{what}: {len(times)} tokens arrived, expected {len(TOKENS)}")
    expected = (len(TOKENS) - 1) * TOKEN_DELAY_S
    check(
        spread(times) >= 0.6 * expected,
        f"{what}: the tokens arrived within {spread(times):.3f} s, not spread over ~{expected:.2f} s (buffered?)",
    )
    distinct = len({round(t, 2) for t in times})
    check(distinct >= len(TOKENS) // 2, f"{what}: only {distinct} distinct arrival times (buffered?)")
    return ", ".join(f"{t:.2f}" for t in times)


def check_sse_through_nginx(proxy: Nginx, fake: FakeWorkersAI, **_: Any) -> str:
    stream = post_quote(proxy.url, "streaming through nginx")
    check(stream.status == 200, f"status {stream.status}: {stream.raw[:300]!r}")
    check(
        stream.headers.get("content-type", "").startswith("text/event-stream"),
        f"content-type {stream.headers.get('content-type')}",
    )
    check("content-encoding" not in stream.headers, f"compressed: {stream.headers.get('content-encoding')}")
    check(stream.events[-1:] == ["[DONE]"], f"no [DONE] at the end: {stream.events[-3:]}")
    check("".join(t for _, t in stream.tokens) == "".join(TOKENS), f"text {stream.tokens}")
    # nginx gives each request its $request_id (32 hex digits); the app logs it and returns it.
    request_id = stream.headers.get("x-request-id", "")
    check(re.fullmatch(r"[0-9a-f]{32}", request_id), f"no X-Request-ID from nginx: {request_id!r}")
    times = assert_streamed([t for t, _ in stream.tokens], "SSE through nginx")
    return f"{len(stream.tokens)} tokens through nginx, uncompressed, X-Request-ID {request_id}, at t = {times} s"


def check_cache_shared(a: Daphne, b: Daphne, fake: FakeWorkersAI, database_url: str, **_: Any) -> str:
    topic = f"shared cache {secrets.token_hex(4)}"
    upstream_before = len(fake.requests)
    first = post_quote(a.url, topic)
    check(
        first.status == 200 and first.events[-1:] == ["[DONE]"],
        f"A: status {first.status} {first.raw[:200]!r}",
    )
    check(
        first.headers.get("cf-aig-cache-status") == "MISS",
        f"A: cache status {first.headers.get('cf-aig-cache-status')}",
    )
    second = post_quote(b.url, topic)
    check(second.status == 200 and second.events[-1:] == ["[DONE]"], f"B: status {second.status}")
    check(
        second.headers.get("cf-aig-cache-status") == "HIT",
        f"B: cache status {second.headers.get('cf-aig-cache-status')}",
    )
    check(
        "".join(t for _, t in second.tokens) == "".join(t for _, t in first.tokens),
        "B replayed a different text",
    )
    upstream_calls = len(fake.requests) - upstream_before
    check(upstream_calls == 1, f"the upstream was called {upstream_calls} times, expected once")
    import psycopg

    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1)) as connection:
        rows = connection.execute(
            "SELECT cache_status FROM quotes_generation WHERE topic = %s ORDER BY id", (topic,)
        ).fetchall()
    check([r[0] for r in rows] == ["miss", "hit"], f"log rows in PostgreSQL: {rows}")
    return "A generated (MISS), B answered from the shared Redis cache (HIT), upstream called once; both rows in PostgreSQL"


def check_rate_limit(a: Daphne, b: Daphne, reset_rate_limits: Callable[[], None], **_: Any) -> str:
    # The limit's window is fixed (aligned to the epoch): start well inside one, so that all four
    # requests fall in the same window (on CI, a minute window once turned over between A and B).
    left = 3600 - time.time() % 3600
    if left < 30:
        time.sleep(left + 0.5)
    reset_rate_limits()
    statuses = []
    for target in (a, a, b, b):
        response = httpx.post(
            target.url + "/api/quotes/stream",
            json={"persona": PERSONA, "topic": f"rate {len(statuses)}"},
            timeout=30,
        )
        statuses.append((target.name, response.status_code, response.headers.get("retry-after")))
    codes = [status for _, status, _ in statuses]
    check(codes == [200, 200, 200, 429], f"statuses {statuses}")
    check(statuses[-1][2], "the 429 has no Retry-After")
    return (
        f"limit {RATE_LIMIT}/h: "
        + ", ".join(f"{n}->{s}" for n, s, _ in statuses)
        + f" (Retry-After {statuses[-1][2]})"
    )


def check_websocket(proxy: Nginx, reset_rate_limits: Callable[[], None], **_: Any) -> str:
    if not (ROOT / "quotes" / "consumers.py").exists():
        raise Skipped("quotes/consumers.py is not there yet (no WebSocket consumer to test)")
    reset_rate_limits()
    ws = WebSocket("127.0.0.1", proxy.port, "/ws/quotes/", origin=proxy.url)
    try:
        if not ws.upgraded:
            if " 404 " in ws.status_line:
                raise Skipped(f"/ws/quotes/ is not routed yet ({ws.status_line})")
            raise CheckFailed(f"the WebSocket handshake through nginx failed: {ws.status_line}")
        started = time.perf_counter()
        ws.send_json({"type": "start", "persona": PERSONA, "topic": f"websocket {secrets.token_hex(4)}"})
        tokens: list[tuple[float, str]] = []
        while True:
            frame = ws.receive_json()
            kind = frame.get("type")
            if kind == "token":
                tokens.append((time.perf_counter() - started, frame["text"]))
            elif kind == "done":
                break
            elif kind == "error":
                raise CheckFailed(f"error frame: {frame}")
    finally:
        ws.close()
    check("".join(t for _, t in tokens) == "".join(TOKENS), f"text {tokens}")
    times = assert_streamed([t for t, _ in tokens], "WebSocket through nginx")
    return f"{len(tokens)} token frames then done, through nginx, at t = {times} s"


def check_static_and_health(proxy: Nginx, a: Daphne, static_root: Path, **_: Any) -> str:
    manifest = json.loads((static_root / "staticfiles.json").read_text())["paths"]
    hashed = manifest["css/site.css"]
    check(re.search(r"\.[0-9a-f]{12}\.css$", hashed), f"not a hashed name: {hashed}")
    response = httpx.get(f"{proxy.url}/static/{hashed}", headers={"Accept-Encoding": "gzip"})
    check(response.status_code == 200, f"static file: {response.status_code}")
    check(response.headers.get("content-encoding") == "gzip", "static file not served pre-compressed")
    check(
        "immutable" in response.headers.get("cache-control", ""),
        f"cache-control {response.headers.get('cache-control')}",
    )
    page = httpx.get(proxy.url + "/")
    check(hashed in page.text, "the page does not link the hashed file")
    check(
        "unsafe-inline" not in page.headers.get("content-security-policy", "unsafe-inline"),
        "CSP missing or allows inline",
    )
    health = httpx.get(proxy.url + "/healthz").json()
    check(health["status"] == "ok", f"healthz {health}")
    line = next(
        (line for line in a.log.read_text().splitlines() if '"logger": "quotes.request"' in line), None
    )
    check(line is not None, "no JSON access log line from process A")
    logged = json.loads(line or "{}")
    check(logged.get("request_id") not in (None, "-"), f"log line without request id: {line}")
    return f"/static/{hashed} gzip + immutable; CSP set; /healthz {health['checks']['database']['status']}/{health['checks']['cache']['status']}/{health['checks']['backend']['status']}; JSON logs with request_id"


def check_metrics_per_process(
    proxy: Nginx, a: Daphne, b: Daphne, metrics_urls: list[str], database_url: str, **_: Any
) -> str:
    from prometheus_client.parser import text_string_to_metric_families

    check(httpx.get(proxy.url + "/metrics").status_code == 404, "/metrics is reachable on the public site")
    check(httpx.get(metrics_urls[0] + "/metrics").status_code == 403, "/metrics answered without the token")
    check(httpx.get(metrics_urls[0] + "/").status_code == 404, "the metrics port serves the site")
    import psycopg

    def scrape() -> list[int]:
        totals = []
        for url in metrics_urls:
            response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
            check(response.status_code == 200, f"{url}/metrics: {response.status_code} {response.text[:200]}")
            families = {family.name: family for family in text_string_to_metric_families(response.text)}
            lost = sum(sample.value for sample in families["quotes_log_rows_lost"].samples)
            check(lost == 0, f"{url}: {lost} lost log rows")
            totals.append(int(sum(sample.value for sample in families["quotes_requests"].samples)))
        return totals

    def log_rows() -> int:
        with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1)) as connection:
            row = connection.execute("SELECT COUNT(*) FROM quotes_generation").fetchone()
        return row[0] if row else 0

    # A stream is counted as it ends and its row is written by the log writer a moment later
    # (a batch), so the two agree once the last stream's row is in: wait for that, within reason.
    deadline = time.monotonic() + 15
    while True:
        totals, rows = scrape(), log_rows()
        if sum(totals) == rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    check(all(totals), f"a process counted no request: {totals}")
    check(sum(totals) == rows, f"requests counted per process {totals} do not add up to {rows} log rows")
    return f"requests counted by A and B: {totals[0]} + {totals[1]} = {rows} log rows; 0 lost; public /metrics 404, no token 403"


CHECKS: list[tuple[str, Callable[..., str]]] = [
    ("1 SSE streams token by token through nginx", check_sse_through_nginx),
    ("2 cache hit on B for A's answer", check_cache_shared),
    ("3 rate limit shared by A and B", check_rate_limit),
    ("4 WebSocket streams through nginx", check_websocket),
    ("5 hashed, compressed static files; health; logs", check_static_and_health),
    ("6 metrics scraped per process", check_metrics_per_process),
]


def main() -> int:
    started = time.perf_counter()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="persona-quotes-scaleout-") as tmp, FakeWorkersAI() as fake:
        workdir = Path(tmp)
        fake.default = Scenario(tokens=TOKENS, token_delay_s=TOKEN_DELAY_S)
        try:
            with postgres(workdir) as pg, redis(workdir) as redis_url:
                static_root = workdir / "static"
                env = production_env(
                    database_url=pg.url, redis_url=redis_url, fake=fake, static_root=static_root
                )
                manage(env, "migrate", "--noinput", "-v0")
                manage(env, "collectstatic", "--noinput", "-v0")
                print(
                    f"setup: PostgreSQL :{pg.port}, Redis {redis_url}, migrate + collectstatic done",
                    flush=True,
                )
                with daphne("A", env, workdir) as a, daphne("B", env, workdir) as b:
                    port = free_port()
                    metrics_ports = [free_port(), free_port()]
                    site = nginx_site(port, [a, b], metrics_ports)
                    with nginx(workdir, site=site, port=port) as proxy:
                        print(f"setup: nginx {proxy.url} -> daphne A {a.url}, daphne B {b.url}", flush=True)

                        def reset_rate_limits() -> None:
                            import redis as redis_py

                            client = redis_py.Redis.from_url(redis_url)
                            for key in client.scan_iter(match="*quotes:rate:*"):
                                client.delete(key)
                            client.close()

                        context = {
                            "proxy": proxy,
                            "a": a,
                            "b": b,
                            "fake": fake,
                            "database_url": pg.url,
                            "static_root": static_root,
                            "reset_rate_limits": reset_rate_limits,
                            "metrics_urls": [f"http://127.0.0.1:{p}" for p in metrics_ports],
                        }
                        for name, function in CHECKS:
                            try:
                                print(f"PASS     {name}: {function(**context)}", flush=True)
                            except Skipped as exc:
                                print(f"SKIPPED  {name}: {exc}", flush=True)
                            except Exception as exc:
                                failures += 1
                                detail = str(exc) if isinstance(exc, CheckFailed) else traceback.format_exc()
                                print(f"FAIL     {name}: {detail}", flush=True)
                        if failures:
                            for d in (a, b):
                                print(f"--- daphne {d.name} log (tail)\n{tail(d.log)}")
                            print(f"--- nginx error log (tail)\n{tail(proxy.log_dir / 'error.log')}")
        except RuntimeError as exc:  # a ServiceError, or manage.py failing
            print(f"FAIL     setup: {exc}", flush=True)
            return 1
    print(f"{'FAILED' if failures else 'ALL PASSED'} in {time.perf_counter() - started:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
