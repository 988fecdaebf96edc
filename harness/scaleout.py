"""Scale-out, proven on one machine: the production layout of harness/faults/layout.py (two daphne
processes behind a real nginx with deploy/nginx's rules, one PostgreSQL, one Redis, production
settings) and the checks that what spans processes works:

    .venv/bin/python -m harness.scaleout        # make scaleout

1. an SSE quote streams through nginx token by token, uncompressed (Accept-Encoding: gzip sent);
2. an answer process A generated is a cache hit on process B (Redis; the upstream called once;
   both rows in the shared PostgreSQL);
3. the rate-limit windows are shared: a client's budget spent half on A, half on B, is spent;
4. a WebSocket quote streams through nginx frame by frame;
5. static files through nginx are collectstatic's hashed, pre-compressed files; the page has its
   CSP; /healthz is ok; the logs are JSON lines with the request id;
6. Prometheus's view: each process's /metrics on its own nginx port (token required) counts the
   requests it served, as the rows in PostgreSQL do; /metrics on the public site is 404.

tests/deploy/test_scaleout.py runs every check. Exits 1 when any check fails.

`shared()`: one layout for every test module of a pytest run that uses it (test_scaleout.py,
tests/faults/test_faults.py), started on first use and stopped when the run ends: the layout
takes 10 to 20 s to start on a 2-core machine, and each module leaves it whole.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import re
import secrets
import sys
import time
import traceback
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.daphne import ROOT
from harness.faults.layout import METRICS_TOKEN, PERSONA, Layout, Settings, started
from harness.services import client_at
from harness.sse import Reader, WebSocket

TOKEN_DELAY_S = 0.05
TOKENS = 10
#: The actions' rate limit (stop, share, feedback: QUOTES_FEEDBACK_RATE_LIMIT), set low here.
ACTION_LIMIT = 10
SETTINGS = Settings(
    tokens=TOKENS,
    tokens_per_second=1 / TOKEN_DELAY_S,
    env={"QUOTES_FEEDBACK_RATE_LIMIT": f"{ACTION_LIMIT}/minute"},
)


class CheckFailed(AssertionError):
    pass


def check(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def stream(base_url: str, topic: str) -> tuple[httpx.Response, list[float], list[str]]:
    """POST a quote and read its SSE body: the response, when each token arrived, the events."""
    started = time.perf_counter()
    times: list[float] = []
    texts: list[str] = []
    payload = {"persona": PERSONA, "topic": topic}
    with httpx.stream(
        "POST", base_url + "/api/quotes/stream", json=payload, headers={"Accept-Encoding": "gzip"}, timeout=30
    ) as response:
        reader = Reader()
        for chunk in response.iter_raw():
            for event in reader.feed(chunk):
                texts.append(event["data"])
                if event["data"].startswith('{"response":"') and '"usage"' not in event["data"]:
                    times.append(time.perf_counter() - started)
    return response, times, texts


def streamed(times: list[float], what: str) -> str:
    """The tokens arrived one by one, over about the time the upstream took to send them."""
    check(len(times) == TOKENS, f"{what}: {len(times)} tokens arrived, expected {TOKENS}")
    spread, expected = times[-1] - times[0], (TOKENS - 1) * TOKEN_DELAY_S
    check(spread >= 0.6 * expected, f"{what}: the tokens came within {spread:.3f} s, not ~{expected:.2f} s")
    return f"{len(times)} tokens over {spread:.2f} s"


def check_sse_through_nginx(layout: Layout) -> str:
    response, times, events = stream(layout.url, "streaming through nginx")
    check(response.status_code == 200, f"status {response.status_code}")
    check(response.headers["content-type"].startswith("text/event-stream"), str(response.headers))
    check("content-encoding" not in response.headers, "the stream was compressed")
    check(events[-1:] == ["[DONE]"], f"no [DONE] at the end: {events[-3:]}")
    request_id = response.headers.get("x-request-id", "")
    check(re.fullmatch(r"[0-9a-f]{32}", request_id), f"no X-Request-ID from nginx: {request_id!r}")
    return f"{streamed(times, 'SSE')} through nginx, uncompressed, X-Request-ID {request_id}"


def check_cache_shared(layout: Layout) -> str:
    a, b = layout.daphnes
    topic = f"shared cache {secrets.token_hex(4)}"
    calls = len(layout.fake.requests)
    first, _, first_events = stream(a.url, topic)
    second, _, second_events = stream(b.url, topic)
    statuses = [r.headers.get("cf-aig-cache-status") for r in (first, second)]
    check(statuses == ["MISS", "HIT"], f"cache status on A then B: {statuses}")
    check(first_events == second_events, "B replayed another text")
    check(len(layout.fake.requests) - calls == 1, "the upstream was called more than once")
    rows = layout.sql("SELECT cache_status FROM quotes_generation WHERE topic = %s ORDER BY id", [topic])
    check([r[0] for r in rows] == ["miss", "hit"], f"rows in PostgreSQL: {rows}")
    return "A generated (MISS), B replayed it from Redis (HIT), the upstream called once; both rows"


def check_rate_limit_shared(layout: Layout) -> str:
    """A client rates an unknown quote (404, counted against its action budget), alternately on
    A and on B, past the budget: the window in Redis counts both processes' requests."""
    url = "/api/quotes/00000000-0000-4000-8000-000000000000/feedback"
    with client_at(f"127.200.{secrets.randbelow(250)}.{2 + secrets.randbelow(250)}") as client:
        answers = [
            client.post(layout.daphnes[n % 2].url + url, json={"value": 1}) for n in range(ACTION_LIMIT + 1)
        ]
    codes = [r.status_code for r in answers]
    check(codes == [404] * ACTION_LIMIT + [429], f"statuses, alternating A and B: {codes}")
    check(int(answers[-1].headers.get("retry-after", 0)) > 0, "the 429 has no Retry-After")
    return (
        f"{ACTION_LIMIT}/minute: {ACTION_LIMIT} answered across A and B, then 429 on {'AB'[ACTION_LIMIT % 2]}"
    )


def check_websocket(layout: Layout) -> str:
    ws = WebSocket("127.0.0.1", layout.proxy.port, "/ws/quotes/")
    try:
        check(ws.upgraded, f"the WebSocket handshake through nginx failed: {ws.status_line}")
        started, times, text = time.perf_counter(), [], ""
        ws.send_json({"type": "start", "persona": PERSONA, "topic": f"websocket {secrets.token_hex(4)}"})
        while (frame := ws.receive_json())["type"] != "done":
            check(frame["type"] in ("meta", "token"), f"frame {frame}")
            if frame["type"] == "token":
                times.append(time.perf_counter() - started)
                text += frame["text"]
    finally:
        ws.close()
    check(text == layout.text, f"text {text!r}")
    return f"{streamed(times, 'WebSocket')} through nginx, then done"


def check_static_and_health(layout: Layout) -> str:
    manifest = json.loads((ROOT / "staticfiles" / "staticfiles.json").read_text())["paths"]
    hashed = manifest["css/site.css"]
    check(re.search(r"\.[0-9a-f]{12}\.css$", hashed), f"not a hashed name: {hashed}")
    response = httpx.get(f"{layout.url}/static/{hashed}", headers={"Accept-Encoding": "gzip"})
    check(response.status_code == 200, f"static file: {response.status_code}")
    check(response.headers.get("content-encoding") == "gzip", "static file not served pre-compressed")
    check("immutable" in response.headers.get("cache-control", ""), response.headers.get("cache-control"))
    page = httpx.get(f"{layout.url}/personas/{PERSONA}/")
    check(hashed in page.text, "the page does not link the hashed file")
    check("unsafe-inline" not in page.headers.get("content-security-policy", "unsafe-inline"), "CSP")
    health = httpx.get(layout.url + "/healthz").json()
    check(health["status"] == "ok", f"healthz {health}")
    lines = [
        json.loads(line) for line in layout.daphnes[0].log.read_text().splitlines() if line.startswith("{")
    ]
    access = [line for line in lines if line.get("logger") == "quotes.request"]
    check(
        access and all(re.fullmatch(r"[0-9a-f]{32}", line["request_id"]) for line in access), "access lines"
    )
    return f"/static/{hashed} gzip + immutable; CSP set; /healthz ok; JSON logs with request ids"


def check_metrics_per_process(layout: Layout) -> str:
    check(httpx.get(layout.url + "/metrics").status_code == 404, "/metrics is reachable on the public site")
    check(
        httpx.get(layout.metrics_urls[0] + "/metrics").status_code == 403, "/metrics answered without token"
    )
    check(httpx.get(layout.metrics_urls[0] + "/").status_code == 404, "the metrics port serves the site")

    def scrape() -> list[int]:
        totals = []
        for url in layout.metrics_urls:
            response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
            check(response.status_code == 200, f"{url}/metrics: {response.status_code}")
            families = {family.name: family for family in text_string_to_metric_families(response.text)}
            check(sum(s.value for s in families["quotes_log_rows_lost"].samples) == 0, f"{url}: lost rows")
            totals.append(int(sum(s.value for s in families["quotes_requests"].samples)))
        return totals

    before, rows_before = scrape(), layout.last_row_id()
    for daphne in layout.daphnes:
        for n in range(2):
            stream(daphne.url, f"counted {secrets.token_hex(4)} {n}")
    after = scrape()
    rows = layout.sql("SELECT count(*) FROM quotes_generation WHERE id > %s", [rows_before])[0][0]
    counted = [b - a for a, b in zip(before, after, strict=True)]
    check(counted == [2, 2] and rows == 4, f"2 quotes on each process: counted {counted}, {rows} rows")
    return "A and B each counted their 2 quotes, as the 4 rows say; none lost; public 404, no token 403"


CHECKS: list[tuple[str, Callable[[Layout], str]]] = [
    ("1 SSE streams token by token through nginx", check_sse_through_nginx),
    ("2 cache hit on B for A's answer", check_cache_shared),
    ("3 rate-limit windows shared by A and B", check_rate_limit_shared),
    ("4 WebSocket streams through nginx", check_websocket),
    ("5 hashed, compressed static files; health; logs", check_static_and_health),
    ("6 metrics scraped per process", check_metrics_per_process),
]


_shared: list[Layout] = []


def shared() -> Layout:
    """The layout on SETTINGS, started once for the whole run (stopped at exit)."""
    if not _shared:
        stack = contextlib.ExitStack()
        _shared.append(stack.enter_context(started(SETTINGS)))
        # Registered after the layout's temporary directory (its finalizer): run before it, at exit.
        atexit.register(stack.close)
    return _shared[0]


def main() -> int:
    started_at, failures = time.perf_counter(), 0
    with started(SETTINGS) as layout:
        print(f"setup: nginx {layout.url} -> {', '.join(d.url for d in layout.daphnes)}", flush=True)
        for name, function in CHECKS:
            try:
                print(f"PASS     {name}: {function(layout)}", flush=True)
            except Exception as exc:
                failures += 1
                detail = str(exc) if isinstance(exc, CheckFailed) else traceback.format_exc()
                print(f"FAIL     {name}: {detail}", flush=True)
    print(f"{'FAILED' if failures else 'ALL PASSED'} in {time.perf_counter() - started_at:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
