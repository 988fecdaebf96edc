"""Fixtures for the fake Workers AI upstream (registered from tests/conftest.py).

- `fake_workers_ai`: the session's fake (harness/workers_ai.py), reset around each test.
- `workers_ai_settings`: the site on the workers-ai backend against the fake, one attempt, short
  deadlines (a test that wants retries or fallbacks sets QUOTES_POLICY itself).
- `workers_ai_backend`: a WorkersAIBackend on the fake, closed on the test's own loop.
- `fake`: the site on `workers_ai_settings`, its backends closed on the test's own loop; a test
  module overrides it to set its persona up with `saved(persona, field=value)`.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from streaming import Policy

from harness.services import free_port
from harness.workers_ai import FakeWorkersAI
from quotes.backends import reset_backends
from quotes.backends.workers_ai import WorkersAIBackend
from quotes.models import Persona
from quotes.services import persona_save

#: Secret-looking credentials: tests assert they never reach an error, a log line or a page.
TEST_ACCOUNT_ID = "acct-test"
TEST_API_TOKEN = "cfut_TEST-9f8e7d6c5b4a39281706f5e4d3c2b1a0ZZ"
TEST_GATEWAY_TOKEN = "cfgw_TEST-0a1b2c3d4e5f60718293a4b5c6d7e8f9YY"
#: One attempt, short deadlines: each scripted answer maps straight to what the client sees,
#: and a stalled fake ends a test in seconds.
TEST_POLICY = Policy(
    max_attempts=1, retry_delay_s=0.01, ttft_timeout_s=4.0, idle_timeout_s=2.0, total_timeout_s=10.0
)


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
    """The site on the workers-ai backend against the fake. Change a setting further, then call
    `quotes.backends.reset_backends()`."""
    async_to_sync(reset_backends)()
    settings.AI_BACKEND = "workers-ai"
    settings.CLOUDFLARE_ACCOUNT_ID = TEST_ACCOUNT_ID
    settings.CLOUDFLARE_API_TOKEN = TEST_API_TOKEN
    settings.CLOUDFLARE_API_BASE_URL = fake_workers_ai.api_base_url
    settings.AI_GATEWAY_BASE_URL = fake_workers_ai.gateway_base_url
    settings.QUOTES_POLICY = TEST_POLICY
    settings.QUOTES_FALLBACK_MODELS = []
    yield settings
    async_to_sync(reset_backends)()


@pytest.fixture
async def workers_ai_backend(fake_workers_ai: FakeWorkersAI) -> AsyncIterator[WorkersAIBackend]:
    backend = WorkersAIBackend(
        account_id=TEST_ACCOUNT_ID,
        api_token=TEST_API_TOKEN,
        base_url=fake_workers_ai.api_base_url,
        gateway_base_url=fake_workers_ai.gateway_base_url,
        connect_timeout_s=2.0,
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


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    yield fake_workers_ai
    await reset_backends()  # their httpx clients belong to this test's loop


async def saved(persona: Persona, **fields: Any) -> Persona:
    """`persona` with `fields` changed, saved as an editor saves it (a new version)."""
    for name, value in fields.items():
        setattr(persona, name, value)
    await sync_to_async(persona_save)(persona=persona)
    return persona
