"""The embedded model (Gemma 3 270M on llama.cpp from the xllamacpp wheel): what the app costs
over the raw library, how the slots share the model, and what memory the model takes.

    .venv/bin/python -m bench.local_model            # about two minutes
    .venv/bin/python -m bench.local_model --help

Speed, one run, interleaved (the order rotates every round), the same topic for every path in a
round (topics change between rounds, so llama.cpp's prompt-prefix reuse helps each path alike):

- raw: an `xllamacpp.Server` of its own in this process, with the backend's parameters (slots,
  context, threads), called the library's own way: `handle_completions(body, callback)` on a
  thread, with the exact body the backend sends (`completion_body` with its lead: the app's
  frame, greedy sampling, the same stop strings);
- the app's `LocalBackend.stream()` in this process (its own server);
- the HTTP endpoint under daphne (AI_BACKEND=local, the persona set to temperature 0 and the
  same budget), read by an incremental SSE parser.

Parallel slots: the same backend, N requests at once (N = 1, 2, 4, distinct topics, greedy, so
each request writes the same tokens however it is scheduled), the aggregate tokens/s against the
same requests one at a time, interleaved round by round.

TTFT is from the call (or the request) to the first non-empty token; tokens/s is tokens over
the whole wait (call to last token). The rate after the first token, (tokens - 1) / (last -
first), is shown as a second ratio: over HTTP it is flattered when tokens arrive bunched.

Memory: RSS (/proc/<pid>/status) of the HTTP path's daphne idle, before the model loads, and
after its warm-up generations (RSS and threads per open stream on the Workers AI backend:
bench/load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from .common import (
    PERSONA,
    StreamTiming,
    machine,
    median,
    ms,
    parse_args,
    percentile,
    read_stream,
    rss_kib,
    serve_app,
    table,
)

TOPICS = (
    "hard honest work",
    "patience",
    "rivers",
    "getting lost",
    "silence",
    "cooking for friends",
    "old maps",
    "the first snow",
    "failure",
    "gardens",
    "laughter",
    "the sea at night",
)
SPEAKER = "Alan Watts"


@dataclass
class Series:
    name: str
    run: Callable[[str], StreamTiming]
    timings: list[StreamTiming] = field(default_factory=list)


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("DJANGO_DEBUG", "true")  # in-process, on the development settings
    os.environ.setdefault("AI_BACKEND", "local")
    os.environ.setdefault("DJANGO_LOG_LEVEL", "WARNING")
    import django

    django.setup()


def make_request(topic: str, max_tokens: int) -> Any:
    from quotes.backends.base import GenerationRequest, Message

    return GenerationRequest(
        model="gemma-3-270m",
        messages=(
            Message("system", "You are Alan Watts"),
            Message("user", f"Write 1 inspiring quote that is less than 50 words about {topic}"),
        ),
        speaker=SPEAKER,
        topic=topic,
        max_tokens=max_tokens,
        temperature=0.0,
        # No seed: like the personas, each slot then reuses the frame it has read (a seeded
        # request reads the whole frame again, ~0.5 s here, to stay bit-for-bit repeatable).
    )


def warm(series: Series, topics: Sequence[str]) -> None:
    for topic in topics:
        series.run(topic)


def raw_server(backend: Any) -> Any:
    """A bare xllamacpp.Server with the backend's own parameters."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(backend.path)
    params.n_parallel = backend.slots
    params.n_ctx = backend.n_ctx * backend.slots
    params.cpuparams.n_threads = backend.n_threads
    params.cpuparams_batch.n_threads = backend.n_threads
    params.cache_ram_mib = backend.prompt_cache_mib
    params.swa_full = True
    params.verbosity = -1
    params.hostnames = ["127.0.0.1"]
    params.port = 0
    params.api_keys = ["bench-" + os.urandom(16).hex()]
    return xllamacpp.Server(params)


def raw_runner(server: Any, max_tokens: int) -> Callable[[str], StreamTiming]:
    from quotes.backends.local import completion_body, quote_lead

    def run(topic: str) -> StreamTiming:
        request = make_request(topic, max_tokens)
        body = completion_body(request, quote_lead(request))
        timing = StreamTiming(started=time.perf_counter())

        def on_chunk(chunk: dict[str, Any]) -> bool:
            choices = chunk.get("choices") or [{}]
            if choices[0].get("text"):
                now = time.perf_counter()
                if not timing.tokens:
                    timing.first_token = now
                timing.last_token = now
                timing.tokens += 1
            return False

        server.handle_completions(body, on_chunk)
        timing.done = time.perf_counter()
        return timing

    return run


def backend_runner(
    backend: Any, loop: asyncio.AbstractEventLoop, max_tokens: int
) -> Callable[[str], StreamTiming]:
    from streaming import Done, Error, Token

    async def stream(topic: str) -> StreamTiming:
        timing = StreamTiming(started=time.perf_counter())
        async for event in backend.stream(make_request(topic, max_tokens)):
            if type(event) is Token and event.text:
                now = time.perf_counter()
                if not timing.tokens:
                    timing.first_token = now
                timing.last_token = now
                timing.tokens += 1
            elif type(event) is Error:
                raise RuntimeError(f"backend error: {event}")
            elif type(event) is Done:
                timing.done = time.perf_counter()
        return timing

    return lambda topic: loop.run_until_complete(stream(topic))


def http_runner(client: httpx.Client, url: str) -> Callable[[str], StreamTiming]:
    def run(topic: str) -> StreamTiming:
        import json

        body = json.dumps({"persona": PERSONA, "topic": topic}).encode()
        return read_stream(client, url, content=body, headers={"Content-Type": "application/json"})

    return run


def speed_rows(series: list[Series]) -> list[list[object]]:
    raw = series[0]
    raw_rate = median([t.end_to_end_tokens_per_s for t in raw.timings])
    raw_stream = median([t.tokens_per_s for t in raw.timings])
    raw_ttft = [t.ttft for t in raw.timings]
    rows: list[list[object]] = []
    for s in series:
        rate = median([t.end_to_end_tokens_per_s for t in s.timings])
        stream = median([t.tokens_per_s for t in s.timings])
        ttft = [t.ttft for t in s.timings]
        rows.append(
            [
                s.name,
                f"{rate:.1f}",
                f"{rate / raw_rate:.3f}",
                f"{stream / raw_stream:.3f}",
                ms(median(ttft)),
                ms(percentile(ttft, 99)),
                "" if s is raw else ms(median(ttft) - median(raw_ttft)),
                "" if s is raw else ms(percentile(ttft, 99) - percentile(raw_ttft, 99)),
                f"{median([t.tokens for t in s.timings]):.0f}",
            ]
        )
    return rows


SPEED_HEADERS = [
    "path",
    "tokens/s p50 (request to last token)",
    "ratio to raw",
    "ratio, after the first token",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "added p50 ms",
    "added p99 ms",
    "tokens p50",
]


def speed_section(args: argparse.Namespace) -> list[str]:
    from django.conf import settings

    from quotes.backends.local import LocalBackend, ensure_model_file

    ensure_model_file(settings.LOCAL_MODEL_PATH)
    loop = asyncio.new_event_loop()
    backend = LocalBackend.from_settings()
    sql = [
        f"UPDATE quotes_persona SET temperature = 0, max_tokens = {args.max_tokens} WHERE slug = '{PERSONA}'"
    ]
    memory: list[str] = []
    # Each path loads its own model (a few seconds each): the daphne starts, and later loads its
    # model, while this process loads its two.
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(1) as beside:
        loading = beside.submit(raw_server, backend)
        if not args.no_http:
            app = stack.enter_context(serve_app(migrate_sql=sql, AI_BACKEND="local"))
            client = stack.enter_context(httpx.Client(timeout=60, trust_env=False))
            idle = rss_kib(app.pid)
        series = [
            Series("raw xllamacpp (handle_completions)", raw_runner(loading.result(), args.max_tokens)),
            Series("LocalBackend.stream() in-process", backend_runner(backend, loop, args.max_tokens)),
        ]
        if not args.no_http:
            series.append(Series("HTTP endpoint under daphne", http_runner(client, app.stream_url)))
        # Warm up (the first call after loading is slow), the daphne's path beside the others.
        warming = [beside.submit(warm, s, TOPICS[: args.warmup]) for s in series[2:]]
        for s in series[:2]:
            warm(s, TOPICS[: args.warmup])
        for future in warming:
            future.result()
        if not args.no_http:
            memory = memory_section(idle, rss_kib(app.pid))
        print(f"speed: {args.rounds} interleaved generations per path ...", flush=True)
        for i in range(args.rounds):
            topic = TOPICS[i % len(TOPICS)]
            shift = i % len(series)
            for s in series[shift:] + series[:shift]:
                s.timings.append(s.run(topic))
    parallel = parallel_rows(backend, loop, args)
    loop.run_until_complete(backend.aclose())
    loop.close()
    # Raw and in-process send the same request (same topic, greedy): the same tokens expected.
    mismatched = sum(
        1 for i in range(args.rounds) if series[0].timings[i].tokens != series[1].timings[i].tokens
    )
    section = [
        f"## Embedded model speed: {args.rounds} generations per path, greedy, budget {args.max_tokens} "
        "tokens, stop at the closing quote",
        "",
        table(SPEED_HEADERS, speed_rows(series)),
        "",
        f"Rounds where raw and in-process emitted different token counts: {mismatched} of {args.rounds} "
        "(the HTTP path runs the seeded persona, with its own description and sampling).",
        "",
        f"## Parallel slots ({backend.slots} slots, budget {args.parallel_tokens} tokens, "
        f"{args.parallel_rounds} rounds per row, median)",
        "",
        table(PARALLEL_HEADERS, parallel),
        "",
        *memory,
    ]
    print("\n".join(section), flush=True)
    return section


PARALLEL_HEADERS = [
    "requests at once",
    "aggregate tokens/s",
    "one at a time, tokens/s",
    "ratio",
    "tokens/s per stream",
    "TTFT p50 ms",
]


def parallel_rows(
    backend: Any, loop: asyncio.AbstractEventLoop, args: argparse.Namespace
) -> list[list[object]]:
    """N requests at once on the backend's slots, against the same N one after the other."""
    from streaming import Done, Token

    async def one(topic: str) -> tuple[int, float, float]:
        request = make_request(topic, args.parallel_tokens)
        started = time.perf_counter()
        tokens, first = 0, 0.0
        async for event in backend.stream(request):
            if type(event) is Token:
                tokens += 1
                first = first or time.perf_counter() - started
            elif type(event) is Done:
                break
        return tokens, first, time.perf_counter() - started

    async def at_once(topics: list[str]) -> tuple[float, list[float], list[float]]:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(t) for t in topics))
        elapsed = time.perf_counter() - started
        return sum(r[0] for r in results) / elapsed, [r[0] / r[2] for r in results], [r[1] for r in results]

    async def in_turn(topics: list[str]) -> float:
        started = time.perf_counter()
        tokens = sum([(await one(t))[0] for t in topics])
        return tokens / (time.perf_counter() - started)

    rows: list[list[object]] = []
    print(f"parallel: 1, 2, 4 at once, {args.parallel_rounds} rounds ...", flush=True)
    for n in (1, 2, 4):
        aggregate, sequential, per_stream, ttfts = [], [], [], []
        for r in range(args.parallel_rounds):
            topics = [TOPICS[(r * n + i) % len(TOPICS)] for i in range(n)]
            # Interleaved: at once, then the same requests one at a time.
            total, rates, firsts = loop.run_until_complete(at_once(topics))
            aggregate.append(total)
            per_stream += rates
            ttfts += firsts
            sequential.append(loop.run_until_complete(in_turn(topics)))
        rows.append(
            [
                n,
                f"{median(aggregate):.1f}",
                f"{median(sequential):.1f}",
                f"{median(aggregate) / median(sequential):.2f}",
                f"{median(per_stream):.1f}",
                ms(median(ttfts)),
            ]
        )
    return rows


# -- memory -----------------------------------------------------------------------------------------


def memory_section(idle: dict[str, int], loaded: dict[str, int]) -> list[str]:
    rows = [
        ["daphne idle, model not loaded", idle["VmRSS"], idle["RssAnon"], idle["RssFile"], ""],
        [
            "after the model loads (the warm-up)",
            loaded["VmRSS"],
            loaded["RssAnon"],
            loaded["RssFile"],
            f"+{(loaded['VmRSS'] - idle['VmRSS']) / 1024:.0f} MiB",
        ],
    ]
    return [
        "## Memory (KiB, daphne process)",
        "",
        table(["state", "VmRSS", "RssAnon", "RssFile", "added"], rows),
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20, help="generations per path (interleaved)")
    parser.add_argument("--max-tokens", type=int, default=64, help="token budget per generation")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up generations per path")
    parser.add_argument("--no-http", action="store_true", help="skip the daphne HTTP path (and memory)")
    parser.add_argument("--parallel-tokens", type=int, default=64, help="token budget in the slots section")
    parser.add_argument("--parallel-rounds", type=int, default=5, help="rounds per row in the slots section")
    args = parse_args(
        parser,
        argv,
        smoke={
            "rounds": 2,
            "max_tokens": 4,
            "warmup": 1,
            "parallel_tokens": 4,
            "parallel_rounds": 1,
        },
    )
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    setup_django()
    print("\n\n" + "\n".join(speed_section(args)))


if __name__ == "__main__":
    main()
