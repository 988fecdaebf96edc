"""What the app adds to a Workers AI stream's first token, against the same upstream read directly
and against two naive proxies: bare, and on the app's own stack.

    .venv/bin/python -m bench.proxy_overhead            # about two minutes
    .venv/bin/python -m bench.proxy_overhead --help

One run, side by side, requests interleaved (the order rotates every round):

1. TTFT: the fake upstream (harness/workers_ai.py's KeepAliveUpstream, in its own process, 32
   padded tokens, no delay, connections kept open as Cloudflare's are) read directly (the very
   request the app sends, replayed from what the upstream recorded; once on one kept connection,
   once on a new connection per request: what a connection costs), and through:
   - the bare naive proxy (bench/naive: one async view re-streaming the upstream's bytes, no
     middleware, no database) under daphne with the app's flags;
   - the same-stack naive proxy: that view at /bench/naive under the app's own settings and
     middleware, served by the app's own daphne (bench/naive/stack_settings.py), so it pays
     what Django's stack pays;
   - the app, `POST /api/quotes/stream` on that same daphne (`"fresh": true`: no answer-cache
     lookup, every request goes upstream), and the same app answering from its cache (a hit).
   The naive proxies forward the app's own upstream request (its URL, checked against what the
   upstream recorded, its body, the same token). Every client keeps one connection to its
   server, and every path keeps its connections upstream: the table counts the upstream
   connections each opened per request (0.00: kept). The upstream's receive time splits the
   added time into "before the upstream has the request" and "after".
   The issue's bar: the app's added TTFT at most 1.3x the same-stack naive proxy's.
2. Tokens/s: one fast stream (200 padded tokens, no delay) per path, alternated.
3. Profile: py-spy (requirements-bench.txt) samples the app's daphne while the driver sends app
   requests (CPU only, no idle); skipped without py-spy or with --profile-seconds 0.
4. In-process: Django's ASGI handler driven directly (no server) in a subprocess: a stream to its
   first token (wall and CPU time) beside the upstream read directly, and a refusal (503
   over_capacity with Retry-After, the open-stream cap at 0) through Django's handler and
   middleware: what each refused stream of an overload costs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.workers_ai import Scenario

from .common import (
    ARTIFACTS,
    NAIVE_PATH,
    PERSONA,
    PYTHON,
    ROOT,
    AppServer,
    StreamTiming,
    Upstream,
    direct_ttft,
    machine,
    median,
    ms,
    parse_args,
    percentile,
    ratio,
    read_stream,
    serve_app,
    serve_naive,
    stream_in_process,
    table,
    workers_ai_env,
)

#: the app's requests: every one goes upstream (no answer-cache lookup); a hit asks without it
APP_BODY = json.dumps({"persona": PERSONA, "fresh": True}).encode()
HIT_BODY = json.dumps({"persona": PERSONA}).encode()
JSON = {"Content-Type": "application/json"}
#: request headers not replayed to the upstream (httpx sets its own)
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}
DIRECT, NEW_CONNECTION, BARE, STACK, APP, HIT = (
    "direct",
    "direct, a new connection each",
    "naive proxy, bare",
    "naive proxy, same stack",
    "app",
    "app, cache hit",
)


def ttft_scenario(tokens: int) -> Scenario:
    return Scenario(tokens=tuple(f" word{i}" for i in range(tokens)), usage=(24, tokens), padding=True)


@dataclass
class Reader:
    """One way of reading a stream, and what it measured."""

    name: str
    run: Callable[[], StreamTiming]
    upstream: Upstream | None = None
    timings: list[StreamTiming] = field(default_factory=list)
    #: seconds from sending the request to the upstream having read it
    to_upstream: list[float] = field(default_factory=list)
    connections: int = 0

    def once(self) -> StreamTiming:
        before = self.upstream.stats()["connections"] if self.upstream else 0
        timing = self.run()
        if self.upstream is not None:
            stats = self.upstream.stats()
            self.to_upstream.append(stats["last"]["received_at"] - timing.started)
            self.connections += stats["connections"] - before
        self.timings.append(timing)
        return timing

    def ttfts(self) -> list[float]:
        return [t.ttft for t in self.timings]

    def added(self, direct: Reader) -> float:
        return median(self.ttfts()) - median(direct.ttfts())


def interleave(paths: list[Reader], rounds: int) -> None:
    for i in range(rounds):
        shift = i % len(paths)
        for path in paths[shift:] + paths[:shift]:
            path.once()


def warm(paths: list[Reader], count: int) -> None:
    for path in paths:
        for _ in range(count):
            path.run()


def last_request(upstream: Upstream) -> tuple[str, dict[str, str], bytes]:
    """The path, headers and body of the request the upstream read last (the app's)."""
    last = upstream.stats()["last"]
    return last["path"], {k: v for k, v in last["headers"].items() if k not in HOP_HEADERS}, last["body"]


def direct_request(
    upstream: Upstream, client: httpx.Client, *, new_connection: bool = False
) -> Callable[[], StreamTiming]:
    """Replay the request the app last sent to `upstream`: same path, body and headers."""
    path, headers, body = last_request(upstream)
    if new_connection:
        headers["connection"] = "close"
    return lambda: read_stream(client, upstream.base_url + path, content=body, headers=headers)


def post(client: httpx.Client, url: str, body: bytes) -> Callable[[], StreamTiming]:
    return lambda: read_stream(client, url, content=body, headers=JSON)


def client() -> httpx.Client:
    return httpx.Client(timeout=30, trust_env=False)


# -- 1 + 2: TTFT and tokens/s ----------------------------------------------------------------

TTFT_HEADERS = [
    "path",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "added p50 ms",
    "added p99 ms",
    "added / bare naive's",
    "added / same-stack naive's",
    "to upstream p50 ms",
    "of which before upstream ms",
    "upstream connections/request",
]


def ttft_rows(direct: Reader, paths: list[Reader], requests: int) -> list[list[object]]:
    """TTFT per path, the time each adds to reading the upstream directly, that added time as a
    multiple of each naive proxy's, and the upstream connections each opened."""
    d = direct.ttfts()
    by_name = {p.name: p for p in paths}
    bare, stack = by_name[BARE].added(direct), by_name[STACK].added(direct)
    to_upstream = median(direct.to_upstream)
    connections = f"{direct.connections / requests:.2f}"
    rows: list[list[object]] = [
        [direct.name, ms(median(d)), ms(percentile(d, 99)), "", "", "", "", ms(to_upstream), "", connections]
    ]
    for path in paths:
        a, added = path.ttfts(), path.added(direct)
        rows.append(
            [
                path.name,
                ms(median(a)),
                ms(percentile(a, 99)),
                ms(added),
                ms(percentile(a, 99) - percentile(d, 99)),
                ratio(added, bare) if path.name != NEW_CONNECTION else "",
                ratio(added, stack) if path.name != NEW_CONNECTION else "",
                ms(median(path.to_upstream)) if path.to_upstream else "",
                ms(median(path.to_upstream) - to_upstream) if path.to_upstream else "",
                f"{path.connections / requests:.2f}" if path.upstream else "",
            ]
        )
    return rows


def rate_rows(direct: Reader, paths: list[Reader]) -> list[list[object]]:
    """Tokens/s once the first is in, and over the whole wait (a first token held back until the
    burst is in makes the first look fast); the first token's time, to set against the short
    stream's (a burst must not hold it back)."""
    rows: list[list[object]] = []
    base = median([t.tokens_per_s for t in direct.timings])
    whole_base = median([t.end_to_end_tokens_per_s for t in direct.timings])
    for path in [direct, *paths]:
        rate = median([t.tokens_per_s for t in path.timings])
        whole = median([t.end_to_end_tokens_per_s for t in path.timings])
        ttft = median([t.first_token - t.started for t in path.timings])
        cells = [f"{rate:,.0f}", ratio(rate, base), f"{whole:,.0f}", ratio(whole, whole_base), ms(ttft)]
        rows.append([path.name, *cells, path.timings[0].tokens])
    return rows


def ttft_sections(args: argparse.Namespace) -> list[str]:
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(Upstream(ttft_scenario(args.ttft_tokens)))
        env = {**workers_ai_env(upstream), "QUOTES_CACHE_TTL": "3600", **args.extra_env}
        app = stack.enter_context(serve_app(stack=True, **env))
        naive = stack.enter_context(serve_naive(**env))
        app_path = Reader(APP, post(stack.enter_context(client()), app.stream_url, APP_BODY), upstream)
        warm([app_path], args.warmup)  # and the upstream learns what the app sends
        path, _, body = last_request(upstream)
        expected = env["BENCH_UPSTREAM_URL"].removeprefix(upstream.base_url)
        if path != expected:
            raise RuntimeError(f"the app asks the upstream for {path}; the naive proxies for {expected}")
        direct = Reader(DIRECT, direct_request(upstream, stack.enter_context(client())), upstream)
        new = direct_request(upstream, stack.enter_context(client()), new_connection=True)
        paths = [
            Reader(NEW_CONNECTION, new, upstream),
            Reader(BARE, post(stack.enter_context(client()), naive.stream_url, body), upstream),
            Reader(STACK, post(stack.enter_context(client()), app.naive_url, body), upstream),
            app_path,
            Reader(HIT, post(stack.enter_context(client()), app.stream_url, HIT_BODY)),
        ]
        warm([direct, *paths[:3], paths[4]], args.warmup)
        print(f"TTFT: {args.requests} interleaved requests per path ...", flush=True)
        interleave([direct, *paths], args.requests)
        app_added, by_name = app_path.added(direct), {p.name: p for p in paths}
        report = [
            f"## TTFT, an upstream that keeps connections ({args.ttft_tokens} padded tokens), "
            f"{args.requests} requests per path",
            "",
            table(TTFT_HEADERS, ttft_rows(direct, paths, args.requests)),
            "",
            f"The app's added TTFT p50: {ratio(app_added, by_name[STACK].added(direct))}x the same-stack "
            f"naive proxy's (bar: 1.3x), {ratio(app_added, by_name[BARE].added(direct))}x the bare one's.",
            "",
        ]
        print("\n".join(report), flush=True)

        upstream.set_scenario(ttft_scenario(args.fast_tokens))
        rate_paths = [Reader(p.name, p.run) for p in [direct, *paths[1:4]]]  # a replay is paced: no hit
        warm(rate_paths, 1)
        print(f"tokens/s: {args.fast_streams} streams of {args.fast_tokens} tokens per path ...", flush=True)
        interleave(rate_paths, args.fast_streams)
        report += [
            f"## Tokens/s, one fast stream ({args.fast_tokens} padded tokens, no delay), "
            f"median of {args.fast_streams} per path",
            "",
            table(
                [
                    "path",
                    "tokens/s",
                    "ratio to direct",
                    "tokens/s, request to last",
                    "ratio to direct, request to last",
                    "TTFT p50 ms",
                    "tokens",
                ],
                rate_rows(rate_paths[0], rate_paths[1:]),
            ),
            "",
        ]
        print(report[-2], flush=True)
        upstream.set_scenario(ttft_scenario(args.ttft_tokens))
        if args.profile_seconds > 0:
            report += profile_section(app, args)
        report += in_process_section(upstream, app, args)
    return report


# -- 3: profile -------------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::\d+)?\)$")

#: leaf frames of a thread that is waiting, not running (py-spy's --nonblocking mode cannot
#: always tell, so they are dropped here by name)
IDLE_LEAVES = (
    "EpollSelector.select",
    "_worker (concurrent/futures/thread.py",
    "Condition.wait",
    "Thread._wait_for_tstate_lock",
)
#: frames worth an inclusive figure: the request path's steps
MARKERS = (
    "ASGIHandler.handle (",
    "ASGIHandler.send_response (",
    "stream_quote (",
    "admit (",
    "parse (",
    "start (",
    "stream_response (",
    "Generation.run (",
    "Generation.read (",
    "WorkersAIBackend.stream (",
    "RowWriter._write (",
    "SyncToAsync.__call__ (",
    "AsyncConnectionPool.handle_async_request (",
    "WebRequest.process (",
    "Request.write (",
)


def _bucket(frame: str) -> str:
    match = _FRAME.match(frame)
    path = match["file"] if match else frame
    if "site-packages/" in path:
        return path.split("site-packages/")[1].split("/")[0].removesuffix(".py")
    for package in ("quotes", "streaming"):
        if f"/{package}/" in path or path.startswith(f"{package}/"):
            return f"{package} (app)"
    if "/lib/python" in path or path.startswith("<frozen"):
        return "stdlib:" + Path(path).stem
    return path


def summarize_profile(raw: Path, requests: int, rate: int) -> str:
    """Where daphne's CPU went (idle waits dropped): by thread, by package of the innermost
    frame, and inclusive figures for the request path's steps."""
    threads: collections.Counter[str] = collections.Counter()
    packages: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count, frames = int(count_text), stack.split(";")
        if frames[-1].startswith(IDLE_LEAVES):
            idle += count
            continue
        total += count
        thread = frames[0].partition(": ")[2] if frames[0].startswith("thread") else "?"
        threads[re.sub(r"-\d+(_\d+)?$", "-N", thread)] += count
        packages[_bucket(frames[-1])] += count
        for marker in {m for m in MARKERS for frame in frames if frame.startswith(m)}:
            inclusive[marker.removesuffix(" (")] += count
    if not total:
        return "py-spy recorded no samples"
    cpu_ms = total / rate * 1000 / max(requests, 1)
    return "\n".join(
        [
            f"{total} busy samples ({idle} idle dropped) at {rate} Hz over {requests} requests: "
            f"~{cpu_ms:.2f} ms of daphne CPU per request (py-spy's own load included)",
            "",
            "By thread:",
            *(f"  {share * 100 / total:5.1f}%  {name}" for name, share in threads.most_common(6)),
            "By package of the innermost (running) frame:",
            *(f"  {share * 100 / total:5.1f}%  {name}" for name, share in packages.most_common(12)),
            "Inclusive, per request path step (a sample counts once per step on its stack):",
            *(f"  {share * 100 / total:5.1f}%  {name}" for name, share in inclusive.most_common()),
        ]
    )


def profile_section(app: AppServer, args: argparse.Namespace) -> list[str]:
    py_spy = shutil.which("py-spy", path=str(Path(PYTHON).parent)) or shutil.which("py-spy")
    if py_spy is None:
        return ["## py-spy profile of daphne: skipped (py-spy is not installed: requirements-bench.txt)", ""]
    print(f"profiling daphne with py-spy for {args.profile_seconds:g} s ...", flush=True)
    raw = ARTIFACTS / "proxy-daphne.pyspy.txt"
    command = [py_spy, "record", "--pid", str(app.pid), "--rate", str(args.profile_rate), "--format", "raw"]
    command += ["--duration", str(max(1, round(args.profile_seconds))), "--nonblocking", "--threads"]
    recorder = subprocess.Popen([*command, "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # let py-spy attach
    requests = 0
    with client() as c:
        run = post(c, app.stream_url, APP_BODY)
        deadline = time.monotonic() + args.profile_seconds
        while time.monotonic() < deadline:
            run()
            requests += 1
    _, errors = recorder.communicate(timeout=60)
    profile = (
        summarize_profile(raw, requests, args.profile_rate)
        if raw.exists()
        else f"py-spy wrote no profile: {errors.decode(errors='replace')[-500:]}"
    )
    print(profile, flush=True)
    return ["## py-spy profile of daphne on the TTFT path", "", "```", profile, "```", ""]


# -- 4: in-process ----------------------------------------------------------------------------------

WORKER = "from bench.proxy_overhead import in_process_worker as w; w()"
#: the whole quote's length (the issue's "40-token quote": a start costs more than its tokens)
QUOTE_TOKENS = 40


def in_process_worker() -> None:
    """Run in a subprocess with the app's environment and the same-stack settings: drive the ASGI
    app in-process (Django's handler, no server) interleaved with a direct read of the upstream;
    whole quotes of QUOTE_TOKENS tokens interleaved with the naive proxy's; then refusals at an
    open-stream cap of 0. Prints one JSON line."""
    import asyncio
    import os

    from config.asgi import application

    requests, warmup = int(os.environ["BENCH_REQUESTS"]), int(os.environ["BENCH_WARMUP"])
    direct_url, direct_body = os.environ["BENCH_DIRECT_URL"], os.environ["BENCH_DIRECT_BODY"].encode()
    direct_headers = json.loads(os.environ["BENCH_DIRECT_HEADERS"])

    async def run() -> dict[str, object]:
        from django.conf import settings

        out: dict[str, list[float]] = collections.defaultdict(list)
        async with httpx.AsyncClient(trust_env=False) as http:
            for n in range(warmup + requests):
                timing = await stream_in_process(application, APP_BODY)
                assert timing.status == 200 and timing.first_token, timing.status
                direct = await direct_ttft(http, direct_url, content=direct_body, headers=direct_headers)
                if n < warmup:
                    continue
                first = timing.first_token
                out["wall"].append(first - timing.started)
                out["cpu"].append(timing.first_token_cpu - timing.started_cpu)
                out["direct"].append(direct)
        # A whole quote, start to end, beside the same-stack naive proxy in this same process.
        for n in range(warmup + requests):
            app = await stream_in_process(application, APP_BODY)
            naive = await stream_in_process(application, direct_body, NAIVE_PATH)
            assert app.status == naive.status == 200 and app.ended and naive.ended
            if n >= warmup:
                out["quote"].append(app.ended - app.started)
                out["quote_cpu"].append(app.ended_cpu - app.started_cpu)
                out["naive_quote"].append(naive.ended - naive.started)
                out["naive_quote_cpu"].append(naive.ended_cpu - naive.started_cpu)
        settings.QUOTES_MAX_OPEN_STREAMS = 0  # every stream refused: over_capacity
        for n in range(warmup + requests):
            timing = await stream_in_process(application, APP_BODY)
            headers = sorted(k.decode().title() for k, _ in timing.raw_headers)
            assert timing.status == 503 and "Retry-After" in headers, (timing.status, headers)
            if n >= warmup:
                out["refusal_wall"].append(timing.ended - timing.started)
                out["refusal_cpu"].append(timing.ended_cpu - timing.started_cpu)
        return {**out, "refusal_headers": headers}

    print(json.dumps(asyncio.run(run())))


def in_process_section(upstream: Upstream, app: AppServer, args: argparse.Namespace) -> list[str]:
    print(f"in-process: {args.in_process_requests} streams and refusals through Django's handler ...")
    path, headers, body = last_request(upstream)
    upstream.set_scenario(ttft_scenario(QUOTE_TOKENS))
    env = {
        **app.env,
        "DJANGO_SETTINGS_MODULE": "bench.naive.stack_settings",
        "BENCH_REQUESTS": str(args.in_process_requests),
        "BENCH_WARMUP": str(args.warmup),
        "BENCH_DIRECT_URL": upstream.base_url + path,
        "BENCH_DIRECT_BODY": body.decode(),
        "BENCH_DIRECT_HEADERS": json.dumps(headers),
    }
    output = subprocess.run([PYTHON, "-c", WORKER], env=env, cwd=ROOT, capture_output=True, text=True)
    if output.returncode:
        raise RuntimeError(f"the in-process worker failed:\n{output.stderr[-3000:]}")
    data = json.loads(output.stdout.strip().splitlines()[-1])
    upstream.set_scenario(ttft_scenario(args.ttft_tokens))
    added = [a - d for a, d in zip(data["wall"], data["direct"], strict=True)]

    def row(name: str, wall: list[float], cpu: list[float] | None = None) -> list[str]:
        cells = [ms(percentile(wall, 50)), ms(percentile(wall, 90))]
        return [name, *cells, *([ms(percentile(cpu, 50)), ms(percentile(cpu, 90))] if cpu else ["", ""])]

    section = [
        f"## In-process: Django's ASGI handler, no server, {args.in_process_requests} requests each",
        "",
        table(
            ["request", "wall p50 ms", "wall p90 ms", "CPU p50 ms", "CPU p90 ms"],
            [
                row("direct read of the upstream (reference)", data["direct"]),
                row("stream: POST /api/quotes/stream to its first token", data["wall"], data["cpu"]),
                row("  added over the direct read", added),
                row("refusal: 503 over_capacity, whole answer", data["refusal_wall"], data["refusal_cpu"]),
                row(f"a whole {QUOTE_TOKENS}-token quote, start to end", data["quote"], data["quote_cpu"]),
                row("  the same-stack naive proxy's", data["naive_quote"], data["naive_quote_cpu"]),
            ],
        ),
        "",
        f"CPU of a whole {QUOTE_TOKENS}-token quote p50: "
        f"{ratio(median(data['quote_cpu']), median(data['naive_quote_cpu']))}x the same-stack naive proxy's (bar: 1.3x).",
        "",
        f"TTFT direct p50 {ms(median(data['direct']))} ms; through the ASGI app in-process p50 "
        f"{ms(median(data['wall']))} ms (added {ms(median(added))} ms). The refusal's headers: "
        + ", ".join(data["refusal_headers"]),
        "",
    ]
    print("\n".join(section), flush=True)
    return section


# -- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="TTFT requests per path (interleaved)")
    parser.add_argument("--warmup", type=int, default=30, help="warm-up requests per path")
    parser.add_argument("--ttft-tokens", type=int, default=32)
    parser.add_argument("--fast-tokens", type=int, default=200, help="tokens in the tokens/s stream")
    parser.add_argument("--fast-streams", type=int, default=30, help="tokens/s streams per path")
    parser.add_argument("--profile-seconds", type=float, default=8.0, help="0: no profile")
    parser.add_argument("--profile-rate", type=int, default=250)
    parser.add_argument("--in-process-requests", type=int, default=300, help="streams and refusals")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment for the app"
    )
    args = parse_args(
        parser,
        argv,
        smoke={
            "requests": 4,
            "warmup": 2,
            "fast_tokens": 20,
            "fast_streams": 2,
            "profile_seconds": 1,
            "in_process_requests": 3,
        },
    )
    args.extra_env = dict(item.partition("=")[::2] for item in args.env)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    report = ttft_sections(args)
    print("\n\n" + "\n".join(report))


if __name__ == "__main__":
    main()
