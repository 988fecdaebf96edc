"""What one stream request and one over-capacity refusal cost inside the app, in-process.

    .venv/bin/python -m bench.request_cost                  # about 20 s
    .venv/bin/python -m bench.request_cost --profile        # + a pyinstrument profile of each

Django's ASGI handler (config.asgi.application, the app's own middleware and views) is driven
in-process, with no server, against the fake Workers AI upstream in a process of its own:

1. stream: `POST /api/quotes/stream` up to its first token (wall time, and the process's CPU time
   over that window), the request read directly from the fake interleaved as a reference;
2. refusal: the same request while the process is at its open-stream limit (a billion streams
   counted open): the 503 with Retry-After, its wall and CPU time. This is what each of
   the 800 refused streams of `bench/scaleout_load.py --streams 1000` costs the admitted ones.

CPU time is `time.process_time()` (every thread of the process), so a loaded machine moves it
far less than wall time. Figures are per request, p50 and p90.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from harness.daphne import migrate

from .common import (
    ARTIFACTS,
    PERSONA,
    PYTHON,
    ROOT,
    Upstream,
    app_env,
    direct_ttft,
    machine,
    parse_args,
    percentile,
    stream_in_process,
    table,
    workers_ai_env,
)
from .proxy_overhead import APP_BODY, HOP_HEADERS, ttft_scenario

WORKER = "from bench.request_cost import worker as w; w()"


def worker() -> None:
    """In the subprocess, with the app's environment: print one JSON line of timings."""
    import asyncio

    import django
    import httpx

    django.setup()
    from config.asgi import application
    from quotes.ai.gateway import admission

    requests = int(os.environ["BENCH_REQUESTS"])
    profile = os.environ.get("BENCH_PROFILE") == "1"
    direct_url, direct_body = os.environ["BENCH_DIRECT_URL"], os.environ["BENCH_DIRECT_BODY"].encode()
    direct_headers = json.loads(os.environ["BENCH_DIRECT_HEADERS"])

    async def through_app() -> tuple[float, float, int, dict[str, str]]:
        """(wall s, CPU s) to the first token (or to the whole answer when it is not a
        stream), the status and the response headers."""
        timing = await stream_in_process(application, APP_BODY)
        first, first_cpu = timing.first_token, timing.first_token_cpu
        if not first:
            first, first_cpu = timing.ended, timing.ended_cpu
        headers = {k.decode(): v.decode() for k, v in timing.raw_headers}
        return first - timing.started, first_cpu - timing.started_cpu, timing.status, headers

    async def direct(client: httpx.AsyncClient) -> float:
        return await direct_ttft(client, direct_url, content=direct_body, headers=direct_headers)

    async def streams(client: httpx.AsyncClient) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"wall": [], "cpu": [], "direct": []}
        for _ in range(requests):
            wall, cpu, status, _ = await through_app()
            assert status == 200, status
            out["wall"].append(wall)
            out["cpu"].append(cpu)
            out["direct"].append(await direct(client))
        return out

    async def refusals() -> dict[str, object]:
        out: dict[str, object] = {"wall": [], "cpu": []}
        cap = admission.open_streams.count
        admission.open_streams.count = 10**9  # at the cap, whatever it is
        try:
            for _ in range(requests):
                wall, cpu, status, headers = await through_app()
                assert status == 503 and "Retry-After" in headers, (status, headers)
                out["wall"].append(wall)  # type: ignore[attr-defined]
                out["cpu"].append(cpu)  # type: ignore[attr-defined]
            out["headers"] = sorted(headers)
        finally:
            admission.open_streams.count = cap
        return out

    async def run() -> dict[str, object]:
        if requests == 0:  # the probe: one request, so the fake records what the app sends
            await through_app()
            return {}
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(30):  # warm up: the persona cache, the connection pools, the imports
                await through_app()
                await direct(client)
            result: dict[str, object] = {"stream": await streams(client), "refusal": await refusals()}
            if profile:
                from pyinstrument import Profiler

                for name, job in (("stream", lambda: streams(client)), ("refusal", refusals)):
                    profiler = Profiler(interval=0.0002, async_mode="disabled")
                    profiler.start()
                    await job()
                    profiler.stop()
                    path = ARTIFACTS / f"request-cost-{name}.txt"
                    path.write_text(
                        profiler.output_text(
                            unicode=False, show_all=os.environ.get("BENCH_PROFILE_ALL") == "1"
                        )
                    )
                    result[f"{name}_profile"] = str(path)
            return result

    print(json.dumps(asyncio.run(run())))


def _row(name: str, wall: list[float], cpu: list[float]) -> list[str]:
    def fmt(values: list[float], q: float) -> str:
        return f"{percentile(values, q) * 1000:.3f}"

    return [name, fmt(wall, 50), fmt(wall, 90), fmt(cpu, 50), fmt(cpu, 90)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="requests per kind")
    parser.add_argument("--profile", action="store_true", help="also profile each kind (pyinstrument)")
    parser.add_argument("--settings", default="config.settings", help="DJANGO_SETTINGS_MODULE (experiments)")
    args = parse_args(parser, argv, smoke={"requests": 5})
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    with (
        Upstream("fake", ttft_scenario(32)) as fake,
        tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp,
    ):
        env = app_env(Path(tmp) / "db.sqlite3", **workers_ai_env(fake))
        migrate(env)
        # One request through the app teaches the fake what the app sends (the direct reference).
        probe = subprocess.run(
            [PYTHON, "-c", WORKER],
            env={**env, "DJANGO_SETTINGS_MODULE": "config.settings", "BENCH_REQUESTS": "0",
                 "BENCH_DIRECT_URL": fake.base_url, "BENCH_DIRECT_BODY": "", "BENCH_DIRECT_HEADERS": "{}"},
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        last = fake.stats()["last"]
        if not last:
            raise RuntimeError(f"the app never reached the fake:\n{probe.stderr[-3000:]}")
        output = subprocess.run(
            [PYTHON, "-c", WORKER],
            env={
                **env,
                "DJANGO_SETTINGS_MODULE": args.settings,
                "BENCH_REQUESTS": str(args.requests),
                "BENCH_PROFILE": "1" if args.profile else "0",
                "BENCH_DIRECT_URL": fake.base_url + last["path"],
                "BENCH_DIRECT_BODY": last["body"].decode(),
                "BENCH_DIRECT_HEADERS": json.dumps(
                    {k: v for k, v in last["headers"].items() if k not in HOP_HEADERS}
                ),
            },
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    if output.returncode:
        raise RuntimeError(f"the worker failed:\n{output.stderr[-3000:]}")
    data = json.loads(output.stdout.strip().splitlines()[-1])
    stream, refusal = data["stream"], data["refusal"]
    added = [a - d for a, d in zip(stream["wall"], stream["direct"], strict=True)]
    print(
        f"\n## In-process cost per request ({PERSONA}, {args.requests} each; ms)\n\n"
        + table(
            ["request", "wall p50", "wall p90", "CPU p50", "CPU p90"],
            [
                [
                    "direct read of the fake (reference)",
                    f"{percentile(stream['direct'], 50) * 1000:.3f}",
                    f"{percentile(stream['direct'], 90) * 1000:.3f}",
                    "",
                    "",
                ],
                _row("stream: POST /api/quotes/stream to its first token", stream["wall"], stream["cpu"]),
                [
                    "  added over the direct read",
                    f"{percentile(added, 50) * 1000:.3f}",
                    f"{percentile(added, 90) * 1000:.3f}",
                    "",
                    "",
                ],
                _row("refusal: the same at the open-stream cap (503)", refusal["wall"], refusal["cpu"]),
            ],
        )
        + f"\n\nthe refusal's headers: {', '.join(refusal['headers'])}"
    )
    for key in ("stream_profile", "refusal_profile"):
        if key in data:
            print(f"{key.replace('_', ' ')}: {data[key]}")


if __name__ == "__main__":
    main()
