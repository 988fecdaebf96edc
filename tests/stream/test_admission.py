"""Admission, one check at the top of the stream view: this process's open-stream cap (503), the
client's and its network's rate limits (429), and the client's concurrent streams (429), which a
generation keeps until it ends, dropped connection or not."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes import spend, streams
from quotes.clients import Client
from quotes.models import Generation, Persona
from quotes.rate_limits import count_stream
from tests.asgi import post_quote, post_stream, read_events, request
from tests.fixtures import saved

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    await saved(
        persona, model="@cf/meta/llama-3.1-8b-instruct-fp8", cache_ttl=0
    )  # no cache: a generation each
    return fake


async def test_the_rate_limit_answers_429_with_retry_after_per_client(
    fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "3/minute"
    statuses = [(await post_quote()).status for _ in range(3)]
    refused = await post_quote()
    assert statuses == [200, 200, 200] and refused.status == 429
    assert refused.json()["error"]["code"] == "rate_limited" and 0 < int(refused.headers["retry-after"]) <= 60
    other = await post_quote(client=("198.51.100.7", 1))
    assert other.status == 200  # another client, another network (counted: test_analytics.py)


async def test_a_network_shares_six_clients_budgets(fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_RATE_LIMIT = "1/minute"
    statuses = [(await post_quote(client=(f"203.0.113.{n}", 1))).status for n in range(1, 9)]
    assert statuses == [200] * 6 + [429, 429]


async def test_dropped_connections_keep_their_clients_slots_until_their_generations_end(
    fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RESUME_GRACE_S = 5
    fake.default = Scenario(tokens=["tick"] * 200, token_delay_s=0.02)
    for _ in range(3):  # each dropped right after its headers; each generation runs on
        stream = post_stream()
        await read_events(stream, 1)
        await stream.disconnect()
    refused = await post_quote()
    assert (refused.status, refused.json()["error"]["code"]) == (429, "too_many_streams")
    assert len(fake.requests) == 3
    fake.script(Scenario())  # a short one
    assert (await post_quote(client=("198.51.100.7", 1))).status == 200  # others are not held back


async def test_the_open_stream_cap_refuses_at_once_with_503(
    fake: FakeWorkersAI, settings: Any, unlimited: Any
) -> None:
    settings.QUOTES_MAX_OPEN_STREAMS = 2
    fake.default = Scenario(tokens=["tick"] * 30, token_delay_s=0.02)
    held = [post_stream(client=(f"198.51.100.{n}", 1)) for n in (1, 2)]
    for stream in held:
        await read_events(stream, 1)
    refused = await post_quote(client=("198.51.100.3", 1))
    assert (refused.status, refused.json()["error"]["code"]) == (503, "over_capacity")
    assert refused.headers["retry-after"]
    assert len(fake.requests) == 2  # at once: no upstream call for it
    for stream in held:
        await stream.read_all()
    assert (await post_quote(client=("198.51.100.3", 1))).status == 200


async def test_a_limited_client_stays_limited_after_thousands_of_others(
    fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "2/hour"
    for _ in range(2):
        await post_quote()
    assert (await post_quote()).status == 429
    # 10,000 other clients, each from a network of its own, counted as the view counts them
    # (one over HTTP first, to be sure it is the same count).
    assert (await request("PUT", "/api/quotes/stream", client=("10.255.255.1", 1))).status == 405
    for n in range(10_000):
        await count_stream(Client.of(f"10.{n // 256}.{n % 256}.1"))
    assert (await post_quote()).status == 429


@pytest.mark.services
async def test_a_burst_never_spends_past_the_daily_ceiling(
    fake: FakeWorkersAI, settings: Any, persona: Persona, unlimited: Any
) -> None:
    """Each paid generation reserves the most it can cost before it starts (every prompt
    character a token, max_tokens written), atomically in the shared counters: a burst admits
    only what fits, and the real costs, settled at the end, stay under the ceiling."""
    request = persona.build_request(topic=persona.default_topic)
    most = Decimal(str(streams.most_cost([persona.model], request)))
    settings.QUOTES_DAILY_SPEND_LIMIT_USD = most * Decimal("3.5")
    fake.default = Scenario(tokens=["tick"] * 10, token_delay_s=0.02)
    burst = await asyncio.gather(*(post_quote(client=(f"198.51.100.{n}", 1)) for n in range(12)))
    statuses = sorted(response.status for response in burst)
    assert statuses == [200] * 3 + [503] * 9
    assert {response.json()["error"]["code"] for response in burst if response.status == 503} == {
        "budget_exhausted"
    }
    spent = await spend.spent_today()
    assert 0 < spent <= settings.QUOTES_DAILY_SPEND_LIMIT_USD
    assert spent == sum([row.cost_usd async for row in Generation.objects.all()], Decimal(0))
