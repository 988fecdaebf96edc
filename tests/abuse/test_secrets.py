"""Secrets stay out of pages, log lines and the image, and the deploy files carry the server's
limits (issue 35, points 2, 6 and 7).

- The DEBUG 500 page masks the Cloudflare and AI Gateway tokens, the OpenAI-compatible key and
  the password in REDIS_URL (the caches' LOCATION too), wherever they sit: a real request in a
  fresh process configured from the environment, as production starts.
- httpx logs no upstream URL (the Cloudflare account id, the gateway id), through a real stream.
- deploy/Dockerfile's build context (.dockerignore) holds no local secrets or data.
- Every daphne command line caps WebSocket messages at the app's 64 KiB and leaves proxy headers
  to the app; nginx bounds the sockets per address and their idle time.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings

import config.asgi  # noqa: F401  (its import sets Django up again, logging with it: not during a capture)
from harness.daphne import INSTANCE_UNIT, SINGLE_UNIT, daphne_command, environment, make_command
from harness.workers_ai import FakeWorkersAI
from quotes.backends import reset_backends
from quotes.models import Persona
from tests.asgi import post_quote
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN, TEST_GATEWAY_TOKEN

ROOT = Path(__file__).resolve().parents[2]
OPENAI_KEY = "sk-test-4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c"
REDIS_PASSWORD = "redis-pass-8c7b6a5f4e3d"
GATEWAY_ID = "gw-test-3d2c1b0a"

#: A request that fails in a view whose frame holds a credential (as a backend's constructor's
#: does), in DEBUG, through the real ASGI app: Django's technical 500 page.
FAILING_REQUEST = """
import asyncio, sys, django
django.setup()
from django.conf import settings
from django.urls import path

def fails(request):
    headers = {"Authorization": f"Bearer {settings.CLOUDFLARE_API_TOKEN}"}
    raise RuntimeError("the upstream call failed")

urlpatterns = [path("fails", fails)]
settings.ROOT_URLCONF = "__main__"
from tests.asgi import request
response = asyncio.run(request("GET", "/fails", headers={"accept": "text/html"}))
sys.stdout.write(f"{response.status}\\n{response.body.decode()}")
"""


@pytest.mark.system
def test_the_debug_error_page_prints_no_credential(tmp_path: Path, closed_port: int) -> None:
    env = environment(
        DJANGO_DEBUG="true",
        DJANGO_SETTINGS_MODULE="config.settings",
        DJANGO_ALLOWED_HOSTS="testserver",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        CLOUDFLARE_ACCOUNT_ID=TEST_ACCOUNT_ID,
        CLOUDFLARE_API_TOKEN=TEST_API_TOKEN,
        AI_GATEWAY_ID=GATEWAY_ID,
        AI_GATEWAY_TOKEN=TEST_GATEWAY_TOKEN,
        OPENAI_API_KEY=OPENAI_KEY,
        REDIS_URL=f"redis://:{REDIS_PASSWORD}@127.0.0.1:{closed_port}/0",
    )
    result = subprocess.run(
        [sys.executable, "-c", FAILING_REQUEST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    status, page = result.stdout.split("\n", 1)
    assert status == "500" and "RuntimeError" in page and "the upstream call failed" in page, page[:500]
    assert all(
        name in page for name in ("CLOUDFLARE_API_TOKEN", "REDIS_URL", "CACHES", "headers")
    )  # shown, masked
    assert "CLOUDFLARE_ACCOUNT_ID" in page and "AI_GATEWAY_ID" in page  # shown, masked (issue 39)
    for secret in (
        TEST_API_TOKEN,
        TEST_GATEWAY_TOKEN,
        OPENAI_KEY,
        REDIS_PASSWORD,
        TEST_ACCOUNT_ID,
        GATEWAY_ID,
    ):
        assert secret not in page, secret


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona, workers_ai_settings: Any) -> FakeWorkersAI:
    workers_ai_settings.AI_GATEWAY_ID = GATEWAY_ID  # through AI Gateway: both ids in the URL
    await reset_backends()
    return fake


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_no_upstream_url_reaches_the_log(fake: FakeWorkersAI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # whatever DJANGO_LOG_LEVEL says

    response = await post_quote()

    assert response.status == 200 and fake.requests[0].gateway == GATEWAY_ID  # the URL was used
    assert any(r.name == "quotes.request" for r in caplog.records)  # the capture sees the app's lines
    leaked = [
        r.getMessage()
        for r in caplog.records
        if GATEWAY_ID in r.getMessage() or TEST_ACCOUNT_ID in r.getMessage()
    ]
    assert leaked == []


# -- the image's build context ------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, str]]:
    """(exclusion, pattern) per line of .dockerignore, cleaned as Docker cleans them."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    return [
        (line.startswith("!"), os.path.normpath(line.removeprefix("!").strip()).lstrip("/"))
        for line in lines
        if line and not line.startswith("#")
    ]


#: Docker's pattern syntax: Go's filepath.Match, plus `**` for any number of directories.
_TOKENS = re.compile(r"(\*\*/|\*\*|\*|\?|\[[^\]]*\])")
_MEANING = {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}


def _regex(pattern: str) -> re.Pattern[str]:
    parts = (_MEANING.get(p, p if p.startswith("[") else re.escape(p)) for p in _TOKENS.split(pattern))
    return re.compile("".join(parts) + r"\Z")


def ignored(path: str, patterns: list[tuple[bool, str]]) -> bool:
    """Whether Docker leaves `path` (relative, with /) out of the context: the last pattern that
    matches it, or one of its parent directories, decides (moby's MatchesOrParentMatches)."""
    parts, matched = path.split("/"), False
    for exclusion, pattern in patterns:
        if exclusion != matched:
            continue
        regex, depth = _regex(pattern), pattern.count("/") + 1
        if regex.match(path) or (len(parts) > depth and regex.match("/".join(parts[:depth]))):
            matched = not exclusion
    return matched


def build_context() -> list[str]:
    """The files `docker build -f deploy/Dockerfile .` sends from this tree."""
    patterns, context = dockerignore_patterns(), []
    reincludes = any(exclusion for exclusion, _ in patterns)
    for folder, dirs, files in os.walk(ROOT):
        relative = "" if Path(folder) == ROOT else Path(folder).relative_to(ROOT).as_posix()
        if not reincludes:  # a directory left out is left out whole: no need to walk it
            dirs[:] = [d for d in dirs if not ignored(f"{relative}/{d}".lstrip("/"), patterns)]
        context += [path for f in files if not ignored(path := f"{relative}/{f}".lstrip("/"), patterns)]
    return context


LOCAL_ONLY = re.compile(r"(^|/)(\.env[^/]*|db\.sqlite3[^/]*)$|^(\.git|\.venv|tests|bench|harness)/")


@pytest.mark.unit
def test_the_docker_build_context_holds_no_local_secrets_or_data() -> None:
    context = build_context()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    patterns = dockerignore_patterns()
    local = [".env", ".env.local", "config/.env.prod", "db.sqlite3", "db.sqlite3-journal", ".git/config"]

    assert copied == [
        "requirements.txt",
        "packages/",
        ".",
    ]  # the context is the repo root, as the Dockerfile says
    assert [path for path in context if LOCAL_ONLY.search(path)] == []
    assert [path for path in local if not ignored(path, patterns)] == []
    needed = [
        "requirements.txt",
        "manage.py",
        "config/settings.py",
        "quotes/views.py",
        "packages/streaming/src/streaming/events.py",
    ]
    assert [path for path in needed if path not in context] == []
    assert any(path.startswith(("static/", "templates/")) for path in context)


# -- the servers' own limits, in every deploy file ----------------------------------------------------


@pytest.mark.unit
def test_every_daphne_command_caps_websocket_messages_and_leaves_proxy_headers_to_the_app() -> None:
    """daphne's --proxy-headers believes whoever connects; the app's middleware decides instead.
    daphne's own message and frame caps (1 MiB by default) are the app's 64 KiB."""
    cap = str(django_settings.QUOTES_MAX_FRAME_BYTES)
    commands = [daphne_command(source, 8000) for source in (INSTANCE_UNIT, SINGLE_UNIT, "Dockerfile")]
    for args in [*commands, make_command("serve", 8000)]:
        assert "--proxy-headers" not in args
        for flag in ("--websocket-max-message-size", "--websocket-max-frame-size"):
            assert args[args.index(flag) + 1] == cap, args
    # nginx: a bounded number of sockets per address, and a read timeout shorter than the old hour
    locations = (ROOT / "deploy/nginx/persona-quotes-locations.conf").read_text()
    ws = re.search(r"location /ws/ \{(.*?)\n\}", locations, re.S)
    assert ws is not None
    zone = re.search(r"^\s*limit_conn (\w+) \d+;", ws.group(1), re.M)
    assert zone is not None
    site = (ROOT / "deploy/nginx/persona-quotes.conf").read_text()
    assert re.search(rf"^limit_conn_zone \$binary_remote_addr zone={zone.group(1)}:\d+m;", site, re.M)
    assert re.search(r"proxy_read_timeout 120s;", ws.group(1))
