"""`GET /metrics` (quotes/ops/metrics.py): who may scrape it, and what it says after real streams
through the ASGI app, on the embedded model and on the fake Workers AI upstream. Counters are per
process and live for the whole session: each test scrapes before and after and compares."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import re
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.backends.local import LocalBackend
from quotes.models import Generation, Persona
from tests.asgi import StreamedResponse, post_quote, post_stream, request
from tests.conftest import slots_held

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

TOKEN = "metrics-test-token-3f9a1c"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MODEL, FALLBACK = "@cf/meta/llama-3.1-8b-instruct-fp8", "@cf/meta/llama-3.2-3b-instruct"
LOCAL = {"backend": "local", "model": "gemma-3-270m"}


@pytest.fixture(autouse=True)
def _metrics_token(settings: Any) -> None:
    settings.QUOTES_METRICS_ENABLED, settings.QUOTES_METRICS_TOKEN = True, TOKEN
    settings.QUOTES_METRICS_ALLOW = ()


class Scrape:
    """One scrape of /metrics, parsed with prometheus-client's own parser."""

    def __init__(self, text: str) -> None:
        families = text_string_to_metric_families(text)
        self.samples = [(s.name, s.labels, s.value) for family in families for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
        found = [v for n, ls, v in self.samples if n == name and labels.items() <= ls.items()]
        return sum(found)


async def scrape() -> Scrape:
    response = await request("GET", "/metrics", headers=AUTH)
    assert response.status == 200, response.body
    return Scrape(response.body.decode())


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


async def metrics(client: str = "127.0.0.1", **headers: str) -> StreamedResponse:
    return await request("GET", "/metrics", headers=headers, client=(client, 4000))


# -- who may scrape -------------------------------------------------------------------------------


async def test_metrics_need_the_token_or_an_allowed_network_and_both_when_both_are_set(settings: Any) -> None:
    missing, wrong = await metrics(), await metrics(authorization="Bearer not-the-token")
    not_bearer, right = await metrics(authorization=f"Basic {TOKEN}"), await metrics(**AUTH)
    assert [missing.status, wrong.status, not_bearer.status, right.status] == [403, 403, 403, 200]
    assert b"quotes_" not in missing.body + wrong.body + not_bearer.body
    assert right.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert right.headers["cache-control"] == "no-store"
    assert "quotes_log_rows_lost_total" in right.body.decode()

    settings.QUOTES_METRICS_TOKEN = ""  # neither set: there is no such page
    assert (await metrics(**AUTH)).status == 404
    settings.QUOTES_METRICS_ALLOW = (ipaddress.ip_network("10.1.2.0/24"), ipaddress.ip_network("::1/128"))
    assert [(await metrics(ip)).status for ip in ("192.0.2.7", "10.1.2.3", "::1")] == [403, 200, 200]
    settings.QUOTES_METRICS_TOKEN = TOKEN
    assert (await metrics("10.1.2.3")).status == (await metrics("192.0.2.7", **AUTH)).status == 403
    assert (await metrics("10.1.2.3", **AUTH)).status == 200


# -- what it says after real streams --------------------------------------------------------------


async def test_metrics_ok_stream_on_the_embedded_model_then_a_cache_hit(
    persona: Persona, local_backend: LocalBackend
) -> None:
    before = await scrape()
    assert (await post_quote()).status == 200
    row = await Generation.objects.aget()
    middle = await scrape()
    assert (await post_quote()).status == 200  # the same request: replayed from the answer cache
    after = await scrape()

    ok, ttft = {**LOCAL, "outcome": "ok", "code": ""}, {**LOCAL, "cache": "miss"}
    assert moved(before, middle, "quotes_requests_total", **ok) == 1
    assert moved(before, middle, "quotes_cache_lookups_total", result="miss") == 1
    assert moved(before, middle, "quotes_cache_lookups_total", result="hit") == 0
    assert moved(before, middle, "quotes_time_to_first_token_seconds_count", **ttft) == 1
    seconds = moved(before, middle, "quotes_time_to_first_token_seconds_sum", **ttft)
    assert seconds == pytest.approx(row.ttft_ms / 1000)
    assert moved(before, middle, "quotes_stream_duration_seconds_count", backend="local", outcome="ok") == 1
    assert row.prompt_tokens and row.completion_tokens
    assert moved(before, middle, "quotes_tokens_total", kind="prompt", **LOCAL) == row.prompt_tokens
    assert moved(before, middle, "quotes_tokens_total", kind="completion", **LOCAL) == row.completion_tokens

    assert moved(middle, after, "quotes_requests_total", **ok) == 1
    assert moved(middle, after, "quotes_cache_lookups_total", result="hit") == 1
    assert moved(middle, after, "quotes_tokens_total") == 0  # nobody computed the replayed answer
    assert moved(middle, after, "quotes_time_to_first_token_seconds_count", cache="hit") == 1
    assert after.value("quotes_open_streams") == before.value("quotes_open_streams")
    assert 0 <= after.value("quotes_event_loop_lag_seconds") < 10  # what admission reads
    assert after.value("quotes_local_model_slots") == local_backend.slots
    assert after.value("quotes_local_model_slots_in_use") == 0
    assert after.value("quotes_local_model_queue_length") == after.value("quotes_log_rows_waiting") == 0
    assert moved(before, after, "quotes_log_rows_lost_total") == 0


async def test_metrics_error_ok_refused_cost_and_todays_spend_on_workers_ai(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "2/day"  # two requests pass, the third is refused
    settings.QUOTES_DAILY_SPEND_LIMIT_USD = Decimal("5")
    fake.script(Scenario.model_not_found())
    before = await scrape()

    answers = [await post_quote({"persona": persona.slug, "topic": t}) for t in ("one", "two", "three")]
    rows = {row.topic: row async for row in Generation.objects.all()}
    after = await scrape()

    assert [a.status for a in answers] == [502, 200, 429] and set(rows) == {"one", "two"}  # a refusal: no row
    base, cost = {"backend": "workers-ai", "model": MODEL}, rows["two"].cost_usd
    assert moved(before, after, "quotes_requests_total", outcome="error", code="model_not_found", **base) == 1
    assert moved(before, after, "quotes_requests_total", outcome="ok", code="", **base) == 1
    assert moved(before, after, "quotes_refused_total", transport="api", code="rate_limited") == 1
    assert cost and moved(before, after, "quotes_cost_usd_total", **base) == pytest.approx(float(cost))
    completion = moved(before, after, "quotes_tokens_total", backend="workers-ai", kind="completion")
    assert completion == rows["two"].completion_tokens
    # The error had no first token; the refused request never reached the cache.
    assert moved(before, after, "quotes_time_to_first_token_seconds_count", backend="workers-ai") == 1
    assert moved(before, after, "quotes_cache_lookups_total", result="miss") == 2
    assert after.value("quotes_spend_today_usd") == pytest.approx(float(cost), abs=1e-6)
    assert after.value("quotes_spend_ceiling_usd") == 5

    settings.QUOTES_DAILY_SPEND_LIMIT_USD = None
    assert math.isnan((await scrape()).value("quotes_spend_ceiling_usd"))


async def test_metrics_open_streams_and_a_dropped_stream(persona: Persona, fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    before = await scrape()
    stream = post_stream()
    await stream.start()
    await stream.next_chunk()

    during = await scrape()
    await stream.disconnect()
    for _ in range(250):  # the generation ends, and its row is completed, just after the drop
        row = await Generation.objects.aget()
        if row.status != Generation.Status.RUNNING:
            break
        await asyncio.sleep(0.02)
    after = await scrape()

    assert (row.status, row.error_code) == ("cancelled", "abandoned")  # dropped, no grace in tests
    assert moved(before, during, "quotes_open_streams") == 1
    assert moved(before, after, "quotes_open_streams") == 0
    assert moved(before, after, "quotes_requests_total", outcome="cancelled", code="abandoned") == 1
    assert moved(before, after, "quotes_stream_duration_seconds_count", outcome="cancelled") == 1


async def test_metrics_fallbacks(persona: Persona, fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_POLICY = replace(settings.QUOTES_POLICY, max_attempts=2)
    settings.QUOTES_FALLBACK_MODELS = [FALLBACK]
    fake.script(Scenario.out_of_capacity(), Scenario.out_of_capacity())
    before = await scrape()

    response = await post_quote()
    after = await scrape()

    assert response.status == 200 and [r.model for r in fake.requests] == [MODEL, MODEL, FALLBACK]
    assert moved(before, after, "quotes_fallbacks_total", backend="workers-ai", model=FALLBACK) == 1
    assert moved(before, after, "quotes_fallbacks_total") == 1
    assert moved(before, after, "quotes_requests_total", model=FALLBACK, outcome="ok") == 1


async def test_metrics_embedded_model_slots_queue_and_busy(persona: Any, local_backend: LocalBackend) -> None:
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
    after = await scrape()

    assert held.value("quotes_local_model_slots_in_use") == local_backend.slots
    assert queued.value("quotes_local_model_queue_length") == 1
    assert response.status == 503 and response.json()["error"]["code"] == "busy"
    assert moved(before, after, "quotes_requests_total", outcome="error", code="busy", **LOCAL) == 1
    for _ in range(100):  # the held slots free at their next token
        if local_backend.slots_in_use == 0:
            break
        await asyncio.sleep(0.02)
    assert (await scrape()).value("quotes_local_model_slots_in_use") == 0


async def test_the_grafana_dashboard_queries_only_metrics_that_are_exported(
    local_backend: LocalBackend,
) -> None:
    response = await request("GET", "/metrics", headers=AUTH)
    exported = set()
    for family in text_string_to_metric_families(response.body.decode()):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        exported |= {family.name + suffix for suffix in suffixes}
    dashboard = (Path(__file__).parents[2] / "deploy/grafana/persona-quotes.json").read_text()
    queried = set(re.findall(r"\b(?:quotes|process)_[a-z_]+", dashboard))
    assert "quotes_spend_today_usd" in queried and queried <= exported, queried - exported
