"""A real OpenAI-compatible server for tests: llama.cpp's own server (from the xllamacpp wheel,
the same runtime as the embedded backend) running Gemma 3 270M on 127.0.0.1, in a subprocess
(register with `pytest_plugins`; `python -m tests.llama_server --help` runs it by hand).

Fixtures:
- `llama_server` (session): a `LlamaServer` with `base_url` (ends in /v1), `api_key` (the
  server is started with one, so auth failures can be tested for real), `model_path`, `log_path`.

The model file is assembled on first use at settings.LOCAL_MODEL_PATH. Start-up takes about 2 s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.services import free_port, stop_process, tail

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LlamaServer:
    base_url: str
    api_key: str
    model_path: Path
    log_path: Path


def _wait_ready(process: subprocess.Popen[bytes], base_url: str, api_key: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                code = process.returncode
                log = tail(log_path)
                raise RuntimeError(f"the llama.cpp server exited with {code} during start-up:\n{log}")
            try:
                if client.get(f"{base_url}/models", headers=headers).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the llama.cpp server not ready after {READY_TIMEOUT_S:.0f} s:\n{tail(log_path)}"
                )
            time.sleep(0.2)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    from django.conf import settings

    from quotes.backends.local import ensure_model_file

    model_path = ensure_model_file(Path(settings.LOCAL_MODEL_PATH))
    port = free_port()
    api_key = secrets.token_hex(16)  # hex: a leading "-" would read as an option
    base_url = f"http://127.0.0.1:{port}/v1"
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "tests.llama_server",
        "--model",
        str(model_path),
        "--port",
        str(port),
        "--api-key",
        api_key,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Unbuffered, so the log shows what the server did as it did it (tests read it).
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        _wait_ready(process, base_url, api_key, log_path)
        yield LlamaServer(base_url=base_url, api_key=api_key, model_path=model_path, log_path=log_path)
    finally:
        stop_process(process)


def serve(model: Path, port: int, api_key: str, n_ctx: int = 1024, threads: int = 2) -> None:
    """Run llama.cpp's server on 127.0.0.1:`port` until SIGTERM or SIGINT."""
    import signal
    import threading

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.model_alias = {"gemma-3-270m"}  # the name the server reports, like the embedded backend's
    params.n_ctx = n_ctx
    params.n_parallel = 1
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.cache_ram_mib = 0
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.api_keys = [api_key]
    params.endpoint_slots = True  # GET /slots: tests see when a generation has stopped
    server = xllamacpp.Server(params)
    print(f"listening on {server.listening_address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    del server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=serve.__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args()
    serve(arguments.model, arguments.port, arguments.api_key, arguments.n_ctx, arguments.threads)
