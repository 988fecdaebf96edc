"""Render the Grafana dashboard (deploy/grafana/persona-quotes.json) from a real scrape, for the
screenshot in docs/deployment.md (docs/img/metrics-dashboard.png).

    .venv/bin/python -m bench.dashboard [--duration 90]

What runs, all on 127.0.0.1:

- two daphne processes (A and B) on one SQLite database, as docs/deployment.md runs them
  (the visitors' addresses in `X-Forwarded-For`, believed from 127.0.0.1), with the workers-ai backend pointed at the fake upstream
  (tests/fakes/workers_ai.py) and one persona on the embedded model (on A only);
- Debian's Prometheus scraping each process's /metrics on its own port, with the bearer token;
- a traffic driver: visitors on every transport (JSON API, EventSource, htmx, WebSocket),
  repeated topics (cache hits), identical requests at once (coalesced), visitors who leave
  mid-quote (cancelled), a greedy visitor (rate-limited), upstream errors, capacity errors
  (retries and fallback steps) and bursts on the embedded model (busy).

Then every panel's queries, exactly as in the dashboard JSON (`$__rate_interval` and
`$instance` filled in as Grafana would), go to Prometheus's HTTP API; the answers are drawn as
an HTML page of SVG charts, which Debian's chromium screenshots through Playwright. Grafana itself
does not run here. Needs `apt-get install prometheus chromium`. Takes about duration + 40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import json
import math
import random
import secrets
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import ACCOUNT_ID, API_TOKEN, ARTIFACTS, PYTHON, ROOT, app_env, free_port
from tests.deployed import start_daphne
from tests.fakes.workers_ai import FakeWorkersAI, Scenario
from tests.scaleout.run import WebSocket

DASHBOARD = ROOT / "deploy" / "grafana" / "persona-quotes.json"
SCREENSHOT = ROOT / "docs" / "img" / "metrics-dashboard.png"
TOKEN = secrets.token_urlsafe(24)
SCRAPE_INTERVAL_S = 2
#: What Grafana puts for $__rate_interval: four scrape intervals (at least).
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"
FALLBACK = "@cf/meta/llama-3.2-3b-instruct"
CLOUD_PERSONAS = ("alan-watts", "marcus-aurelius", "ada-lovelace", "mark-twain", "emily-dickinson")
LOCAL_PERSONA = "lao-tzu"
TOPICS = ("rain", "work", "time", "friendship", "the sea", "courage")
QUOTE = "The river does not hurry, yet it arrives; every stone it passes teaches patience."


# --- the servers ----------------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def daphne_pair(fake: FakeWorkersAI, workdir: Path) -> Iterator[list[Process]]:
    db_path = workdir / "db.sqlite3"
    env = app_env(
        db_path,
        AI_BACKEND="workers-ai",
        CLOUDFLARE_ACCOUNT_ID=ACCOUNT_ID,
        CLOUDFLARE_API_TOKEN=API_TOKEN,
        CLOUDFLARE_API_BASE_URL=fake.api_base_url,
        QUOTES_CACHE_TTL="600",
        QUOTES_RATE_LIMIT="15/m",
        QUOTES_MAX_CONCURRENT_STREAMS="4",
        QUOTES_MAX_ATTEMPTS="2",
        QUOTES_RETRY_DELAY_MS="50",
        QUOTES_FALLBACK_MODELS=FALLBACK,
        QUOTES_METRICS_TOKEN=TOKEN,
        LOCAL_MODEL_SLOTS="2",
        LOCAL_MODEL_THREADS="1",
        LOCAL_MODEL_QUEUE_TIMEOUT="3",
    )
    subprocess.run([PYTHON, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    with contextlib.closing(sqlite3.connect(db_path)) as db, db:
        db.execute(
            "UPDATE quotes_persona SET backend = 'local', max_tokens = 24 WHERE slug = ?", (LOCAL_PERSONA,)
        )
    processes: list[Process] = []
    try:
        for name in ("A", "B"):
            # As deploy/systemd/persona-quotes@.service starts each process (tests.deployed).
            port = free_port()
            process = start_daphne(port, env, workdir / f"daphne-{name}.log")
            processes.append(Process(name, f"http://127.0.0.1:{port}", process))
        for p in processes:
            wait_until(
                lambda p=p: httpx.get(p.url + "/healthz", timeout=2).status_code == 200, f"daphne {p.name}"
            )
        yield processes
    finally:
        for p in processes:
            p.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.process.wait(15)
            if p.process.poll() is None:
                p.process.kill()


@contextlib.contextmanager
def prometheus(targets: list[str], workdir: Path) -> Iterator[str]:
    executable = shutil.which("prometheus")
    if executable is None:
        raise SystemExit("Prometheus is not installed: apt-get install prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": "15s"},
                "scrape_configs": [
                    {
                        "job_name": "persona-quotes",
                        "authorization": {"type": "Bearer", "credentials": TOKEN},
                        "static_configs": [{"targets": [t.removeprefix("http://") for t in targets]}],
                    }
                ],
            }
        )
    )
    port = free_port()
    command = [executable, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}"]
    command += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    log = (workdir / "prometheus.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/-/ready", timeout=2).status_code == 200, "prometheus")
        yield url
    finally:
        process.terminate()
        process.wait(15)


def wait_until(ready: Any, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


# --- the traffic ----------------------------------------------------------------------------------


class Driver:
    def __init__(self, processes: list[Process], fake: FakeWorkersAI, seed: int) -> None:
        self.processes = processes
        self.fake = fake
        self.random = random.Random(seed)
        self.counts: dict[str, int] = {}

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def run(self, duration_s: float, visitors: int) -> None:
        stop_at = time.monotonic() + duration_s
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(self.visitor(client, stop_at) for _ in range(visitors)))

    async def visitor(self, client: httpx.AsyncClient, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            ip = f"198.51.100.{self.random.randrange(1, 255)}"  # many visitors, each well under the limit
            roll = self.random.random()
            target = self.random.choice(self.processes)
            try:
                if roll < 0.45:
                    await self.quote(client, target, ip, self.random.choice(TOPICS))
                elif roll < 0.55:
                    await self.quote(client, target, ip, self.fresh_topic(), leave_after=3)
                elif roll < 0.60:
                    await self.local_burst(client)
                elif roll < 0.64:
                    # The model and its fallback both refuse: an error with its code.
                    self.fake.script(Scenario.model_not_found(), Scenario.model_not_found())
                    await self.quote(client, target, ip, self.fresh_topic(), transport="api")
                elif roll < 0.68:
                    # The upstream drops the connection mid-quote: an error after text.
                    self.fake.script(Scenario(tokens=[f" {w}" for w in QUOTE.split()], drop_after_tokens=4))
                    await self.quote(client, target, ip, self.fresh_topic(), transport="api")
                elif roll < 0.74:
                    self.fake.script(*[Scenario.out_of_capacity()] * self.random.choice((1, 2)))
                    await self.quote(client, target, ip, self.fresh_topic(), transport="api")
                elif roll < 0.80:
                    topic = self.fresh_topic()
                    await asyncio.gather(
                        *(
                            self.quote(client, target, f"192.0.2.{n}", topic, transport="api")
                            for n in range(3)
                        )
                    )
                elif roll < 0.86:
                    await asyncio.gather(*(self.quote(client, target, "203.0.113.9", t) for t in TOPICS[:4]))
                else:
                    await self.quote(client, target, ip, self.random.choice(TOPICS), transport="websocket")
            except (httpx.HTTPError, OSError, ConnectionError) as exc:
                self.note(f"driver error {type(exc).__name__}")
            await asyncio.sleep(self.random.uniform(0.1, 0.6))

    def fresh_topic(self) -> str:
        return f"{self.random.choice(TOPICS)} {secrets.token_hex(3)}"

    async def local_burst(self, client: httpx.AsyncClient) -> None:
        """Three fresh quotes at once from the embedded model on A (two slots: one may wait)."""
        a = self.processes[0]
        await asyncio.gather(
            *(
                self.quote(client, a, f"192.0.2.{50 + n}", self.fresh_topic(), persona=LOCAL_PERSONA)
                for n in range(3)
            )
        )

    async def quote(
        self,
        client: httpx.AsyncClient,
        target: Process,
        ip: str,
        topic: str,
        *,
        persona: str | None = None,
        transport: str | None = None,
        leave_after: int | None = None,
    ) -> None:
        persona = persona or self.random.choice(CLOUD_PERSONAS)
        transport = transport or self.random.choice(("api", "api", "htmx", "eventsource"))
        body = {"persona": persona, "topic": topic}
        if transport == "websocket":
            await asyncio.to_thread(self.websocket_quote, target, body)
            return
        headers = {"X-Forwarded-For": ip}
        if transport == "eventsource":
            request = client.build_request(
                "GET",
                target.url + "/api/quotes/stream",
                params=body,
                headers={**headers, "Accept": "text/event-stream"},
            )
        else:
            if transport == "htmx":
                headers["HX-Request"] = "true"
            request = client.build_request(
                "POST", target.url + "/api/quotes/stream", json=body, headers=headers
            )
        response = await client.send(request, stream=True)
        try:
            if response.status_code >= 400:
                await response.aread()
                code = response.json().get("error", {}).get("code") if transport != "htmx" else "(htmx)"
                self.note(f"{transport} {response.status_code} {code}")
                return
            self.note(f"{transport} {response.status_code}")
            chunks = 0
            async for _ in response.aiter_raw():
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    self.note("left mid-quote")
                    return
        finally:
            await response.aclose()

    def websocket_quote(self, target: Process, body: dict[str, str]) -> None:
        port = int(target.url.rsplit(":", 1)[1])
        ws = WebSocket("127.0.0.1", port, "/ws/quotes/", origin=target.url)
        try:
            ws.send_json({"type": "start", **body})
            while (frame := ws.receive_json())["type"] not in ("done", "error"):
                pass
            self.note(f"websocket {frame['type']}")
        finally:
            ws.close()


# --- from Prometheus to a picture -------------------------------------------------------------------

PALETTE = ("#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a", "#96d98d")


def query_range(
    prometheus_url: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$instance", ".*")
    response = httpx.get(
        prometheus_url + "/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step},
        timeout=30,
    )
    payload = response.json()
    if payload.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {payload}")
    result: list[dict[str, Any]] = payload["data"]["result"]
    return result


def legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    while "{{" in text:  # a label the series does not carry is empty, as in Grafana
        head, _, rest = text.partition("{{")
        text = head + rest.partition("}}")[2]
    return " ".join(text.split()) or "value"


def fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "currencyUSD":
        return f"${value:.4f}" if abs(value) < 1 else f"${value:.2f}"
    if unit == "bytes":
        return f"{value / 2**20:.0f} MiB"
    if unit == "reqps":
        return f"{value:.3g}/s"
    return f"{value:.3g}"


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]


def panel_series(prometheus_url: str, panel: dict[str, Any], start: float, end: float) -> list[Series]:
    series = []
    for target in panel["targets"]:
        for result in query_range(prometheus_url, target["expr"], start, end, SCRAPE_INTERVAL_S):
            points = [(round(float(t)), float(v)) for t, v in result["values"]]
            if points and not all(math.isnan(v) for _, v in points):
                series.append(Series(legend(target.get("legendFormat", ""), result["metric"]), points))
    series.sort(key=lambda s: s.name)
    return series


def nice_step(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above `value` (axis ticks)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= value)


def svg_chart(series: list[Series], unit: str, stacked: bool, start: float, end: float, width: int) -> str:
    height, left, bottom = 200, 64, 22
    plot_w, plot_h = width - left - 8, height - bottom - 8
    times = [start + i * SCRAPE_INTERVAL_S for i in range(int((end - start) / SCRAPE_INTERVAL_S) + 1)]
    values = []
    base = dict.fromkeys(times, 0.0)
    for s in series:
        lookup = dict(s.points)
        row = []
        for t in times:
            v = lookup.get(t, math.nan)
            if stacked and not math.isnan(v):
                v += base[t]
                base[t] = v
            row.append(v)
        values.append(row)
    finite = [v for row in values for v in row if not math.isnan(v)]
    peak = max(finite, default=0.0) or 1.0
    scale = 2**20 if unit == "bytes" else 1  # ticks on whole MiB
    step = nice_step(peak / scale / 4) * scale
    top = math.ceil(peak / step) * step
    ticks = [i * step for i in range(round(top / step) + 1)]

    def x(t: float) -> float:
        return left + (t - start) / max(1.0, end - start) * plot_w

    def y(v: float) -> float:
        return 8 + plot_h - v / top * plot_h

    parts = [
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for v in ticks:
        parts.append(f'<line x1="{left}" x2="{width - 8}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>')
        parts.append(
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" class="axis" text-anchor="end">{html.escape(fmt(v, unit))}</text>'
        )
    for i in range(5):
        t = start + (end - start) * i / 4
        label = datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")
        anchor = "end" if i == 4 else "middle"
        parts.append(
            f'<text x="{x(t):.1f}" y="{height - 4}" class="axis" text-anchor="{anchor}">{label}</text>'
        )
    # Stacked: the top series first, so each one below is drawn over it and stays visible.
    order = list(enumerate(values))
    for index, row in reversed(order) if stacked else order:
        color = PALETTE[index % len(PALETTE)]
        runs: list[list[tuple[float, float]]] = [[]]
        for t, v in zip(times, row, strict=True):
            if math.isnan(v):
                runs.append([])
            else:
                runs[-1].append((x(t), y(v)))
        for run in runs:
            if len(run) < 2:
                continue
            line = " ".join(f"{px:.1f},{py:.1f}" for px, py in run)
            area = f"{run[0][0]:.1f},{y(0):.1f} {line} {run[-1][0]:.1f},{y(0):.1f}"
            parts.append(
                f'<polygon points="{area}" fill="{color}" fill-opacity="{0.25 if stacked else 0.08}"/>'
            )
            parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    parts.append("</svg>")
    legend_items = "".join(
        f'<span class="key"><i style="background:{PALETTE[i % len(PALETTE)]}"></i>{html.escape(s.name)}</span>'
        for i, s in enumerate(series)
    )
    return "".join(parts) + f'<div class="legend">{legend_items}</div>'


def render(prometheus_url: str, start: float, end: float, note: str) -> str:
    # Whole seconds: Prometheus answers at start + k * step, and the chart looks points up by time.
    start, end = float(int(start)), float(int(end))
    dashboard = json.loads(DASHBOARD.read_text())
    cells = []
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        series = panel_series(prometheus_url, panel, start, end)
        if panel["type"] == "stat":
            last = (
                next((v for _, v in reversed(series[0].points) if not math.isnan(v)), math.nan)
                if series
                else math.nan
            )
            steps = panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
            color = "#73bf69"
            for step in steps:
                if step["value"] is None or (not math.isnan(last) and last >= step["value"]):
                    color = {"green": "#73bf69", "orange": "#ff9830", "red": "#f2495c"}.get(
                        step["color"], color
                    )
            body = f'<div class="stat" style="color:{color}">{html.escape(fmt(last, unit))}</div>'
        elif series:
            stacked = "stacking" in panel["fieldConfig"]["defaults"].get("custom", {})
            # The page is 1400 px wide in 24 columns: the panel's width in pixels, less its padding.
            body = svg_chart(series, unit, stacked, start, end, width=int(grid["w"] * 1368 / 24 - 30))
        else:
            body = '<div class="nodata">No data</div>'
        style = f"grid-column:{grid['x'] + 1}/span {grid['w']};grid-row:{grid['y'] + 1}/span {grid['h']}"
        cells.append(f'<section style="{style}"><h2>{html.escape(panel["title"])}</h2>{body}</section>')
    return f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ background:#111217; color:#ccccdc; font:13px/1.3 Inter, "DejaVu Sans", sans-serif; margin:16px; }}
header {{ display:flex; justify-content:space-between; align-items:baseline; margin-bottom:10px; }}
h1 {{ font-size:18px; margin:0; color:#fff; }} header p {{ margin:0; color:#8e8e9e; font-size:12px; }}
main {{ display:grid; grid-template-columns:repeat(24, 1fr); grid-auto-rows:30px; gap:8px; }}
section {{ background:#181b1f; border:1px solid #2c3235; border-radius:3px; padding:6px 10px; overflow:hidden; }}
h2 {{ font-size:13px; font-weight:500; margin:0 0 4px; color:#d8d9da; }}
.stat {{ font-size:34px; font-weight:500; margin-top:14px; }}
.grid {{ stroke:#2c3235; stroke-width:1; }} .axis {{ fill:#8e8e9e; font-size:10px; }}
.legend {{ font-size:11px; color:#ccccdc; margin-top:2px; }}
.key {{ margin-right:12px; white-space:nowrap; }} .key i {{ display:inline-block; width:10px; height:3px; margin:0 5px 3px 0; }}
.nodata {{ color:#8e8e9e; margin-top:60px; text-align:center; }}
</style></head><body><header><h1>{html.escape(dashboard["title"])}</h1><p>{html.escape(note)}</p></header>
<main>{"".join(cells)}</main></body></html>"""


def screenshot(page_html: str, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    html_path = ARTIFACTS / "dashboard.html"
    html_path.write_text(page_html)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium",
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(html_path.as_uri())
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=90, help="seconds of traffic")
    parser.add_argument("--visitors", type=int, default=5, help="concurrent simulated visitors")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--out", type=Path, default=SCREENSHOT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp, FakeWorkersAI() as fake:
        workdir = Path(tmp)
        fake.default = Scenario(
            tokens=[f" {w}" for w in QUOTE.split()], usage=(140, len(QUOTE.split())), token_delay_s=0.06
        )
        with daphne_pair(fake, workdir) as processes, prometheus([p.url for p in processes], workdir) as prom:
            driver = Driver(processes, fake, args.seed)
            # Load the embedded model on A before the clock starts (its first answer waits for it).
            httpx.post(
                processes[0].url + "/api/quotes/stream",
                json={"persona": LOCAL_PERSONA, "topic": "warming up"},
                headers={"X-Forwarded-For": "192.0.2.200"},
                timeout=120,
            )
            time.sleep(2 * SCRAPE_INTERVAL_S)  # a baseline scrape before the first request
            start = time.time()
            traffic = threading.Thread(target=asyncio.run, args=(driver.run(args.duration, args.visitors),))
            traffic.start()
            time.sleep(args.duration - 1)
            end = time.time()  # while the last streams are still open
            traffic.join()
            time.sleep(2 * SCRAPE_INTERVAL_S)
            note = (
                f"Rendered from Prometheus {prometheus_version()} scraping daphne A and B (/metrics), "
                f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M} UTC, {args.duration:.0f} s of "
                f"simulated traffic; queries from deploy/grafana/persona-quotes.json"
            )
            page = render(prom, start - 2 * SCRAPE_INTERVAL_S, end, note)
    screenshot(page, args.out)
    print(json.dumps(dict(sorted(driver.counts.items())), indent=1))
    print(f"screenshot: {args.out}", file=sys.stderr)


def prometheus_version() -> str:
    result = subprocess.run(["prometheus", "--version"], capture_output=True, text=True)
    words = (result.stdout + result.stderr).split()
    return words[2] if len(words) > 2 else "?"


if __name__ == "__main__":
    main()
