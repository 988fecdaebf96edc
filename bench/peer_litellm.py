"""Our app vs LiteLLM's proxy (the peer a team would pick to put a gateway in front of a model),
against one upstream, measured in one run with the paths interleaved request by request:
added TTFT p50/p99 over the direct path and tokens/s of one fast stream.

    .venv/bin/python -m bench.peer_litellm

LiteLLM (`litellm[proxy]==1.100.5`; newer releases need a certifi the registry here lacks) lives
in its own venv, `.venv-bench-litellm`, which this script creates on first use: installed into
`.venv` it would pull ~80 packages, uvloop among them, which uvicorn then picks up by itself and
which would change the uvicorn row of bench/proxy_overhead.py.

The upstream (its own process) serves the same tokens in both wire formats, with the same
framing as the tests' fake (chunked SSE, one event per token, usage, `[DONE]`,
Connection: close): Workers AI's `/client/v4/accounts/<id>/ai/run/<model>` for our app and
OpenAI's `/v1/chat/completions` for LiteLLM (`openai/` provider with `api_base`). The fake in
tests/fakes has no OpenAI route (its `openai_style` scenario still answers on the Workers AI
path, which LiteLLM's OpenAI client cannot be pointed at), hence this small one in bench/.

Paths, each read by one `httpx.Client` with the same incremental parser:
- direct (Workers AI route), direct (OpenAI route): the baselines;
- our app under daphne: `POST /api/quotes/stream`, workers-ai backend -> Workers AI route;
- LiteLLM proxy (its own uvicorn, 1 worker): `POST /v1/chat/completions` -> OpenAI route.
Added TTFT = a proxy's TTFT minus its own direct path's (p50 of each, p99 of each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    ACCOUNT_ID,
    API_TOKEN,
    ARTIFACTS,
    ROOT,
    free_port,
    machine,
    percentile,
    running_server,
    table,
)
from bench.load import serve_daphne

LITELLM_VENV = ROOT / ".venv-bench-litellm"
LITELLM_REQUIREMENT = "litellm[proxy]==1.100.5"
MODEL = "@cf/meta/llama-3.1-8b-instruct"

# -- the upstream: Workers AI and OpenAI routes, same tokens ------------------------------------------


def _upstream_main(conn: Connection, tokens: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            path = head.split(b" ", 2)[1].decode()
            count = state["tokens"]
            words = [f" w{i}" for i in range(count)]
            if path.startswith("/v1/chat/completions"):
                events = [
                    {
                        "id": "chatcmpl-bench",
                        "object": "chat.completion.chunk",
                        "created": 1_700_000_000,
                        "model": "bench-model",
                        "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
                    }
                    for word in words
                ]
                events.append(
                    {
                        "id": "chatcmpl-bench",
                        "object": "chat.completion.chunk",
                        "created": 1_700_000_000,
                        "model": "bench-model",
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                        "usage": {
                            "prompt_tokens": 24,
                            "completion_tokens": count,
                            "total_tokens": 24 + count,
                        },
                    }
                )
            elif "/ai/run/" in path:
                events = [{"response": word} for word in words]
                events.append(
                    {
                        "response": "",
                        "usage": {
                            "prompt_tokens": 24,
                            "completion_tokens": count,
                            "total_tokens": 24 + count,
                        },
                    }
                )
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for event in events:
                data = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
                writer.write(b"%x\r\n%b\r\n" % (len(data), data))
                await writer.drain()
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    state = {"tokens": tokens}

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        conn.send(server.sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        while True:
            command, arg = await loop.run_in_executor(None, conn.recv)
            if command == "tokens":
                state["tokens"] = arg
                conn.send(True)
            else:
                server.close()
                conn.send(True)
                return

    asyncio.run(main())


class DualUpstream:
    def __init__(self, tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_upstream_main, args=(child, tokens), daemon=True)
        self.process.start()
        self.port: int = self._conn.recv()

    def set_tokens(self, tokens: int) -> None:
        self._conn.send(("tokens", tokens))
        self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send(("stop", None))
            self._conn.recv()
        self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()


# -- LiteLLM in its own venv ------------------------------------------------------------------------


def ensure_litellm() -> Path:
    binary = LITELLM_VENV / "bin" / "litellm"
    if not binary.exists():
        print(f"creating {LITELLM_VENV} with {LITELLM_REQUIREMENT} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_REQUIREMENT], check=True)
    return binary


@contextlib.contextmanager
def serve_litellm(upstream_port: int) -> Iterator[str]:
    binary = ensure_litellm()
    with tempfile.TemporaryDirectory(prefix="bench-litellm-") as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: bench-model\n"
            "    litellm_params:\n"
            "      model: openai/bench-model\n"
            f"      api_base: http://127.0.0.1:{upstream_port}/v1\n"
            "      api_key: sk-bench-not-a-secret\n"
            "litellm_settings:\n"
            "  set_verbose: false\n"
            "  telemetry: false\n"
        )
        port = free_port()
        env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list from GitHub
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "DISABLE_SCHEMA_UPDATE": "True",
        }
        for name in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE"):
            env.pop(name, None)
        command = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
        command += ["--num_workers", "1"]
        with running_server(
            command,
            port=port,
            env=env,
            log_path=ARTIFACTS / "litellm.log",
            name="litellm",
            health_path="/health/liveliness",
            cwd=tmp,
            timeout_s=120,
            poll_s=0.25,
        ) as (_, url):
            yield url


# -- reading and timing ------------------------------------------------------------------------------


def timed_stream(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, float]:
    """TTFT (to the first event with text, either format) and tokens/s after the first token."""
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    buffer = b""
    finished = False
    with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for chunk in response.iter_raw():
            buffer += chunk
            while (end := buffer.find(b"\n\n")) >= 0:
                block, buffer = buffer[:end], buffer[end + 2 :]
                for line in block.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        finished = True
                        continue
                    payload = json.loads(data)
                    text = payload.get("response")
                    if text is None:
                        choices = payload.get("choices") or [{}]
                        text = (choices[0].get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        tokens += 1
    if not finished or not tokens:
        raise RuntimeError(f"{url}: no [DONE] or no tokens")
    return {
        "ttft": first - started,
        "tokens": tokens,
        "tokens_per_s": (tokens - 1) / (last - first) if last > first else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150, help="TTFT requests per path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer for TTFT")
    parser.add_argument("--fast-tokens", type=int, default=200, help="tokens per answer for tokens/s")
    parser.add_argument("--fast-streams", type=int, default=20, help="tokens/s streams per path")
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    upstream = DualUpstream(args.tokens)
    base = f"http://127.0.0.1:{upstream.port}"
    env = {
        "AI_BACKEND": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": ACCOUNT_ID,
        "CLOUDFLARE_API_TOKEN": API_TOKEN,
        "CLOUDFLARE_API_BASE_URL": f"{base}/client/v4",
    }
    messages = [{"role": "system", "content": "You are Alan Watts"}, {"role": "user", "content": "a quote"}]
    try:
        with serve_daphne(**env) as (_, app_url, _db), serve_litellm(upstream.port) as litellm_url:
            paths: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
                "direct, Workers AI route": (
                    f"{base}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{MODEL}",
                    {"messages": messages, "stream": True},
                    {"Authorization": f"Bearer {API_TOKEN}"},
                ),
                "direct, OpenAI route": (
                    f"{base}/v1/chat/completions",
                    {"model": "bench-model", "messages": messages, "stream": True},
                    {"Authorization": "Bearer sk-bench-not-a-secret"},
                ),
                "our app under daphne": (f"{app_url}/api/quotes/stream", {"persona": "alan-watts"}, {}),
                "LiteLLM proxy 1.100.5": (
                    f"{litellm_url}/v1/chat/completions",
                    {"model": "bench-model", "messages": messages, "stream": True},
                    {},
                ),
            }
            baseline = {
                "our app under daphne": "direct, Workers AI route",
                "LiteLLM proxy 1.100.5": "direct, OpenAI route",
            }
            clients = {name: httpx.Client(timeout=30) for name in paths}
            names = list(paths)
            ttft: dict[str, list[float]] = {name: [] for name in paths}
            rate: dict[str, list[float]] = {name: [] for name in paths}
            load_before = os.getloadavg()
            for round_ in range(args.warmup + args.requests):
                order = names[round_ % len(names) :] + names[: round_ % len(names)]
                for name in order:
                    url, body, headers = paths[name]
                    result = timed_stream(clients[name], url, body, headers)
                    if round_ >= args.warmup:
                        ttft[name].append(result["ttft"])
            upstream.set_tokens(args.fast_tokens)
            for round_ in range(args.fast_streams):
                order = names[round_ % len(names) :] + names[: round_ % len(names)]
                for name in order:
                    url, body, headers = paths[name]
                    rate[name].append(timed_stream(clients[name], url, body, headers)["tokens_per_s"])
            load_after = os.getloadavg()
    finally:
        upstream.close()
    rows = []
    report: dict[str, Any] = {"load_average": [load_before, load_after], "paths": {}}
    for name in names:
        values = sorted(ttft[name])
        p50, p99 = percentile(values, 50), percentile(values, 99)
        base_name = baseline.get(name)
        added50 = added99 = ""
        if base_name:
            base_values = sorted(ttft[base_name])
            added50 = f"{(p50 - percentile(base_values, 50)) * 1000:.2f}"
            added99 = f"{(p99 - percentile(base_values, 99)) * 1000:.2f}"
        tps = percentile(sorted(rate[name]), 50)
        direct_tps = percentile(sorted(rate[base_name]), 50) if base_name else tps
        rows.append(
            [
                name,
                f"{p50 * 1000:.2f}",
                f"{p99 * 1000:.2f}",
                added50,
                added99,
                f"{tps:,.0f}",
                f"{tps / direct_tps:.2f}",
            ]
        )
        report["paths"][name] = {"ttft_s": ttft[name], "tokens_per_s": rate[name]}
    print(
        table(
            [
                "path",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "added p50 ms",
                "added p99 ms",
                f"tokens/s ({args.fast_tokens} tokens)",
                "ratio to its direct",
            ],
            rows,
        )
    )
    print(f"load average before {load_before}, after {load_after}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "peer_litellm.json").write_text(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
