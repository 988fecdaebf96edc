"""The answer cache through the full stack: time to the response headers, to the first token and
to `[DONE]` for a cache hit vs a miss, interleaved, on the app under daphne (workers-ai backend
against the tests' fake upstream in its own process, 32 tokens with the `p` padding, no delay).

    .venv/bin/python -m bench.cache

A miss asks for a topic never asked before (so it goes upstream and is then stored); a hit asks
for one of a few topics answered before. The cache is LocMem (the app's default), TTL 3600 s;
everything else as in bench/proxy_overhead.py. A hit is replayed with the app's pacing
(QUOTES_CACHE_REPLAY_PACING_MS, 5 ms between tokens by default), so its *time to [DONE]* is
paced on purpose; `--pacing 0` shows the unpaced replay.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import httpx

from bench.common import (
    ARTIFACTS,
    PERSONA,
    Upstream,
    machine,
    parse_args,
    percentile,
    table,
    workers_ai_env,
)
from bench.load import serve_daphne
from harness.workers_ai import Scenario

TOKENS = 32


def timed(client: httpx.Client, url: str, topic: str) -> dict[str, float | str]:
    started = time.perf_counter()
    with client.stream("POST", url, json={"persona": PERSONA, "topic": topic}) as response:
        headers_at = time.perf_counter()
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        cache_status = response.headers.get("x-quote-cache", "") or response.headers.get(
            "cf-aig-cache-status", ""
        )
        first = 0.0
        buffer = b""
        for chunk in response.iter_raw():
            buffer += chunk
            if not first and b'"response":"' in buffer and b'"response":""' not in buffer[:20]:
                first = time.perf_counter()
            if b"data: [DONE]" in buffer:
                break
            buffer = buffer[-64:]
        done = time.perf_counter()
    return {
        "ttfb": headers_at - started,
        "ttft": (first or done) - started,
        "done": done - started,
        "cache": cache_status,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150, help="per path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pacing", type=int, default=None, help="QUOTES_CACHE_REPLAY_PACING_MS")
    args = parse_args(parser, argv, smoke={"requests": 4, "warmup": 1})
    print(machine(), flush=True)
    scenario = Scenario(tokens=tuple(f" w{i}" for i in range(TOKENS)), usage=(24, TOKENS), padding=True)
    extra = {"QUOTES_CACHE_TTL": "3600"}
    if args.pacing is not None:
        extra["QUOTES_CACHE_REPLAY_PACING_MS"] = str(args.pacing)
    load_before = os.getloadavg()
    results: dict[str, list[dict[str, float | str]]] = {"miss": [], "hit": []}
    with (
        Upstream("fake", scenario) as upstream,
        serve_daphne(**workers_ai_env(upstream), **extra) as (_, url, _db),
    ):
        stream_url = f"{url}/api/quotes/stream"
        client = httpx.Client(timeout=30)
        warm = [f"warm topic {i}" for i in range(5)]
        for topic in warm:
            timed(client, stream_url, topic)
        requests_before = upstream.stats()["requests"]
        for index in range(args.warmup + args.requests):
            order = ("miss", "hit") if index % 2 else ("hit", "miss")
            for kind in order:
                topic = f"new topic {index}" if kind == "miss" else warm[index % len(warm)]
                result = timed(client, stream_url, topic)
                if index >= args.warmup:
                    results[kind].append(result)
        upstream_calls = upstream.stats()["requests"] - requests_before
    load_after = os.getloadavg()
    rows = []
    for kind in ("miss", "hit"):
        runs = results[kind]
        row: list[object] = [kind, ",".join(sorted({str(r["cache"]) for r in runs}))]
        for measure in ("ttfb", "ttft", "done"):
            values = sorted(float(r[measure]) for r in runs)
            row += [f"{percentile(values, 50) * 1000:.2f}", f"{percentile(values, 99) * 1000:.2f}"]
        rows.append(row)
    headers = ["path", "cache header", "TTFB p50 ms", "TTFB p99 ms", "TTFT p50 ms", "TTFT p99 ms"]
    headers += ["to [DONE] p50 ms", "to [DONE] p99 ms"]
    print(table(headers, rows))
    print(
        f"upstream calls during the measured+warm-up rounds: {upstream_calls} "
        f"(misses: {args.warmup + args.requests}); load average before {load_before}, after {load_after}"
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "cache.json").write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
