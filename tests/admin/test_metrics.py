"""`GET /metrics` (quotes/metrics.py): scraped through the real ASGI app after real streams, on
the embedded model and on the fake Workers AI upstream, over HTTP and the WebSocket.

Counters are per process and live for the whole test session, so each test scrapes before and
after and compares the two.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.backends.local import LocalBackend
from quotes.models import Generation, Persona
from tests.asgi import post_quote, post_stream, request
from tests.conftest import slots_held

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

TOKEN = "metrics-test-token-3f9a1c"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MODEL = "@cf/meta/llama-3.1-8b-instruct"
FALLBACK = "@cf/meta/llama-3.2-3b-instruct"
LOCAL_MODEL = "gemma-3-270m"


@pytest.fixture(autouse=True)
def _metrics_token(settings: Any) -> None:
    settings.QUOTES_METRICS_ENABLED = True
    settings.QUOTES_METRICS_TOKEN = TOKEN
    settings.QUOTES_METRICS_ALLOW = ()


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    yield fake_workers_ai
    await reset_backends()  # its httpx client is closed on this test's loop


class Scrape:
    """One scrape of /metrics, parsed with prometheus-client's own parser."""

    def __init__(self, text: str) -> None:
        self.samples = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str) -> bool:
        return any(sample_name == name for sample_name, _, _ in self.samples)


async def scrape() -> Scrape:
    response = await request("GET", "/metrics", headers=AUTH)
    assert response.status == 200, response.body
    return Scrape(response.body.decode())


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


async def wait_for_rows(count: int) -> list[Generation]:
    """A request that ended with a disconnect may still be writing its row."""
    for _ in range(250):
        rows = [row async for row in Generation.objects.order_by("id")]
        if len(rows) >= count:
            return rows
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {count} rows")


# -- who may scrape -------------------------------------------------------------------------------


async def test_metrics_closed_by_default(settings: Any) -> None:
    settings.QUOTES_METRICS_TOKEN = ""
    settings.QUOTES_METRICS_ALLOW = ()

    response = await request("GET", "/metrics", headers=AUTH)

    assert response.status == 404


async def test_metrics_refused_without_the_token() -> None:
    missing = await request("GET", "/metrics")
    wrong = await request("GET", "/metrics", headers={"authorization": "Bearer not-the-token"})
    not_bearer = await request("GET", "/metrics", headers={"authorization": f"Basic {TOKEN}"})
    right = await request("GET", "/metrics", headers=AUTH)

    assert [missing.status, wrong.status, not_bearer.status] == [403, 403, 403]
    assert b"quotes_" not in missing.body + wrong.body + not_bearer.body
    assert right.status == 200
    assert right.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert right.headers["cache-control"] == "no-store"
    assert Scrape(right.body.decode()).has("quotes_log_rows_lost_total")


async def test_metrics_allow_list_alone_and_with_the_token(settings: Any) -> None:
    settings.QUOTES_METRICS_TOKEN = ""
    settings.QUOTES_METRICS_ALLOW = (ipaddress.ip_network("10.1.2.0/24"), ipaddress.ip_network("::1/128"))

    outside = await request("GET", "/metrics", client=("192.0.2.7", 4000))
    inside = await request("GET", "/metrics", client=("10.1.2.3", 4000))
    loopback_v6 = await request("GET", "/metrics", client=("::1", 4000))
    assert (outside.status, inside.status, loopback_v6.status) == (403, 200, 200)

    settings.QUOTES_METRICS_TOKEN = TOKEN  # both set: a scrape must pass both
    inside_without_token = await request("GET", "/metrics", client=("10.1.2.3", 4000))
    outside_with_token = await request("GET", "/metrics", client=("192.0.2.7", 4000), headers=AUTH)
    inside_with_token = await request("GET", "/metrics", client=("10.1.2.3", 4000), headers=AUTH)
    assert (inside_without_token.status, outside_with_token.status) == (403, 403)
    assert inside_with_token.status == 200


async def test_metrics_off_answers_404_and_records_nothing(
    settings: Any, persona: Persona, fake: FakeWorkersAI
) -> None:
    settings.QUOTES_METRICS_ENABLED = False
    labels = {"transport": "api", "backend": "workers-ai", "model": MODEL, "outcome": "ok", "code": ""}
    before = REGISTRY.get_sample_value("quotes_requests_total", labels) or 0.0

    response = await post_quote()
    scraped = await request("GET", "/metrics", headers=AUTH)

    assert response.status == 200 and response.body.endswith(b"data: [DONE]\n\n")
    assert scraped.status == 404
    assert (REGISTRY.get_sample_value("quotes_requests_total", labels) or 0.0) == before


# -- what the counters say after real streams ----------------------------------------------------


async def test_metrics_ok_stream_on_the_embedded_model_then_a_cache_hit(
    persona: Persona, local_backend: LocalBackend
) -> None:
    before = await scrape()

    first = await post_quote()
    [row] = await wait_for_rows(1)
    middle = await scrape()
    second = await post_quote()  # the same request: replayed from the answer cache
    await wait_for_rows(2)
    after = await scrape()

    assert first.status == 200 and second.status == 200 and row.status == "ok"
    ok = {"transport": "api", "backend": "local", "model": LOCAL_MODEL, "outcome": "ok", "code": ""}
    assert moved(before, middle, "quotes_requests_total", **ok) == 1
    assert moved(before, middle, "quotes_cache_lookups_total", result="miss") == 1
    assert moved(before, middle, "quotes_cache_lookups_total", result="hit") == 0
    miss = {"backend": "local", "model": LOCAL_MODEL, "cache": "miss"}
    assert moved(before, middle, "quotes_time_to_first_token_seconds_count", **miss) == 1
    assert moved(before, middle, "quotes_time_to_first_token_seconds_sum", **miss) == pytest.approx(
        row.ttft_ms / 1000
    )
    assert moved(before, middle, "quotes_stream_duration_seconds_count", backend="local", outcome="ok") == 1
    assert row.prompt_tokens and row.completion_tokens
    tokens = {"backend": "local", "model": LOCAL_MODEL}
    assert moved(before, middle, "quotes_tokens_total", kind="prompt", **tokens) == row.prompt_tokens
    assert moved(before, middle, "quotes_tokens_total", kind="completion", **tokens) == row.completion_tokens

    assert moved(middle, after, "quotes_requests_total", **ok) == 1
    assert moved(middle, after, "quotes_cache_lookups_total", result="hit") == 1
    assert moved(middle, after, "quotes_tokens_total") == 0  # nobody computed the replayed answer
    assert moved(middle, after, "quotes_time_to_first_token_seconds_count", cache="hit") == 1

    assert after.value("quotes_open_streams", transport="api") == before.value(
        "quotes_open_streams", transport="api"
    )
    assert after.value("quotes_local_model_slots") == local_backend.slots
    assert after.value("quotes_local_model_slots_in_use") == 0
    assert after.value("quotes_local_model_queue_length") == 0
    assert after.value("quotes_log_writer_queue_depth") == 0
    assert moved(before, after, "quotes_log_rows_lost_total") == 0


async def test_metrics_error_ok_with_cost_and_rate_limited_on_workers_ai(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    # A fixed window of a day: two requests pass, the third is refused.
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, rate_limit=(2, 86400))
    fake.script(Scenario.model_not_found())
    before = await scrape()

    failed = await post_quote({"persona": persona.slug, "topic": "one"})
    ok = await post_quote({"persona": persona.slug, "topic": "two"})
    limited = await post_quote({"persona": persona.slug, "topic": "three"})
    rows = {row.topic: row for row in await wait_for_rows(3)}
    after = await scrape()

    assert (failed.status, ok.status, limited.status) == (400, 200, 429)
    base = {"transport": "api", "backend": "workers-ai", "model": MODEL}
    assert rows["one"].error_code == "model_not_found"
    assert moved(before, after, "quotes_requests_total", outcome="error", code="model_not_found", **base) == 1
    assert moved(before, after, "quotes_requests_total", outcome="ok", code="", **base) == 1
    assert (
        moved(before, after, "quotes_requests_total", outcome="rate_limited", code="rate_limited", **base)
        == 1
    )
    assert rows["two"].cost_usd
    assert moved(before, after, "quotes_cost_usd_total", backend="workers-ai", model=MODEL) == pytest.approx(
        float(rows["two"].cost_usd)
    )
    assert moved(before, after, "quotes_tokens_total", backend="workers-ai", kind="completion") == (
        rows["two"].completion_tokens
    )
    # The error had no first token; the rate-limited request never reached the cache.
    assert moved(before, after, "quotes_time_to_first_token_seconds_count", backend="workers-ai") == 1
    assert moved(before, after, "quotes_cache_lookups_total", result="miss") == 2


async def test_metrics_cancelled_stream_and_open_streams(persona: Persona, fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    before = await scrape()
    stream = post_stream()
    await stream.start()
    await stream.next_chunk()

    during = await scrape()
    await stream.disconnect()
    [row] = await wait_for_rows(1)
    after = await scrape()

    assert row.status == "cancelled"
    assert moved(before, during, "quotes_open_streams", transport="api") == 1
    assert moved(before, after, "quotes_open_streams", transport="api") == 0
    cancelled = {
        "transport": "api",
        "backend": "workers-ai",
        "outcome": "cancelled",
        "code": "abandoned",
    }  # dropped, no grace in tests
    assert moved(before, after, "quotes_requests_total", **cancelled) == 1
    assert moved(before, after, "quotes_stream_duration_seconds_count", outcome="cancelled") == 1


async def test_metrics_websocket_transport(persona: Persona, fake: FakeWorkersAI) -> None:
    from config.asgi import application

    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    assert (await socket.connect())[0]
    before = await scrape()
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    while (await socket.receive_json_from(timeout=30))["type"] != "token":
        pass

    during = await scrape()
    await socket.send_json_to({"type": "cancel"})
    while (await socket.receive_json_from(timeout=30))["type"] != "cancelled":
        pass
    await socket.disconnect()
    after = await scrape()

    assert moved(before, during, "quotes_open_streams", transport="websocket") == 1
    assert moved(before, after, "quotes_open_streams", transport="websocket") == 0
    assert moved(before, after, "quotes_requests_total", transport="websocket", outcome="cancelled") == 1


async def test_metrics_retries_and_fallback_steps(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_GATEWAY = replace(
        settings.QUOTES_GATEWAY,
        max_attempts=2,
        retry_delay_ms=10,
        fallback_models=[FALLBACK],
    )
    fake.script(Scenario.out_of_capacity(), Scenario.out_of_capacity())
    before = await scrape()

    response = await post_quote()
    await wait_for_rows(1)
    after = await scrape()

    assert response.status == 200 and [r.model for r in fake.requests] == [MODEL, MODEL, FALLBACK]
    assert moved(before, after, "quotes_retries_total", backend="workers-ai", model=MODEL) == 1
    assert moved(before, after, "quotes_retries_total") == 1
    assert moved(before, after, "quotes_fallbacks_total", backend="workers-ai", model=FALLBACK) == 1
    assert moved(before, after, "quotes_fallbacks_total") == 1
    assert moved(before, after, "quotes_requests_total", model=FALLBACK, outcome="ok") == 1


async def test_metrics_coalesced_listeners(persona: Persona, fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_concurrent_streams=10)
    fake.default = Scenario(token_delay_s=0.1)
    before = await scrape()

    responses = await asyncio.gather(*(post_quote() for _ in range(3)))
    rows = await wait_for_rows(3)
    after = await scrape()

    assert [r.status for r in responses] == [200, 200, 200] and len(fake.requests) == 1
    assert moved(before, after, "quotes_coalesced_listeners_total") == 2
    assert moved(before, after, "quotes_cache_lookups_total", result="miss") == 3
    # Only the leader's tokens were computed.
    [leader] = [row for row in rows if row.cache_status == "miss"]
    assert moved(before, after, "quotes_tokens_total", kind="completion") == leader.completion_tokens


async def test_metrics_embedded_model_slots_queue_and_busy(
    persona: Persona, local_backend: LocalBackend
) -> None:
    local_backend.queue_timeout_s = 1.0
    before = await scrape()
    async with slots_held(local_backend, local_backend.slots):
        held = await scrape()
        waiting = asyncio.create_task(post_quote())
        for _ in range(200):
            if local_backend.waiting:
                break
            await asyncio.sleep(0.005)
        queued = await scrape()
        response = await waiting
    await wait_for_rows(1)
    after = await scrape()

    assert held.value("quotes_local_model_slots_in_use") == local_backend.slots
    assert queued.value("quotes_local_model_queue_length") == 1
    assert response.status == 503
    busy = {"backend": "local", "model": LOCAL_MODEL, "outcome": "busy", "code": "busy"}
    assert moved(before, after, "quotes_requests_total", **busy) == 1
    for _ in range(100):  # the held slots free at their next token
        if local_backend.slots_in_use == 0:
            break
        await asyncio.sleep(0.02)
    assert (await scrape()).value("quotes_local_model_slots_in_use") == 0


async def test_metrics_a_row_that_cannot_be_written_is_counted_lost(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """An admin deletes the persona while a visitor's quote streams: its row can no longer be
    inserted (the persona is gone), and the lost-row count says so."""
    fake.script(Scenario(tokens=["tick"] * 20, token_delay_s=0.05))
    before = await scrape()
    stream = post_stream()
    await stream.start()
    await stream.next_chunk()

    await sync_to_async(Persona.objects.filter(pk=persona.pk).delete)()
    await stream.read_all()
    for _ in range(100):
        after = await scrape()
        if moved(before, after, "quotes_log_rows_lost_total"):
            break
        await asyncio.sleep(0.02)

    assert moved(before, after, "quotes_log_rows_lost_total") == 1
    assert after.value("quotes_log_writer_queue_depth") == 0
    assert not await Generation.objects.aexists()


@pytest.mark.parametrize(
    ("transport", "method", "headers"),
    [
        ("eventsource", "GET", {"accept": "text/event-stream"}),
        ("htmx", "POST", {"hx-request": "true", "content-type": "application/json"}),
        ("api", "GET", {"sec-fetch-dest": "empty"}),  # a fetch()
    ],
)
async def test_metrics_requests_by_http_transport(
    persona: Persona, fake: FakeWorkersAI, transport: str, method: str, headers: dict[str, str]
) -> None:
    before = await scrape()

    if method == "GET":
        response = await request(
            "GET", "/api/quotes/stream", query=f"persona={persona.slug}", headers=headers
        )
    else:
        response = await request(
            "POST", "/api/quotes/stream", body=json.dumps({"persona": persona.slug}).encode(), headers=headers
        )
    await wait_for_rows(1)
    after = await scrape()

    assert response.status == 200, response.body
    assert moved(before, after, "quotes_requests_total", transport=transport, outcome="ok") == 1
    assert moved(before, after, "quotes_requests_total", outcome="ok") == 1
