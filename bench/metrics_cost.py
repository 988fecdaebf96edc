"""What recording one stream's metrics costs, in-process: every call a stream makes into
quotes/metrics.py (open, cache lookup, log row queued and written, finished), timed over many
iterations with metrics on and off, interleaved. Divided by a stream's tokens it bounds the
per-token cost far below what bench/load.py can resolve end to end.

    .venv/bin/python -m bench.metrics_cost [--iterations 20000] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import os
import time
from decimal import Decimal

from bench.common import machine, parse_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per stream, to express it per token")
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_args(parser, argv, smoke={"iterations": 200, "rounds": 1})

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("DJANGO_DEBUG", "true")  # in-process, on the development settings
    import django

    django.setup()
    from django.conf import settings

    from quotes import metrics
    from quotes.models import Generation

    row = Generation(
        persona_id=1,
        backend="workers-ai",
        model="@cf/meta/llama-3.1-8b-instruct",
        status="ok",
        cache_status="miss",
        prompt_tokens=24,
        completion_tokens=args.tokens,
        cost_usd=Decimal("0.00012345"),
        ttft_ms=180.0,
        duration_ms=20500.0,
    )

    def one_stream() -> None:
        metrics.stream_opened("api")
        metrics.cache_lookup(hit=False)
        metrics.attempt_started(backend="workers-ai", model=row.model, step=0, attempt=0)
        metrics.stream_finished(row, transport="api")
        with metrics.log_row_write():
            pass

    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for enabled in (False, True):
            settings.QUOTES_METRICS_ENABLED = enabled
            started = time.perf_counter()
            for _ in range(args.iterations):
                one_stream()
            results[enabled].append((time.perf_counter() - started) / args.iterations * 1e6)
    print(machine())
    for enabled in (False, True):
        best = min(results[enabled])
        print(
            f"metrics {'on ' if enabled else 'off'}: {best:.2f} µs per stream (best of {args.rounds}: "
            f"{', '.join(f'{v:.2f}' for v in results[enabled])}), {best / args.tokens * 1000:.1f} ns per token "
            f"at {args.tokens} tokens a stream"
        )
    added = min(results[True]) - min(results[False])
    print(f"recording adds {added:.2f} µs per stream = {added / args.tokens * 1000:.1f} ns per token")


if __name__ == "__main__":
    main()
