"""Hold N concurrent streams through one daphne, against an upstream streaming 50 tokens/s per
stream, for each of three paths in turn: the bare naive proxy, the same-stack naive proxy (the
naive view under the app's own settings and middleware, in the app's own daphne) and the app.
Reports errors, lost log rows, the delay added to every token, daphne's CPU per token, and its
RSS and threads per open stream.

    .venv/bin/python -m bench.load --streams 100 --duration 20 --repeat 2   # the issue's figures
    .venv/bin/python -m bench.load --ladder 100,300,1000 --duration 60      # the ceiling, one run each

The app's open-stream cap (QUOTES_MAX_OPEN_STREAMS) is raised to the stream count and its
admission by the event loop's lag is off (served with bench.naive.stack_settings): this bench
measures what a stream costs, not who is admitted (bench/scaleout_load.py does).

The upstream (in its own process, like every bench upstream) speaks the Workers AI wire format
the fake in harness/workers_ai.py speaks (chunked SSE, `{"response": ...}` events, usage,
`[DONE]`, Connection: close), with one difference: each token's text is the upstream's
`time.monotonic_ns()` at the moment it is written, in decimal. The client reads the same clock
(CLOCK_MONOTONIC, one clock for the machine), so every token's *added delay* is exact: arrival
at the client minus the upstream's send time, i.e. the path's whole hop (daphne, Django, the
app, httpx) plus two loopback transfers.

Why not the tests' fake with Scenario(token_delay_s=0.02): it sleeps per stream and per token
(one timer, one write and one drain per token per stream), 50,000 of each per second at 1,000
streams, more than one core here. This upstream schedules all streams from one 1 ms ticker,
spread over 20 phases so the writes do not arrive in one burst every 20 ms.

The load client is one asyncio loop with raw sockets (no HTTP library: its own cost must stay
small next to the app's), each stream from a loopback address of its own with a csrftoken
cookie of its own (a visitor, as nginx's consistent hash and per-address limits see one); it
measures its own event-loop lag so a slow client is visible.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.common import (
    ARTIFACTS,
    PERSONA,
    PYTHON,
    Log,
    machine,
    parse_args,
    percentile,
    ratio,
    rss_kib,
    serve_app,
    serve_naive,
    table,
    workers_ai_env,
)
from harness.services import client_address

# -- the stamping upstream (its own process) ----------------------------------------------------------


def _upstream_main(conn: Connection, tokens: int, tps: float, numbered: bool) -> None:
    asyncio.run(_StampingUpstream(conn, tokens, tps, numbered).run())


class _StampingUpstream:
    def __init__(self, conn: Connection, tokens: int, tps: float, numbered: bool = False) -> None:
        self.conn = conn
        self.tokens = tokens
        self.numbered = numbered
        self.period_ns = int(1e9 / tps)
        self.phases = max(1, int(1000 / tps))  # one phase per ms of the period
        self.buckets: list[set[_UpStream]] = [set() for _ in range(self.phases)]
        self.requests = 0
        self.completed = 0
        self.broken = 0
        self.tick_lag_ms: list[float] = []
        self.next_phase = 0

    async def run(self) -> None:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0, backlog=4096)
        self.conn.send(server.sockets[0].getsockname()[1])
        ticker = asyncio.create_task(self.tick())
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, self.conn.recv)
            if command == "stats":
                lags = sorted(self.tick_lag_ms)
                self.conn.send(
                    {
                        "requests": self.requests,
                        "completed": self.completed,
                        "broken": self.broken,
                        "open": sum(len(b) for b in self.buckets),
                        "tick_lag_p99_ms": percentile(lags, 99) if lags else 0.0,
                        "tick_lag_max_ms": lags[-1] if lags else 0.0,
                    }
                )
                self.tick_lag_ms.clear()
            else:
                ticker.cancel()
                server.close()
                self.conn.send(True)
                return

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            writer.close()
            return
        self.requests += 1
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        stream = _UpStream(writer)
        phase = self.next_phase
        self.next_phase = (phase + 1) % self.phases
        self.buckets[phase].add(stream)
        with contextlib.suppress(Exception):
            await reader.read(1)  # EOF: the app closed the upstream connection
        stream.closed = True

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        step_s = self.period_ns / self.phases / 1e9
        start = loop.time()
        n = 0
        while True:
            n += 1
            due = start + n * step_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            self.tick_lag_ms.append((loop.time() - due) * 1000)
            bucket = self.buckets[n % self.phases]
            for stream in list(bucket):
                if stream.closed or stream.writer.transport.is_closing():
                    bucket.discard(stream)
                    self.broken += stream.sent < self.tokens
                    continue
                stream.sent += 1
                # Decimal: the app holds back a token's tail that could begin its API token (the
                # stream scrubber), and hex digits would collide with the bench token's "b".
                text = f"{stream.sent}," if self.numbered else str(time.monotonic_ns())
                event = b'data: {"response":"' + text.encode() + b'"}\n\n'
                if stream.sent >= self.tokens:
                    usage = json.dumps({"prompt_tokens": 24, "completion_tokens": self.tokens})
                    event += b'data: {"response":"","usage":' + usage.encode() + b"}\n\ndata: [DONE]\n\n"
                chunk = b"%x\r\n%b\r\n" % (len(event), event)
                if stream.sent >= self.tokens:
                    chunk += b"0\r\n\r\n"
                    bucket.discard(stream)
                    self.completed += 1
                stream.writer.write(chunk)
                if stream.sent >= self.tokens:
                    stream.writer.close()


@dataclass(eq=False)
class _UpStream:
    writer: asyncio.StreamWriter
    sent: int = 0
    closed: bool = False


class StampingUpstream:
    """`numbered`: token n's text is `n,` instead of a time stamp, so every answer is the same
    known text (`numbered_text`) and a client can check it arrived whole, in order, once."""

    def __init__(self, tokens: int, tps: float, *, numbered: bool = False) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_upstream_main, args=(child, tokens, tps, numbered), daemon=True
        )
        self.process.start()
        self.port: int = self._conn.recv()

    @property
    def api_base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/client/v4"

    def stats(self) -> dict[str, Any]:
        self._conn.send("stats")
        result: dict[str, Any] = self._conn.recv()
        return result

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send("stop")
            self._conn.recv()
        self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()


def numbered_text(tokens: int) -> str:
    """The whole answer of a `numbered` StampingUpstream."""
    return "".join(f"{n}," for n in range(1, tokens + 1))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# -- the load client ------------------------------------------------------------------------------------


@dataclass
class Result:
    status: int = 0
    tokens: int = 0
    ttft_s: float = 0.0
    done: bool = False
    error: str = ""
    cancelled: bool = False
    #: seconds to the response's headers, and whether a refusal said when to come back
    headers_s: float = 0.0
    retry_after: bool = False


@dataclass
class Run:
    streams: int
    results: list[Result] = field(default_factory=list)
    delays_ns: array.array[int] = field(default_factory=lambda: array.array("q"))
    loop_lag_ms: list[float] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


RESPONSE = b'"response":"'


def whole_events(buffer: bytes) -> tuple[bytes, bytes]:
    """(the whole SSE events at the head of `buffer`, the partial one after them)."""
    cut = buffer.rfind(b"\n\n")
    return (buffer[: cut + 2], buffer[cut + 2 :]) if cut >= 0 else (b"", buffer)


def response_texts(events: bytes) -> Iterator[bytes]:
    """Each event's `response` string as sent, empty for the usage event. Found by bytes, not
    parsed: the client's own cost must stay small, and these texts need no JSON unescaping."""
    start = 0
    while (at := events.find(RESPONSE, start)) >= 0:
        stop = events.find(b'"', at + len(RESPONSE))
        yield events[at + len(RESPONSE) : stop]
        start = stop


def request_bytes(path: str, body: bytes, extra_headers: str = "", cookie: str = "") -> bytes:
    """A POST from a visitor: a csrftoken cookie of its own (the page would have set one)."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Cookie: csrftoken={cookie or secrets.token_hex(16)}\r\nContent-Length: {len(body)}\r\n"
        f"{extra_headers}Connection: close\r\n\r\n"
    ).encode() + body


async def one_stream(host: str, port: int, path: str, index: int, run: Run, end_by: float) -> None:
    result = Result()
    run.results.append(result)
    body = json.dumps({"persona": PERSONA, "topic": f"load {index} {os.getpid()}"}).encode()
    started = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(
            host, port, limit=1 << 20, local_addr=(client_address(index), 0)
        )
        writer.write(request_bytes(path, body))
        head = await asyncio.wait_for(
            reader.readuntil(b"\r\n\r\n"), timeout=max(1.0, end_by - time.monotonic())
        )
        result.status = int(head.split(b" ", 2)[1])
        result.headers_s = time.monotonic() - started
        result.retry_after = b"\r\nretry-after:" in head.lower()
        if result.status != 200:
            result.error = f"HTTP {result.status}: {(await reader.read(300))!r}"
            return
        buffer = b""
        delays = run.delays_ns
        while True:
            remaining = end_by - time.monotonic()
            if remaining <= 0:
                result.cancelled = True  # the run is over: leave, as a visitor would
                return
            chunk = await asyncio.wait_for(reader.read(65536), timeout=remaining)
            if not chunk:
                result.error = result.error or "closed before [DONE]"
                return
            now = time.monotonic_ns()
            complete, buffer = whole_events(buffer + chunk)
            if not complete:
                continue
            for text in response_texts(complete):
                if text:
                    if not result.tokens:
                        result.ttft_s = time.monotonic() - started
                    result.tokens += 1
                    delays.append(now - int(text))
            if b"event: error" in complete:
                result.error = complete[complete.find(b"event: error") :][:300].decode(errors="replace")
                return
            if b"data: [DONE]" in complete:
                result.done = True
                return
    except TimeoutError:
        result.cancelled = True
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()


async def loop_lag(run: Run, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.01)
        run.loop_lag_ms.append((loop.time() - before - 0.01) * 1000)


def _rss(pids: Sequence[int]) -> dict[str, int]:
    """rss_kib summed over the server processes (VmRSS, Threads, ...)."""
    total: dict[str, int] = {}
    for pid in pids:
        for name, value in rss_kib(pid).items():
            total[name] = total.get(name, 0) + value
    return total


async def drive(
    url: str,
    pid: int | Sequence[int],
    upstream: StampingUpstream,
    streams: int,
    duration: float,
    ramp_per_s: float,
) -> tuple[Run, dict[str, Any]]:
    """Open `streams` streams to `url` (a server and a path) at `ramp_per_s` and read them to the
    end; sample the server processes (`pid`: one, or several summed) during the plateau."""
    pids = [pid] if isinstance(pid, int) else list(pid)
    host, _, rest = url.removeprefix("http://").partition(":")
    port, _, path = rest.partition("/")
    run = Run(streams)
    tasks = []
    stop = asyncio.Event()
    lag = asyncio.create_task(loop_lag(run, stop))
    ramp_s = streams / ramp_per_s
    # Every stream lasts `duration` s of tokens; the run ends 20 s after the last should finish.
    end_by = time.monotonic() + ramp_s + duration + 20
    idle = _rss(pids)
    started = time.monotonic()
    for index in range(streams):
        due = started + index / ramp_per_s
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(one_stream(host, int(port), f"/{path}", index, run, end_by)))
    ramped = time.monotonic()
    # The plateau: every stream open, none finished yet (the first ends `duration` s after it began).
    plateau_end = started + duration - 0.5
    cpu_before, wall_before = sum(cpu_seconds(p) for p in pids), time.monotonic()
    tokens_before = len(run.delays_ns)
    client_cpu_before = time.process_time()
    while True:
        sample = _rss(pids)
        sample["fds"] = sum(open_fds(p) for p in pids)
        sample["t"] = round(time.monotonic() - started, 1)
        run.samples.append(sample)
        if time.monotonic() + 0.5 > plateau_end:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(max(0.0, plateau_end - time.monotonic()))
    wall = time.monotonic() - wall_before
    cpu_used = sum(cpu_seconds(p) for p in pids) - cpu_before
    tokens_seen = len(run.delays_ns) - tokens_before
    plateau = {
        # The servers' CPU time over the tokens they delivered meanwhile: the per-token cost.
        "cpu_us_per_token": round(cpu_used / max(1, tokens_seen) * 1e6, 1),
        "plateau_tokens": tokens_seen,
        "ramp_s": round(ramped - started, 1),
        "plateau_s": round(wall, 1),
        "daphne_cpu_pct": round(100 * cpu_used / wall, 1),
        "client_cpu_pct": round(100 * (time.process_time() - client_cpu_before) / wall, 1),
        "idle": idle,
        "upstream": upstream.stats(),
    }
    await asyncio.gather(*tasks)
    stop.set()
    await lag
    return run, plateau


def raise_fd_limit(needed: int) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, needed)) if hard != resource.RLIM_INFINITY else max(soft, needed)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]} (hard {hard})"


# -- one run, its figures -----------------------------------------------------------------------------

#: --paths: what each names, as the tables say it
PATHS = {"naive": "naive proxy, bare", "stack": "naive proxy, same stack", "app": "app"}


def one_run(streams: int, args: argparse.Namespace, path: str) -> dict[str, Any]:
    """One run of `streams` streams through `path` (a key of PATHS), its daphne started for it."""
    tokens = int(args.duration * args.tokens_per_second)
    upstream = StampingUpstream(tokens, args.tokens_per_second)
    load_before = os.getloadavg()
    env = {
        **workers_ai_env(upstream),
        "QUOTES_MAX_OPEN_STREAMS": str(streams),
        **dict(item.partition("=")[::2] for item in args.env),
    }
    try:
        with contextlib.ExitStack() as stack:
            if path == "naive":
                server = stack.enter_context(serve_naive(**env))
            else:
                # The app too with the stack's settings: no admission by its loop's lag.
                server = stack.enter_context(serve_app(stack=True, name=f"load-{path}", **env))
            log = Log(server.env["DATABASE_URL"]) if path == "app" else None
            spy = None
            if args.profile:
                spy_out = ARTIFACTS / f"load-{path}-{streams}.pyspy.txt"
                command = [str(Path(PYTHON).parent / "py-spy"), "record", "--pid", str(server.pid)]
                command += ["--format", "raw", "--rate", "50", "--duration", str(int(args.duration * 0.6))]
                command += ["--nonblocking", "--output", str(spy_out)]
                spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = server.naive_url if path == "stack" else server.stream_url
            run, plateau = asyncio.run(
                drive(url, server.pid, upstream, streams, args.duration, args.ramp_per_second)
            )
            # Each stream admitted is a generation with its row; each refused one is counted.
            rows = None
            if log is not None:
                admitted = sum(1 for r in run.results if r.status == 200)
                rows = log.settled(admitted, sum(1 for r in run.results if r.status in (429, 503)))
            if spy is not None:
                spy.wait(timeout=args.duration * 2)
    finally:
        upstream.close()
    return build_report(
        run,
        plateau,
        rows,
        path=PATHS[path],
        streams=streams,
        tokens=tokens,
        args=args,
        load_before=load_before,
    )


def build_report(
    run: Run,
    plateau: dict[str, Any],
    rows: dict[str, Any] | None,
    *,
    path: str,
    streams: int,
    tokens: int,
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    """The figures of one run. `rows` (bench.common.Log.settled) is None when the server keeps no
    log (the naive proxies). Per-stream figures (RSS, threads, CPU per token) count the admitted
    streams, not the refused ones."""
    results = run.results
    errors = [r for r in results if r.error]
    refused = [r for r in results if r.status == 503]
    admitted = max(1, streams - len(refused))
    delays_ms = sorted(d / 1e6 for d in run.delays_ns)
    plateau_samples = [s for s in run.samples if s["t"] >= plateau["ramp_s"]] or run.samples
    rss_plateau = sum(s["VmRSS"] for s in plateau_samples) / max(1, len(plateau_samples))
    threads = max((s["Threads"] for s in plateau_samples), default=0)
    refusal_ms = sorted(r.headers_s * 1000 for r in refused)
    return {
        "path": path,
        "streams": streams,
        "duration_s": args.duration,
        "tokens_per_stream": tokens,
        "completed": sum(r.done for r in results),
        "cancelled_by_client": sum(r.cancelled for r in results),
        "errors": len(errors) - len(refused),
        "refused_503": len(refused),
        "refused_with_retry_after": sum(1 for r in refused if r.retry_after),
        "refusal_ms": {
            "p50": round(percentile(refusal_ms, 50), 1) if refusal_ms else None,
            "p99": round(percentile(refusal_ms, 99), 1) if refusal_ms else None,
        },
        "error_samples": sorted({e.error[:160] for e in errors if e.status != 503})[:5],
        **(rows or {"lost_rows": None, "extra_rows": None}),
        "tokens_received": len(delays_ms),
        "tokens_expected": admitted * tokens,
        "added_delay_ms": {
            "p50": round(percentile(delays_ms, 50), 2),
            "p99": round(percentile(delays_ms, 99), 2),
            "max": round(delays_ms[-1], 2) if delays_ms else None,
        },
        "ttft_p50_ms": round(percentile(sorted(r.ttft_s for r in results if r.tokens), 50) * 1000, 1),
        "client_loop_lag_p99_ms": round(percentile(sorted(run.loop_lag_ms), 99), 2),
        "rss_idle_kib": plateau["idle"]["VmRSS"],
        "rss_plateau_kib": round(rss_plateau),
        "rss_per_stream_kib": round((rss_plateau - plateau["idle"]["VmRSS"]) / admitted, 1),
        "threads_idle": plateau["idle"]["Threads"],
        "threads_max": threads,
        "threads_per_stream": round((threads - plateau["idle"]["Threads"]) / admitted, 2),
        "daphne_fds_max": max((s["fds"] for s in plateau_samples), default=0),
        "daphne_cpu_pct": plateau["daphne_cpu_pct"],
        # over the tokens delivered during the plateau (not the nominal rate: a saturated server
        # delivers fewer)
        "cpu_per_token_us": plateau["cpu_us_per_token"],
        "plateau_tokens": plateau["plateau_tokens"],
        "client_cpu_pct": plateau["client_cpu_pct"],
        "upstream": plateau["upstream"],
        "ramp_s": plateau["ramp_s"],
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def summary_table(reports: list[dict[str, Any]]) -> str:
    def mean_cpu(path: str, streams: int) -> float:
        cpu = [r["cpu_per_token_us"] for r in reports if r["path"] == path and r["streams"] == streams]
        return sum(cpu) / len(cpu) if cpu else float("nan")

    rows = [
        [
            r["path"],
            r["streams"],
            f"{r['completed']}/{r['streams']}",
            r["refused_503"],
            r["errors"],
            "" if r["lost_rows"] is None else r["lost_rows"],
            "" if r["extra_rows"] is None else r["extra_rows"],
            r["added_delay_ms"]["p50"],
            r["added_delay_ms"]["p99"],
            f"{r['tokens_received'] / max(1, r['tokens_expected']):.3f}",
            r["daphne_cpu_pct"],
            r["cpu_per_token_us"],
            ratio(r["cpu_per_token_us"], mean_cpu(PATHS["naive"], r["streams"])),
            ratio(r["cpu_per_token_us"], mean_cpu(PATHS["stack"], r["streams"])),
            round(r["rss_per_stream_kib"]),
            r["threads_max"],
            r["threads_per_stream"],
            f"{r['upstream']['tick_lag_p99_ms']:.1f}",
            r["client_loop_lag_p99_ms"],
            "/".join(f"{x:.1f}" for x in r["load_average_before"]),
        ]
        for r in reports
    ]
    headers = ["path", "streams", "completed", "503", "errors", "lost rows", "extra rows"]
    headers += ["added p50 ms", "added p99 ms", "tokens recv/expected", "daphne CPU %", "CPU µs/token"]
    headers += ["CPU / bare naive's", "CPU / same-stack naive's", "RSS KiB/stream", "threads"]
    headers += ["threads/stream", "upstream tick lag p99 ms", "client lag p99 ms", "load avg before"]
    return table(headers, rows)


def capacity_lines(reports: list[dict[str, Any]], bound_ms: float) -> list[str]:
    """The largest stream count each path held at p99 <= bound_ms added per token, from this
    run's ladder (a lower bound: the next step up failed or was not run)."""
    lines = []
    for path in dict.fromkeys(r["path"] for r in reports):
        ok = [r for r in reports if r["path"] == path]
        held = [r["streams"] for r in ok if r["errors"] == 0 and r["added_delay_ms"]["p99"] <= bound_ms]
        failed = [r["streams"] for r in ok if r["errors"] or r["added_delay_ms"]["p99"] > bound_ms]
        lines.append(
            f"{path}: held {max(held) if held else 'none'} streams at p99 <= {bound_ms:g} ms"
            + (f" (missed at {min(failed)})" if failed else "")
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams (default 100)")
    parser.add_argument("--ladder", default="", help="comma-separated stream counts, one run each")
    parser.add_argument("--duration", type=float, default=20, help="seconds of tokens per stream")
    parser.add_argument("--tokens-per-second", type=float, default=50, help="per stream")
    parser.add_argument("--ramp-per-second", type=float, default=200, help="new streams per second")
    parser.add_argument(
        "--paths",
        default="naive,stack,app",
        help="what to serve, one run each per stream count, in this order: naive (the bare naive "
        "proxy), stack (the same-stack naive proxy), app",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the --paths this many times per stream count, the order rotating each time",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment for the app"
    )
    parser.add_argument("--bound-ms", type=float, default=50.0, help="the p99 bound for the capacity line")
    parser.add_argument("--profile", action="store_true", help="py-spy record daphne during the run")
    args = parse_args(parser, argv, smoke={"streams": 4, "duration": 1})
    counts = [int(x) for x in args.ladder.split(",")] if args.ladder else [args.streams]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"unknown paths {unknown}: {', '.join(PATHS)}")
    fd_limit = raise_fd_limit(4 * max(counts) + 256)
    print(machine(), f"; open files limit {fd_limit}", flush=True)
    reports = []
    for streams in counts:
        for i in range(args.repeat):
            for path in paths[i % len(paths) :] + paths[: i % len(paths)]:
                report = one_run(streams, args, path)
                reports.append(report)
                print(json.dumps(report, indent=1), flush=True)
    print(summary_table(reports))
    print("\n".join(capacity_lines(reports, args.bound_ms)))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / "load.json"
    out.write_text(json.dumps({"reports": reports}, indent=1) + "\n")
    print(f"raw: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
