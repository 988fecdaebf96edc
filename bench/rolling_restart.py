"""A rolling restart under load (issues 14, 34): hold N streams through nginx in the production
layout and restart both daphne processes one after the other, as deploy/rolling-restart does.
Count the streams that arrived whole, those that were resumed, and those that were lost.

    .venv/bin/python -m bench.rolling_restart                      # 100 streams, drain 20 s
    .venv/bin/python -m bench.rolling_restart --drain-timeout 3    # cut streams: reconnect, resume

The layout is bench/scaleout_load.py's: two daphne processes started as
deploy/systemd/persona-quotes@.service starts them (`python -m quotes.ops.server`, which drains on
SIGTERM), nginx in front with deploy/nginx's proxy rules and its upstream block (least_conn,
the consistent hash on the csrftoken cookie, max_conns, keep-alive), one PostgreSQL, one Redis,
and the stamping upstream of bench/load.py at 50 tokens/s in `numbered` mode: token n is `n,`,
so every answer is the same known text and the client checks that it arrived whole, in order,
once. The daphnes' settings are the deployed ones (QUOTES_MAX_OPEN_STREAMS 100): one process
must hold every stream while the other restarts, so more clients than that (or than nginx's
max_conns) meet 503s, retried after their Retry-After.

Each of the N clients (a visitor: a loopback address and a csrftoken cookie of its own) loops:
POST /api/quotes/stream (a topic of its own, so nothing coalesces or comes from the cache), read
the SSE body to `data: [DONE]`, compare the text, next quote. Mid-run the restart runs exactly
like deploy/rolling-restart: SIGTERM to process 1, wait for it to exit (the drain), start it
again, wait until its /healthz answers 200, then the same for process 2.

Per quote, one outcome:

- whole: the whole text on its first connection;
- resumed: the stream ended with `event: reconnect` (a drain's deadline), the client asked again
  through nginx with `Last-Event-ID: <last id>` (after the event's `retry_ms`) and got exactly
  the rest;
- resume failed: after `event: reconnect`, the resume was refused (404 resume_unavailable: a
  generation lives in its process only, and this one ended with its drained process) or
  started a second generation (its text began again at `1,`);
- lost: anything else: an error event, a body cut without `event: reconnect`, a truncated,
  duplicated or wrong text, a 5xx other than a 503 before any header, a stream that hung.

A 503 before any header (a draining process, when nginx had no other process to try) is not an
outcome: the client waits its Retry-After and asks again, and the count of those is shown.

Log rows: nginx logs every attempt it made on a daphne (`$upstream_status`,
`$upstream_bytes_received`); each stream a daphne admitted must have its row in PostgreSQL
(a resume served reads the row of the generation it resumes), and each 503 a daphne answered
(a draining process's) its count in quotes_refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    ARTIFACTS,
    PERSONA,
    STREAM_PATH,
    Log,
    attempts_site,
    machine,
    nginx_attempts,
    parse_args,
    percentile,
    table,
)
from bench.load import (
    StampingUpstream,
    numbered_text,
    raise_fd_limit,
    request_bytes,
    response_texts,
    whole_events,
)
from bench.scaleout_load import StampingUpstreamStub, production_env, warm_up
from harness.daphne import migrate, start_daphne, wait_until_healthy
from harness.services import client_address, free_port, nginx, postgres, redis, stop_process, tail

# -- the layout ---------------------------------------------------------------------------------------

#: nginx tells the client which daphne answered.
UPSTREAM_HEADER = "\n        add_header X-Upstream-Addr $upstream_addr always;"


@dataclass
class Process:
    index: int
    port: int
    log: Path
    popen: subprocess.Popen[bytes]
    # the restart, in seconds since the run began
    sigterm_at: float = 0.0
    exited_at: float = 0.0
    healthy_at: float = 0.0
    exit_code: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


# -- the load client ------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One HTTP request the client made for a quote."""

    started: float
    ended: float = 0.0
    status: int = 0
    upstream: str = ""  # nginx's X-Upstream-Addr: the daphne(s) it tried
    resume: bool = False


@dataclass
class Quote:
    client: int
    seq: int
    started: float
    ended: float = 0.0
    outcome: str = ""  # whole, resumed, resume failed, lost
    detail: str = ""
    refusals: int = 0  # 503s before any header, retried after Retry-After
    reconnects: int = 0  # `event: reconnect` received
    attempts: list[Attempt] = field(default_factory=list)


class Cut(Exception):
    """The stream ended with `event: reconnect`."""

    def __init__(self, last_event_id: str | None, retry_ms: int) -> None:
        self.last_event_id = last_event_id
        self.retry_ms = retry_ms


class Lost(Exception):
    pass


class ResumeFailed(Exception):
    pass


ID_LINE = re.compile(rb"(?m)^id: ?(.*)$")


class Client:
    def __init__(self, host: str, port: int, tokens: int, tps: float, t0: float) -> None:
        self.host, self.port = host, port
        self.expected = numbered_text(tokens)
        # Nominal length, then room for a saturated machine and a drain; past it the quote hung.
        self.quote_timeout_s = tokens / tps * 4 + 90
        self.idle_timeout_s = 40.0  # > QUOTES_KEEPALIVE_S (15 s)
        self.t0 = t0
        self.quotes: list[Quote] = []
        self.stop = asyncio.Event()
        #: each client's csrftoken cookie, as its page set it
        self.cookies: dict[int, str] = collections.defaultdict(lambda: secrets.token_hex(16))

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run_client(self, index: int) -> None:
        seq = 0
        while not self.stop.is_set():
            seq += 1
            quote = Quote(client=index, seq=seq, started=self.now())
            self.quotes.append(quote)
            try:
                await asyncio.wait_for(self.one_quote(quote), self.quote_timeout_s)
            except TimeoutError:
                quote.outcome, quote.detail = "lost", f"no end after {self.quote_timeout_s:.0f} s"
            quote.ended = self.now()
            if quote.outcome != "whole" and quote.outcome != "resumed":
                await asyncio.sleep(0.5)  # as a page would, before its next quote

    async def one_quote(self, quote: Quote) -> None:
        """One quote of client `quote.client` (its loopback address, and its cookie: a resume
        goes where nginx's hash sends that cookie, as a visitor's does)."""
        body = json.dumps({"persona": PERSONA, "topic": f"rolling {quote.client} {quote.seq}"}).encode()
        text = bytearray()
        last_id: str | None = None
        while True:
            try:
                await self.request(quote, body, text, last_id)
            except Cut as cut:
                quote.reconnects += 1
                if cut.last_event_id is None:
                    quote.outcome, quote.detail = "lost", "reconnect event without last_event_id"
                    return
                last_id = cut.last_event_id
                await asyncio.sleep(cut.retry_ms / 1000)
                continue
            except ResumeFailed as exc:
                quote.outcome, quote.detail = "resume failed", str(exc)
                return
            except Lost as exc:
                quote.outcome, quote.detail = "lost", str(exc)
                return
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                quote.outcome, quote.detail = "lost", f"{type(exc).__name__}: {exc}"
                return
            if bytes(text) != self.expected.encode():
                quote.outcome = "lost"
                quote.detail = f"wrong text: {len(text)} bytes, expected {len(self.expected)}"
                return
            quote.outcome = "resumed" if quote.reconnects else "whole"
            return

    async def request(self, quote: Quote, body: bytes, text: bytearray, last_id: str | None) -> None:
        """One quote's requests until its body ends: 503s before any header are retried here;
        Cut when the stream ended with `event: reconnect`; returns at `data: [DONE]`."""
        resume = last_id is not None
        request = request_bytes(
            STREAM_PATH, body, f"Last-Event-ID: {last_id}\r\n" if resume else "", self.cookies[quote.client]
        )
        while True:
            attempt = Attempt(started=self.now(), resume=resume)
            quote.attempts.append(attempt)
            reader, writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20, local_addr=(client_address(quote.client), 0)
            )
            try:
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout_s)
                attempt.status = int(head.split(b" ", 2)[1])
                headers = _headers(head)
                attempt.upstream = headers.get("x-upstream-addr", "")
                if attempt.status == 503 and "retry-after" in headers:
                    quote.refusals += 1
                    attempt.ended = self.now()
                    writer.close()
                    await asyncio.sleep(float(headers["retry-after"]))
                    continue
                if attempt.status != 200:
                    detail = f"HTTP {attempt.status}: {(await reader.read(200))!r}"
                    if resume and attempt.status < 500:
                        raise ResumeFailed(detail)
                    raise Lost(detail)
                await self.read_body(reader, text, resume)
                return
            finally:
                attempt.ended = attempt.ended or self.now()
                writer.close()

    async def read_body(self, reader: asyncio.StreamReader, text: bytearray, resume: bool) -> None:
        buffer = b""
        first = True
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), self.idle_timeout_s)
            if not chunk:
                raise Lost(f"body cut without reconnect after {len(text)} bytes of text")
            complete, buffer = whole_events(buffer + chunk)
            if not complete:
                continue
            for token in response_texts(complete):
                if not token:
                    continue  # the usage event
                if first and resume and token == b"1," and text:
                    raise ResumeFailed("a second generation: the text began again")
                first = False
                text += token
            if b"event: error" in complete:
                at = complete.find(b"event: error")
                detail = complete[at : at + 200].decode(errors="replace")
                raise Lost(detail)
            if b"event: reconnect" in complete:
                at = complete.find(b"event: reconnect")
                data = complete[at:].split(b"data: ", 1)[1].split(b"\n", 1)[0]
                payload = json.loads(data)
                ids = ID_LINE.findall(complete[:at])
                last_id = payload.get("last_event_id") or (ids[-1].decode() if ids else None)
                raise Cut(last_id, int(payload.get("retry_ms", 1000)))
            if b"data: [DONE]" in complete:
                return


def _headers(head: bytes) -> dict[str, str]:
    headers = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return headers


# -- the rolling restart ------------------------------------------------------------------------------


async def rolling_restart(
    processes: list[Process], env: dict[str, str], t0: float, healthy_within_s: float
) -> None:
    """deploy/rolling-restart, one process after the other: SIGTERM (systemctl restart), wait for
    the exit (the drain), start again, wait until /healthz answers 200."""
    for process in processes:
        process.sigterm_at = time.monotonic() - t0
        print(f"{process.sigterm_at:6.1f} s  daphne {process.index}: SIGTERM", flush=True)
        process.popen.send_signal(signal.SIGTERM)
        try:
            process.exit_code = await asyncio.to_thread(process.popen.wait, 120)
        except subprocess.TimeoutExpired:
            process.popen.kill()  # systemd's TimeoutStopSec would
            process.exit_code = await asyncio.to_thread(process.popen.wait)
        process.exited_at = time.monotonic() - t0
        print(
            f"{process.exited_at:6.1f} s  daphne {process.index}: exited ({process.exit_code}) "
            f"after {process.exited_at - process.sigterm_at:.1f} s",
            flush=True,
        )
        process.popen = start_daphne(process.port, env, process.log)
        await asyncio.to_thread(
            wait_until_healthy, process.url, process.popen, process.log, timeout_s=healthy_within_s
        )
        process.healthy_at = time.monotonic() - t0
        print(
            f"{process.healthy_at:6.1f} s  daphne {process.index}: /healthz 200, "
            f"{process.healthy_at - process.exited_at:.1f} s after the start",
            flush=True,
        )


async def drive(
    proxy_url: str, processes: list[Process], env: dict[str, str], args: argparse.Namespace, tokens: int
) -> tuple[Client, float]:
    host, port = proxy_url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    print(f"   0.0 s  = {time.time():.3f} (epoch, as nginx's $msec)", flush=True)
    client = Client(host, int(port), tokens, args.tokens_per_second, t0)
    tasks = []
    # Spread over one quote's length by default: the clients then end and begin quotes all the
    # time, not in waves, so a restart meets streams at every stage.
    ramp_per_second = args.ramp_per_second or args.streams / args.quote_seconds
    for index in range(args.streams):
        await asyncio.sleep(max(0.0, index / ramp_per_second - client.now()))
        tasks.append(asyncio.create_task(client.run_client(index)))
    print(f"{client.now():6.1f} s  {args.streams} clients streaming", flush=True)
    await asyncio.sleep(args.restart_after)
    await rolling_restart(processes, env, t0, args.healthy_within)
    await asyncio.sleep(args.after)
    client.stop.set()  # each client ends its current quote, then stops
    print(f"{client.now():6.1f} s  clients finishing their current quote", flush=True)
    await asyncio.gather(*tasks)
    return client, client.now()


# -- the figures ---------------------------------------------------------------------------------------


def open_at(quotes: list[Quote], process: Process, at: float) -> int:
    """Streams that daphne `process` was sending when it got SIGTERM."""
    return sum(
        1
        for quote in quotes
        for attempt in quote.attempts
        if attempt.status == 200
        and attempt.upstream.split(",")[-1].strip() == process.address
        and attempt.started <= at < attempt.ended
    )


def report(
    client: Client,
    processes: list[Process],
    attempts: dict[str, Any],
    rows: dict[str, Any],
    args: argparse.Namespace,
    tokens: int,
    wall_s: float,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    quotes = client.quotes
    outcomes = Counter(q.outcome for q in quotes)
    durations = sorted(q.ended - q.started for q in quotes if q.outcome in ("whole", "resumed"))
    restart_from, restart_to = processes[0].sigterm_at, processes[-1].healthy_at
    during = [q for q in quotes if q.started < restart_to and q.ended > restart_from]
    return {
        "streams": args.streams,
        "tokens_per_quote": tokens,
        "tokens_per_second": args.tokens_per_second,
        "drain_timeout_s": args.drain_timeout,
        "quotes": len(quotes),
        "quotes_during_restart": len(during),
        "whole_during_restart": sum(1 for q in during if q.outcome == "whole"),
        "whole": outcomes["whole"],
        "resumed": outcomes["resumed"],
        "resume_failed": outcomes["resume failed"],
        "lost": outcomes["lost"],
        "refused_503_retried": sum(q.refusals for q in quotes),
        "quotes_with_a_503": sum(1 for q in quotes if q.refusals),
        "reconnect_events": sum(q.reconnects for q in quotes),
        "lost_samples": sorted({q.detail[:160] for q in quotes if q.outcome == "lost"})[:8],
        "resume_failed_samples": sorted({q.detail[:160] for q in quotes if q.outcome == "resume failed"})[:5],
        "quote_s": {
            "p50": round(percentile(durations, 50), 1),
            "p99": round(percentile(durations, 99), 1),
            "max": round(durations[-1], 1) if durations else None,
        },
        "processes": [
            {
                "daphne": p.index,
                "sigterm_at_s": round(p.sigterm_at, 1),
                "open_streams_at_sigterm": open_at(quotes, p, p.sigterm_at),
                "drain_and_exit_s": round(p.exited_at - p.sigterm_at, 1),
                "exit_code": p.exit_code,
                "start_to_healthy_s": round(p.healthy_at - p.exited_at, 1),
            }
            for p in processes
        ],
        "nginx": attempts,
        **rows,
        "wall_s": round(wall_s, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def print_report(r: dict[str, Any]) -> None:
    print(
        table(
            [
                "streams",
                "quotes (during the restart)",
                "whole (during)",
                "resumed",
                "resume failed",
                "lost",
                "503 retried (quotes)",
                "reconnect events",
                "quote s p50/p99/max",
                "rows / expected",
                "lost rows",
                "extra rows",
                "refusals counted / answered",
            ],
            [
                [
                    r["streams"],
                    f"{r['quotes']} ({r['quotes_during_restart']})",
                    f"{r['whole']} ({r['whole_during_restart']})",
                    r["resumed"],
                    r["resume_failed"],
                    r["lost"],
                    f"{r['refused_503_retried']} ({r['quotes_with_a_503']})",
                    r["reconnect_events"],
                    "/".join(str(r["quote_s"][k]) for k in ("p50", "p99", "max")),
                    f"{r['rows_total']} / {r['rows_expected']}",
                    r["lost_rows"],
                    r["extra_rows"],
                    f"{r['refusals_counted']} / {r['refusals_expected']}",
                ]
            ],
        )
    )
    print()
    print(
        table(
            [
                "daphne",
                "SIGTERM at s",
                "streams open then",
                "drain + exit s",
                "exit code",
                "start → /healthz 200 s",
            ],
            [
                [
                    p["daphne"],
                    p["sigterm_at_s"],
                    p["open_streams_at_sigterm"],
                    p["drain_and_exit_s"],
                    p["exit_code"],
                    p["start_to_healthy_s"],
                ]
                for p in r["processes"]
            ],
        )
    )
    print()
    n = r["nginx"]
    print(
        f"nginx: {n['requests']} stream requests, client statuses {n['client_statuses']}; attempts "
        f"answered by a daphne {n['answered_by_daphne']}, not answered {n['not_answered']}"
    )
    print(
        f"log rows by status: {r['rows']}; refusals counted {r['refusals_counted']} of the "
        f"{r['refusals_expected']} 503s the daphnes answered"
    )
    for sample in r["lost_samples"]:
        print(f"lost: {sample}")
    for sample in r["resume_failed_samples"]:
        print(f"resume failed: {sample}")
    print(f"load average before {r['load_average_before']}, after {r['load_average_after']}")
    print(f"lost: {r['lost']}  (resume failed: {r['resume_failed']}, lost rows: {r['lost_rows']})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams (clients)")
    parser.add_argument(
        "--quote-seconds", type=float, default=8.0, help="seconds of tokens per quote (at 50 tokens/s)"
    )
    parser.add_argument("--tokens-per-second", type=float, default=50)
    parser.add_argument(
        "--drain-timeout", type=float, default=20.0, help="QUOTES_DRAIN_TIMEOUT_S (deployed: 20)"
    )
    parser.add_argument(
        "--ramp-per-second",
        type=float,
        default=0,
        help="clients started per second (default: all within one quote's length)",
    )
    parser.add_argument("--restart-after", type=float, default=10, help="seconds of load before the restart")
    parser.add_argument("--after", type=float, default=10, help="seconds of load after the restart")
    parser.add_argument("--healthy-within", type=float, default=120, help="as deploy/rolling-restart")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the daphnes (deployed settings otherwise)",
    )
    args = parse_args(
        parser, argv, smoke={"streams": 4, "quote_seconds": 0.5, "restart_after": 0.5, "after": 0.5}
    )
    tokens = int(args.quote_seconds * args.tokens_per_second)
    print(machine(), f"; open files limit {raise_fd_limit(6 * args.streams + 512)}", flush=True)
    extra = [f"QUOTES_DRAIN_TIMEOUT_S={args.drain_timeout:g}", *args.env]
    with tempfile.TemporaryDirectory(prefix="bench-rolling-") as tmp:
        workdir = Path(tmp)
        with postgres(workdir) as pg, redis(workdir) as redis_url:
            migrate_env = production_env(pg.url, redis_url, StampingUpstreamStub(), extra)
            migrate(migrate_env)
            upstream = StampingUpstream(tokens, args.tokens_per_second, numbered=True)
            processes: list[Process] = []
            try:
                env = production_env(pg.url, redis_url, upstream, extra)
                for index in (1, 2):
                    port = free_port()
                    path = workdir / f"daphne-{index}.log"
                    processes.append(Process(index, port, path, start_daphne(port, env, path)))
                for process in processes:
                    wait_until_healthy(process.url, process.popen, process.log)
                    warm_up(process.url)
                log = Log(pg.url)  # after the warm-up quotes
                port = free_port()
                access_log = workdir / "nginx-attempts.log"
                site = attempts_site(port, [p.address for p in processes], access_log, server=UPSTREAM_HEADER)
                nginx_dir = workdir / "nginx-run"
                nginx_dir.mkdir()
                load_before = os.getloadavg()
                print(
                    f"{args.streams} streams of {tokens} tokens at {args.tokens_per_second:g} tokens/s "
                    f"({args.quote_seconds:g} s each), QUOTES_DRAIN_TIMEOUT_S={args.drain_timeout:g}, "
                    f"load average {load_before[0]:.2f}",
                    flush=True,
                )
                with nginx(
                    nginx_dir, site=site, port=port, worker_connections=4 * args.streams + 256
                ) as proxy:
                    client, wall_s = asyncio.run(drive(proxy.url, processes, env, args, tokens))
                    attempts = nginx_attempts(access_log)
                    rows = log.settled(attempts["generations"], attempts["refusals"])
                    nginx_errors = tail(nginx_dir / "nginx" / "error.log", 15)
                    # For a post-mortem: what nginx did and what the daphnes said.
                    kept = ARTIFACTS / "rolling-restart"
                    kept.mkdir(parents=True, exist_ok=True)
                    for source in [
                        access_log,
                        nginx_dir / "nginx" / "error.log",
                        *(p.log for p in processes),
                    ]:
                        (kept / source.name).write_bytes(source.read_bytes())
            finally:
                for process in processes:
                    stop_process(process.popen)
                upstream.close()
            result = report(client, processes, attempts, rows, args, tokens, wall_s, load_before)
            if result["lost"]:
                for process in processes:
                    print(f"--- daphne {process.index} log (tail)\n{tail(process.log, 15)}")
                print(f"--- nginx error log (tail)\n{nginx_errors}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / "rolling-restart.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1), flush=True)
    print()
    print_report(result)
    print(f"raw: {out}", file=sys.stderr)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
