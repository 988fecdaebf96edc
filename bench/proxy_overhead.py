"""What the app adds to a Workers AI stream, measured against reading the same upstream directly.

    .venv/bin/python -m bench.proxy_overhead            # about a minute
    .venv/bin/python -m bench.proxy_overhead --help

One run, side by side, requests interleaved (the order rotates every round):

1. TTFT: the fake upstream (harness/workers_ai.py, in its own process, 32 padded tokens, no
   delay) read directly -- same URL, body and headers the app sends, replayed from what the fake
   recorded -- and through the app under daphne and under uvicorn (`POST /api/quotes/stream`).
   Fairness: the fake answers `Connection: close`, so the direct client opens one TCP connection
   per request; the client keeps one keep-alive connection to the app, which opens one TCP
   connection per request upstream. Each path pays exactly one loopback connect per request; the
   difference is the app's own work plus one extra loopback hop. The upstream's receive time
   splits the added time into "before the upstream has the request" and "after".
2. Tokens/s: one fast stream (200 padded tokens, no delay), direct vs app, alternated.
3. Connection reuse: an upstream that keeps connections alive (plain and TLS), read directly
   reusing one connection, directly with a fresh connection per request, and through the app
   (counting the connections the app opens upstream).
4. Profile: py-spy samples daphne while the driver sends app requests (CPU only, no idle).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.workers_ai import Scenario

from .common import (
    ARTIFACTS,
    PERSONA,
    PYTHON,
    ROOT,
    AppServer,
    Server,
    StreamTiming,
    Upstream,
    direct_ttft,
    machine,
    median,
    ms,
    parse_args,
    percentile,
    read_stream,
    self_signed_cert,
    serve_app,
    serve_naive,
    stream_in_process,
    table,
    trees,
    workers_ai_env,
)

APP_BODY = b'{"persona": "%s"}' % PERSONA.encode()
APP_HEADERS = {"Content-Type": "application/json"}
#: request headers not replayed to the upstream (httpx sets its own)
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}


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


def interleave(paths: list[Reader], rounds: int) -> None:
    for i in range(rounds):
        shift = i % len(paths)
        for path in paths[shift:] + paths[:shift]:
            path.once()


def direct_request(
    upstream: Upstream, client: httpx.Client, *, fresh: bool = False
) -> Callable[[], StreamTiming]:
    """Replay the request the app last sent to `upstream`: same path, body and headers."""
    last = upstream.stats()["last"]
    url = upstream.base_url + last["path"]
    headers = {k: v for k, v in last["headers"].items() if k not in HOP_HEADERS}
    if fresh:
        headers["connection"] = "close"
    body: bytes = last["body"]
    return lambda: read_stream(client, url, content=body, headers=headers)


def app_request(app: AppServer, client: httpx.Client) -> Callable[[], StreamTiming]:
    return lambda: read_stream(client, app.stream_url, content=APP_BODY, headers=APP_HEADERS)


def client(verify: ssl.SSLContext | bool = True) -> httpx.Client:
    return httpx.Client(timeout=30, trust_env=False, verify=verify)


# -- 1 + 2: TTFT and tokens/s against the fake ----------------------------------------------------


def ttft_rows(direct: Reader, paths: list[Reader], naive: Reader | None = None) -> list[list[object]]:
    """TTFT per path, the time each adds to reading the upstream directly, and that added time
    as a multiple of the naive proxy's (the goal: <= 1)."""
    d = direct.ttfts()
    base = median(naive.ttfts()) - median(d) if naive is not None else float("nan")
    rows: list[list[object]] = [
        [direct.name, ms(median(d)), ms(percentile(d, 99)), "", "", "", ms(median(direct.to_upstream)), ""]
    ]
    for path in paths:
        a = path.ttfts()
        added = median(a) - median(d)
        rows.append(
            [
                path.name,
                ms(median(a)),
                ms(percentile(a, 99)),
                ms(added),
                ms(percentile(a, 99) - percentile(d, 99)),
                f"{added / base:.2f}" if naive is not None and base > 0 else "",
                ms(median(path.to_upstream)) if path.to_upstream else "",
                ms(median(path.to_upstream) - median(direct.to_upstream)) if path.to_upstream else "",
            ]
        )
    return rows


TTFT_HEADERS = [
    "path",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "added p50 ms",
    "added p99 ms",
    "added p50 / naive's",
    "to upstream p50 ms",
    "of which before upstream ms",
]


def rate_rows(direct: Reader, apps: list[Reader]) -> list[list[object]]:
    base = median([t.tokens_per_s for t in direct.timings])
    rows: list[list[object]] = [[direct.name, f"{base:,.0f}", "1.00", direct.timings[0].tokens]]
    for path in apps:
        rate = median([t.tokens_per_s for t in path.timings])
        rows.append([path.name, f"{rate:,.0f}", f"{rate / base:.2f}", path.timings[0].tokens])
    return rows


# -- 4: profile -------------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::\d+)?\)$")


def _bucket(frame: str) -> str:
    match = _FRAME.match(frame)
    path = match["file"] if match else frame
    if "site-packages/" in path:
        return path.split("site-packages/")[1].split("/")[0].removesuffix(".py")
    if "/quotes/" in path or path.startswith("quotes/"):
        return "quotes (app)"
    if "/lib/python" in path or path.startswith("<frozen"):
        return "stdlib:" + Path(path).stem
    return path


#: leaf frames of a thread that is waiting, not running (py-spy's --nonblocking mode cannot
#: always tell, so they are dropped here by name)
IDLE_LEAVES = (
    "EpollSelector.select",
    "_worker (concurrent/futures/thread.py:81)",
    "Condition.wait",
    "Thread._wait_for_tstate_lock",
)
#: frames worth an inclusive figure: the request path's known costs
MARKERS = (
    "stream_quote (",
    "_find_persona (",
    "check_context_window (",
    "stream_generation (",
    "WorkersAIBackend.stream (",
    "StreamParser.feed (",
    "EventSource.aiter_sse (",
    "_sse_body (",
    "_save (",
    "SyncToAsync.__call__ (",
    "ThreadPoolExecutor.submit (",
    "Thread.start (",
    "SyncToAsync.thread_handler (",
    "BaseDatabaseWrapper.ensure_connection (",
    "BaseDatabaseWrapper.connect (",
    "close_old_connections (",
    "QuerySet.get (",
    "Model.save (",
    "AsyncConnectionPool.handle_async_request (",
    "AsyncIOBackend.connect_tcp (",
    "AsyncHTTP11Connection.handle_async_request (",
    "StaticFilesMiddleware.__call__ (",
    "ASGIHandler.handle (",
    "ASGIHandler.send_response (",
    "WebRequest.process (",
    "Request.write (",
)


def summarize_profile(raw: Path, requests: int, rate: int) -> str:
    """Where daphne's CPU went (idle waits dropped): by thread, by package of the innermost
    frame, and inclusive figures for the request path's known costs."""
    threads: collections.Counter[str] = collections.Counter()
    packages: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_LEAVES):
            idle += count
            continue
        total += count
        thread = frames[0].partition(": ")[2] if frames[0].startswith("thread") else "?"
        threads[re.sub(r"-\d+_\d+$", "-N_M", thread)] += count
        packages[_bucket(frames[-1])] += count
        seen = set()
        for frame in frames:
            for marker in MARKERS:
                if frame.startswith(marker) and marker not in seen:
                    seen.add(marker)
                    inclusive[marker.removesuffix(" (")] += count
    if not total:
        return "py-spy recorded no samples"
    cpu_ms = total / rate * 1000 / max(requests, 1)
    lines = [
        f"{total} busy samples ({idle} idle dropped) at {rate} Hz over {requests} requests: "
        f"~{cpu_ms:.2f} ms of daphne CPU per request (py-spy's own load included)",
        "",
        "By thread (ThreadPoolExecutor-N_M: asgiref's per-request sync_to_async threads):",
        *(f"  {share * 100 / total:5.1f}%  {name}" for name, share in threads.most_common(6)),
        "By package of the innermost (running) frame:",
        *(f"  {share * 100 / total:5.1f}%  {name}" for name, share in packages.most_common(12)),
        "Inclusive, per request path step (a sample counts once per step on its stack):",
        *(f"  {share * 100 / total:5.1f}%  {name}" for name, share in inclusive.most_common()),
    ]
    return "\n".join(lines)


def _drive(app: AppServer, seconds: float) -> int:
    requests = 0
    with client() as c:
        run = app_request(app, c)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and requests < 20_000:
            run()
            requests += 1
    return requests


def profile_daphne(app: AppServer, seconds: float, rate: int) -> str:
    """Two windows: raw stacks (summarised here), then a flame graph for people."""
    py_spy = Path(PYTHON).with_name("py-spy")
    raw = ARTIFACTS / "proxy-daphne.pyspy.txt"
    svg = ARTIFACTS / "proxy-daphne.svg"
    requests = 0
    for output, extra in ((raw, ["--format", "raw"]), (svg, [])):
        command = [str(py_spy), "record", "--pid", str(app.pid), "--rate", str(rate)]
        command += ["--duration", str(int(seconds)), "--nonblocking", "--threads", *extra, "-o", str(output)]
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # let py-spy attach
        count = _drive(app, seconds)
        requests = requests or count
        recorder.wait(60)
    if not raw.exists():
        return "py-spy did not write a profile"
    return f"flame graph: {svg}\n" + summarize_profile(raw, requests, rate)


# -- 5: attribution: the sync_to_async hops on the TTFT path --------------------------------------

ATTRIBUTION_WORKER = "from bench.proxy_overhead import attribution_worker as w; w()"


def attribution_worker() -> None:
    """Run in a subprocess with the app's environment: drive the ASGI app in-process (Django's
    handler, no server) and a direct httpx read of the same upstream, interleaved, and time every
    `sync_to_async` call (each is a hop to the request's thread and back) made before the first
    token. Prints one JSON line."""
    import asyncio
    import json
    import os
    import sys

    from asgiref.sync import SyncToAsync

    from config.asgi import application

    hops: list[tuple[str, float, float]] = []
    original = SyncToAsync.__call__

    async def timed(self: SyncToAsync[..., object], *args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return await original(self, *args, **kwargs)
        finally:
            func = getattr(self, "func", None)
            name = getattr(func, "__qualname__", None) or type(func).__name__
            hops.append((name, started, time.perf_counter() - started))

    SyncToAsync.__call__ = timed  # type: ignore[method-assign,assignment]
    rounds = int(sys.argv[-1]) if sys.argv[-1].isdigit() else 150
    direct_url, direct_body = os.environ["BENCH_DIRECT_URL"], os.environ["BENCH_DIRECT_BODY"].encode()
    direct_headers = json.loads(os.environ["BENCH_DIRECT_HEADERS"])

    async def through_app() -> tuple[float, float, float]:
        """TTFT through the ASGI app, the time before it spent in sync_to_async hops, and the
        first token's time stamp."""
        hops.clear()
        timing = await stream_in_process(application, APP_BODY)
        first = timing.first_token
        in_hops = sum(d for _, t, d in hops if t < first)
        return first - timing.started, in_hops, first

    async def direct(client: httpx.AsyncClient) -> float:
        return await direct_ttft(client, direct_url, content=direct_body, headers=direct_headers)

    async def run() -> dict[str, object]:
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(20):
                await through_app()
                await direct(client)
            app_ttft, app_hops, direct_ttft = [], [], []
            per_name: collections.Counter[str] = collections.Counter()
            per_name_s: collections.defaultdict[str, float] = collections.defaultdict(float)
            for _ in range(rounds):
                ttft, in_hops, first = await through_app()
                app_ttft.append(ttft)
                app_hops.append(in_hops)
                for name, t, d in hops:
                    if t < first:
                        per_name[name] += 1
                        per_name_s[name] += d
                direct_ttft.append(await direct(client))
            return {
                "app_ttft": app_ttft,
                "app_hops": app_hops,
                "direct_ttft": direct_ttft,
                "hops": {n: [c / rounds, per_name_s[n] / rounds] for n, c in per_name.most_common()},
            }

    print(json.dumps(asyncio.run(run())))


def attribution(fake: Upstream, app: AppServer, rounds: int) -> list[str]:
    import json

    last = fake.stats()["last"]
    env = {
        **app.env,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "BENCH_DIRECT_URL": fake.base_url + last["path"],
        "BENCH_DIRECT_BODY": last["body"].decode(),
        "BENCH_DIRECT_HEADERS": json.dumps(
            {k: v for k, v in last["headers"].items() if k not in HOP_HEADERS}
        ),
    }
    output = subprocess.run(
        [PYTHON, "-c", ATTRIBUTION_WORKER, str(rounds)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if output.returncode:
        raise RuntimeError(f"the attribution worker failed:\n{output.stderr[-3000:]}")
    stdout = output.stdout
    data = json.loads(stdout.strip().splitlines()[-1])
    app_ttft, hops_s, direct_ttft = data["app_ttft"], data["app_hops"], data["direct_ttft"]
    added = median(app_ttft) - median(direct_ttft)
    rows = [
        [name, f"{count:.1f}", f"{seconds * 1000:.3f}"] for name, (count, seconds) in data["hops"].items()
    ]
    return [
        f"## Where the added TTFT goes: Django's handler in-process (no server), {rounds} requests",
        "",
        f"TTFT direct p50 {ms(median(direct_ttft))} ms; through the ASGI app in-process "
        f"p50 {ms(median(app_ttft))} ms (added {ms(added)} ms). Time before the first token spent "
        f"waiting on sync_to_async hops: p50 {ms(median(hops_s))} ms per request "
        f"({median(hops_s) / added * 100 if added > 0 else 0:.0f}% of the added time).",
        "",
        table(["sync_to_async target before the first token", "calls/request", "ms/request"], rows),
        "",
    ]


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
    parser.add_argument("--no-uvicorn", action="store_true")
    parser.add_argument("--no-reuse", action="store_true", help="skip the connection-reuse part")
    parser.add_argument("--profile-seconds", type=float, default=8.0, help="0: no profile")
    parser.add_argument("--attribution-requests", type=int, default=150, help="0: skip")
    parser.add_argument("--profile-rate", type=int, default=250)
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another source tree of the app, served under daphne as one more path interleaved with "
        "the others (say, this tree with one change reverted); repeatable",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment for every app"
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
            "attribution_requests": 3,
        },
    )
    other_trees = trees(args.tree)
    extra_env = dict(item.partition("=")[::2] for item in args.env)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    servers: list[Server] = ["daphne"] if args.no_uvicorn else ["daphne", "uvicorn"]
    report: list[str] = []

    with Upstream("fake", ttft_scenario(args.ttft_tokens)) as fake, contextlib.ExitStack() as stack:
        app_env = {**workers_ai_env(fake), **extra_env}
        apps = [stack.enter_context(serve_app(s, **app_env)) for s in servers]
        tree_apps = {
            name: stack.enter_context(serve_app("daphne", root=root, name=name, **app_env))
            for name, root in other_trees.items()
        }
        clients = [stack.enter_context(client()) for _ in [*apps, *tree_apps]]
        names = [f"app under {app.server}" for app in apps] + [f"{name} under daphne" for name in tree_apps]
        app_paths = [
            Reader(name, app_request(app, c), fake)
            for name, app, c in zip(names, [*apps, *tree_apps.values()], clients, strict=True)
        ]
        for path in app_paths:  # warm up, and teach the fake what the app sends
            for _ in range(args.warmup):
                path.run()
        # The baseline: the naive Django proxy forwarding the very request the app sends.
        last = fake.stats()["last"]
        naive_app = stack.enter_context(
            serve_naive(
                fake.base_url + last["path"],
                {k: v for k, v in last["headers"].items() if k not in HOP_HEADERS},
            )
        )
        naive_client = stack.enter_context(client())
        naive = Reader(
            "naive Django proxy under daphne",
            lambda: read_stream(naive_client, naive_app.stream_url, content=last["body"], headers={}),
            fake,
        )
        # The answer cache: the same app with its cache on, asked the same question again.
        hit_app = stack.enter_context(
            serve_app(
                "daphne", **{**app_env, "QUOTES_CACHE_TTL": "3600", "QUOTES_CACHE_REPLAY_PACING_MS": "0"}
            )
        )
        hit = Reader("app under daphne, cache hit", app_request(hit_app, stack.enter_context(client())))
        direct_client = stack.enter_context(client())
        direct = Reader("direct (fake upstream)", direct_request(fake, direct_client), fake)
        for path in (naive, hit, direct):
            for _ in range(args.warmup):
                path.run()
        app_paths.insert(0, naive)
        app_paths.append(hit)

        print(f"TTFT: {args.requests} interleaved requests per path ...", flush=True)
        interleave([direct, *app_paths], args.requests)
        reused = {p.name: len({t.local_addr for t in p.timings}) for p in app_paths}
        report += [
            f"## TTFT, fake upstream ({args.ttft_tokens} padded tokens, Connection: close), "
            f"{args.requests} requests per path",
            "",
            table(TTFT_HEADERS, ttft_rows(direct, app_paths, naive)),
            "",
            f"client->server connections used over the run: {reused} (1 = keep-alive held); "
            f"upstream connections per request: direct {direct.connections / args.requests:.2f}, "
            + ", ".join(f"{p.name} {p.connections / args.requests:.2f}" for p in app_paths if p.upstream),
            "",
        ]
        print("\n".join(report[-5:]), flush=True)
        app_paths.remove(hit)  # a replay is paced on purpose: no tokens/s figure for it

        fake.set_scenario(ttft_scenario(args.fast_tokens))
        rate_direct = Reader("direct (fake upstream)", direct.run)
        rate_apps = [Reader(p.name, p.run) for p in app_paths]
        for path in [rate_direct, *rate_apps]:
            path.run()
        print(f"tokens/s: {args.fast_streams} streams of {args.fast_tokens} tokens per path ...", flush=True)
        interleave([rate_direct, *rate_apps], args.fast_streams)
        report += [
            f"## Tokens/s, one fast stream ({args.fast_tokens} padded tokens, no delay), "
            f"median of {args.fast_streams} per path",
            "",
            table(["path", "tokens/s", "ratio to direct", "tokens"], rate_rows(rate_direct, rate_apps)),
            "",
        ]
        print(report[-2], flush=True)

        if args.profile_seconds > 0:
            fake.set_scenario(ttft_scenario(args.ttft_tokens))
            print(f"profiling daphne with py-spy for {args.profile_seconds:.0f} s ...", flush=True)
            profile = profile_daphne(apps[0], args.profile_seconds, args.profile_rate)
            report += ["## py-spy profile of daphne on the TTFT path", "", "```", profile, "```", ""]
            print(profile, flush=True)
        if args.attribution_requests:
            fake.set_scenario(ttft_scenario(args.ttft_tokens))
            print("attributing the added TTFT (in-process ASGI) ...", flush=True)
            section = attribution(fake, apps[0], args.attribution_requests)
            report += section
            print("\n".join(section), flush=True)

    if not args.no_reuse:
        report += reuse_section(args)

    print("\n\n" + "\n".join(report))


def reuse_section(args: argparse.Namespace) -> list[str]:
    scenario = ttft_scenario(args.ttft_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp, contextlib.ExitStack() as stack:
        tls = self_signed_cert(Path(tmp))
        plain = stack.enter_context(Upstream("keepalive", scenario))
        app = stack.enter_context(serve_app("daphne", **workers_ai_env(plain)))
        app_path = Reader(
            "app under daphne -> keep-alive upstream", app_request(app, stack.enter_context(client())), plain
        )
        for _ in range(args.warmup):
            app_path.run()
        reuse = Reader(
            "direct, reusing one connection", direct_request(plain, stack.enter_context(client())), plain
        )
        fresh = Reader(
            "direct, new connection each",
            direct_request(plain, stack.enter_context(client()), fresh=True),
            plain,
        )
        paths = [reuse, fresh, app_path]
        if tls is not None:
            secure = stack.enter_context(Upstream("keepalive-tls", scenario, tls))
            secure.set_scenario(scenario)
            context = ssl.create_default_context(cafile=tls[0])
            # Teach the TLS upstream the app's request by replaying the plain one once.
            last = plain.stats()["last"]
            with client(context) as c:
                headers = {k: v for k, v in last["headers"].items() if k not in HOP_HEADERS}
                read_stream(c, secure.base_url + last["path"], content=last["body"], headers=headers)
            paths += [
                Reader(
                    "direct TLS, reusing one connection",
                    direct_request(secure, stack.enter_context(client(context))),
                    secure,
                ),
                Reader(
                    "direct TLS, new connection each",
                    direct_request(secure, stack.enter_context(client(context)), fresh=True),
                    secure,
                ),
            ]
        for path in paths:
            for _ in range(args.warmup):
                path.run()
            path.timings.clear()
            path.to_upstream.clear()
            path.connections = 0
        print(f"connection reuse: {args.requests} interleaved requests per path ...", flush=True)
        interleave(paths, args.requests)
    rows = [
        [
            p.name,
            ms(median(p.ttfts())),
            ms(percentile(p.ttfts(), 99)),
            ms(median(p.ttfts()) - median(reuse.ttfts())),
            f"{p.connections / args.requests:.2f}",
        ]
        for p in paths
    ]
    section = [
        f"## Connection reuse: an upstream that allows keep-alive, {args.requests} requests per path",
        "",
        table(
            ["path", "TTFT p50 ms", "TTFT p99 ms", "vs reusing p50 ms", "upstream connections/request"], rows
        ),
        "",
    ]
    print(section[2], flush=True)
    return section


if __name__ == "__main__":
    main()
