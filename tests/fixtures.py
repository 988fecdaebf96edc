"""Fixtures for the fake Workers AI upstream (registered from tests/conftest.py).

- `fake_workers_ai_server`: the running fake, one per test session.
- `fake_workers_ai`: the same server, reset (empty script, no records) around each test.
- `workers_ai_settings`: Django settings pointing the workers-ai backend at the fake, with the
  backend registry reset before and after so the settings take effect.
- `workers_ai_backend`: a `WorkersAIBackend` built from those settings, closed after the test
  on the test's own event loop.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from dataclasses import fields, replace
from typing import Any

import pytest
from asgiref.sync import async_to_sync

from harness.services import free_port
from harness.workers_ai import FakeWorkersAI
from quotes.conf import (
    CloudflareGatewayRetries,
    CloudflareGatewaySettings,
    UpstreamHTTPSettings,
    WorkersAISettings,
)

#: Secret-looking test credentials: tests assert they never reach an error, a log line or a page.
TEST_ACCOUNT_ID = "acct-test"
TEST_API_TOKEN = "cfut_TEST-9f8e7d6c5b4a39281706f5e4d3c2b1a0ZZ"
TEST_GATEWAY_TOKEN = "cfgw_TEST-0a1b2c3d4e5f60718293a4b5c6d7e8f9YY"


def workers_ai_config(fake: FakeWorkersAI, **overrides: Any) -> WorkersAISettings:
    return replace(
        WorkersAISettings(account_id=TEST_ACCOUNT_ID, api_token=TEST_API_TOKEN, base_url=fake.api_base_url),
        **overrides,
    )


def http_config(**overrides: Any) -> UpstreamHTTPSettings:
    """Upstream HTTP settings with a connect timeout short enough for tests (settings.AI_HTTP)."""
    return replace(
        UpstreamHTTPSettings(connect_timeout_s=2.0, max_connections=100),
        **overrides,
    )


def upstream_configs(fake: FakeWorkersAI, **overrides: Any) -> tuple[WorkersAISettings, UpstreamHTTPSettings]:
    """(settings.WORKERS_AI, settings.AI_HTTP) for the fake, each override going to whichever of
    the two has the field (`base_url=...`, `connect_timeout_s=...`)."""
    http_fields = {f.name for f in fields(UpstreamHTTPSettings)}
    http = {name: value for name, value in overrides.items() if name in http_fields}
    rest = {name: value for name, value in overrides.items() if name not in http_fields}
    return workers_ai_config(fake, **rest), http_config(**http)


def gateway_config(fake: FakeWorkersAI, **overrides: Any) -> CloudflareGatewaySettings:
    """settings.AI_GATEWAY as config/settings.py builds it by default; `id` empty means no
    gateway."""
    config = CloudflareGatewaySettings(
        id="",
        base_url=fake.gateway_base_url,
        token="",
        skip_cache=False,
        cache_ttl=None,
        cache_key="",
        metadata={},
        collect_log=None,
        request_timeout_ms=None,
        retries=CloudflareGatewayRetries(),
    )
    return replace(config, **overrides)


def _reset_backends() -> None:
    from quotes.ai.backends import reset_backends

    async_to_sync(reset_backends)()


@pytest.fixture(scope="session")
def fake_workers_ai_server() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI() as fake:
        yield fake


@pytest.fixture
def fake_workers_ai(fake_workers_ai_server: FakeWorkersAI) -> Iterator[FakeWorkersAI]:
    fake_workers_ai_server.reset()
    yield fake_workers_ai_server
    fake_workers_ai_server.reset()


@pytest.fixture
def workers_ai_settings(settings: Any, fake_workers_ai: FakeWorkersAI) -> Iterator[Any]:
    """Settings for the workers-ai backend against the fake. Change `settings.AI_GATEWAY` (or
    WORKERS_AI, AI_HTTP) further in a test, then call `quotes.ai.backends.reset_backends()` again."""
    _reset_backends()
    settings.AI_BACKEND = "workers-ai"
    settings.CLOUDFLARE_API_TOKEN = TEST_API_TOKEN
    settings.WORKERS_AI = workers_ai_config(fake_workers_ai)
    settings.AI_HTTP = http_config()
    settings.AI_GATEWAY = gateway_config(fake_workers_ai)
    # One attempt, no fallbacks: each scripted upstream answer maps straight to what the client
    # sees. The gateway tests turn retries and fallbacks on where they test them. Deadlines
    # short enough that a stalled fake ends a test in seconds.
    settings.QUOTES_GATEWAY = replace(
        settings.QUOTES_GATEWAY,
        max_attempts=1,
        fallback_models=[],
        ttft_timeout_s=4.0,
        idle_timeout_s=2.0,
        total_timeout_s=10.0,
    )
    yield settings
    _reset_backends()


@pytest.fixture
async def workers_ai_backend(workers_ai_settings: Any) -> AsyncIterator[Any]:
    from quotes.ai.backends.workers_ai import WorkersAIBackend

    backend = WorkersAIBackend(
        workers_ai=workers_ai_settings.WORKERS_AI,
        gateway=workers_ai_settings.AI_GATEWAY,
        http=workers_ai_settings.AI_HTTP,
    )
    yield backend
    await backend.aclose()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port nothing listens on: connecting is refused at once."""
    yield free_port()


@pytest.fixture
def unaccepting_port() -> Iterator[int]:
    """A port whose listen backlog is full, so a new connection hangs in the handshake."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    yield port
    for filler in fillers:
        filler.close()
    server.close()
