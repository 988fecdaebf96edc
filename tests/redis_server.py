"""A real Redis for the tests (register with `pytest_plugins = ["tests.redis_server"]`).

- `redis_server`: a `redis-server` subprocess on a free 127.0.0.1 port, one per test session;
  yields its URL, redis://127.0.0.1:<port>/0. No persistence (`--save ''`, no AOF).
- `redis_cache`: Django's default cache pointed at that server (RedisCache), emptied before and
  after the test; yields a redis-py client on the same database, to look at the keys.

redis-server comes from the Debian package (`apt-get install -y redis-server`). When it is
missing the fixture FAILS: a test that asked for Redis must not pass without it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REDIS_CACHE_BACKEND = "django.core.cache.backends.redis.RedisCache"
START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import redis

    executable = shutil.which("redis-server")
    if executable is None:
        pytest.fail(
            "redis-server is not installed, and these tests need a real Redis: "
            "apt-get install -y redis-server",
            pytrace=False,
        )
    workdir = tmp_path_factory.mktemp("redis")
    log_path = workdir / "redis.log"
    port = _free_port()
    command = [
        executable,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"redis-server exited with {process.returncode} before answering PING:\n"
                    + _log_tail(log_path),
                    pytrace=False,
                )
            client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                pass
            finally:
                client.close()
            if time.monotonic() > deadline:
                pytest.fail(
                    f"redis-server on port {port} did not answer PING within {START_TIMEOUT_S} s:\n"
                    + _log_tail(log_path),
                    pytrace=False,
                )
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@pytest.fixture
def redis_cache(settings: Any, redis_server: str) -> Iterator[Any]:
    """Django's default cache on the real Redis; yields a redis-py client on the same database."""
    import redis
    from django.core.cache import close_caches

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    settings.CACHES = {"default": {"BACKEND": REDIS_CACHE_BACKEND, "LOCATION": redis_server}}
    if settings.REDIS_URL:
        # As deployed, REDIS_URL names the cache's Redis: the admission's counts and slots, and
        # the runs shared across processes, go to the same server as the cache.
        settings.REDIS_URL = redis_server
    try:
        yield client
    finally:
        client.flushdb()
        client.close()
        with contextlib.suppress(Exception):
            close_caches()
