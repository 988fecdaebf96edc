"""The stream, through the real ASGI app against the fake Workers AI upstream (a real HTTP server
on 127.0.0.1): the wire formats, the row of every generation, the answer cache, coalescing,
retries and fallbacks, deadlines and keep-alive."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from streaming import Policy

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.models import Generation, Persona
from quotes.services import persona_save
from tests.asgi import htmx_form_post, parse_sse, post_quote, post_stream, read_events, request, without_ids
from tests.fixtures import saved

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
FALLBACK = "@cf/meta/llama-3.2-3b-instruct"
TEXT = "Stay hungry, stay foolish."


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    await saved(persona, model=MODEL)
    return fake


async def rows() -> list[Generation]:
    return [row async for row in Generation.objects.order_by("created_at")]


def tokens(body: bytes) -> str:
    return "".join(json.loads(e["data"])["response"] for e in parse_sse(body) if e["data"].startswith("{"))


async def test_post_streams_workers_ai_wire_format_and_logs_one_row(fake: FakeWorkersAI) -> None:
    response = await post_quote({"persona": "test-watts", "topic": "rain"})
    assert response.status == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-quote-model"] == MODEL
    events = parse_sse(response.body)
    assert tokens(response.body) == TEXT
    assert json.loads(events[-2]["data"])["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 6,
        "total_tokens": 18,
    }
    assert events[-1]["data"] == "[DONE]"
    [row] = await rows()
    assert (row.status, row.cache_status, row.model, row.text) == ("ok", "miss", MODEL, TEXT)
    assert (row.prompt_tokens, row.completion_tokens) == (12, 6)
    assert row.cost_usd is not None and row.cost_usd > 0
    assert row.ttft_ms is not None and row.duration_ms is not None and row.ttft_ms <= row.duration_ms
    assert str(row.public_id) == response.headers["x-quote-id"]
    assert fake.requests[0].json["stream"] is True


async def test_a_row_says_running_while_its_generation_streams(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["tick"] * 30, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 2)
    for _ in range(25):  # the insert follows the first token, off its path
        if written := await rows():
            break
        await asyncio.sleep(0.02)
    [row] = written
    assert row.status == Generation.Status.RUNNING
    await stream.read_all()
    [row] = await rows()
    assert row.status == Generation.Status.OK and row.text == "tick" * 30


async def test_eventsource_get_starts_with_retry_and_ends_with_done(fake: FakeWorkersAI) -> None:
    response = await request(
        "GET", "/api/quotes/stream", query="persona=test-watts", headers={"accept": "text/event-stream"}
    )
    assert response.status == 200
    assert response.body.startswith(b"id: ") and b"retry: 1000" in response.body.split(b"\n\n")[0]
    events = parse_sse(response.body)
    assert (
        events[-1]["event"] == "done"
        and json.loads(events[-1]["data"])["id"] == response.headers["x-quote-id"]
    )


async def test_htmx_form_gets_escaped_fragments_and_named_events(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["<b>", " & ", "x"]))
    response = await htmx_form_post({"persona": "test-watts"})
    events = parse_sse(response.body)
    assert events[0]["event"] == "meta" and json.loads(events[0]["data"])["model"] == MODEL
    assert "".join(e["data"] for e in events if e["event"] == "message") == "&lt;b&gt; &amp; x"
    assert events[-1]["event"] == "done"


async def test_an_error_before_any_text_has_its_real_status_and_a_row(fake: FakeWorkersAI) -> None:
    fake.script(Scenario.model_not_found())
    response = await post_quote()
    assert response.status == 502
    assert response.json()["error"]["code"] == "model_not_found"
    [row] = await rows()
    assert (row.status, row.error_code) == ("error", "model_not_found")


async def test_an_error_after_text_is_an_error_event_and_the_row_keeps_the_text(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["Half", " a"], drop_after_tokens=2))
    response = await post_quote()
    assert response.status == 200
    events = parse_sse(response.body)
    assert (
        events[-1]["event"] == "error"
        and json.loads(events[-1]["data"])["error"]["code"] == "upstream_dropped"
    )
    [row] = await rows()
    assert (row.status, row.error_code, row.text) == ("error", "upstream_dropped", "Half a")


async def test_cache_replays_an_answer_as_a_stream_and_fresh_bypasses_it(fake: FakeWorkersAI) -> None:
    first = await post_quote()
    second = await post_quote()
    fresh = await post_quote({"persona": "test-watts", "fresh": True})
    assert len(fake.requests) == 2  # the first and the fresh one
    assert second.headers["cf-aig-cache-status"] == "HIT"
    assert without_ids(second.body) == without_ids(first.body)
    assert len(second.chunks) > 3  # a stream, not one write
    statuses = [(row.cache_status, row.cost_usd) for row in await rows()]
    assert statuses[1] == ("hit", None) and statuses[0][0] == "miss" and statuses[2][0] == "bypass"
    assert tokens(fresh.body) == TEXT


async def test_cache_keeps_only_complete_answers_and_follows_the_persona_ttl(
    fake: FakeWorkersAI, persona: Persona
) -> None:
    fake.script(Scenario(drop_after_tokens=2))
    await post_quote()
    await post_quote()
    assert len(fake.requests) == 2  # the broken answer was not kept
    persona.cache_ttl = 0
    await sync_to_async(persona_save)(persona=persona)
    await post_quote()
    await post_quote()
    assert len(fake.requests) == 4
    assert [row.cache_status for row in await rows()][-2:] == ["bypass", "bypass"]


async def test_identical_requests_in_flight_make_one_upstream_call(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["a", "b", "c", "d"], token_delay_s=0.05))
    first = post_stream()
    await read_events(first, 1)
    second = post_stream()
    await second.start()
    done = await asyncio.gather(first.read_all(), second.read_all())
    assert len(fake.requests) == 1
    assert [tokens(response.body) for response in done] == ["abcd", "abcd"]
    assert done[1].headers["cf-aig-cache-status"] == "HIT"
    assert sorted(row.cache_status for row in await rows()) == ["hit", "miss"]


async def test_a_joiner_keeps_the_upstream_when_the_first_client_leaves(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["tick"] * 20, token_delay_s=0.02))
    first = post_stream()
    await read_events(first, 1)
    second = post_stream()
    await read_events(second, 1)
    await first.disconnect()
    response = await second.read_all()
    assert tokens(response.body) == "tick" * 20
    assert len(fake.requests) == 1 and not fake.requests[0].client_disconnected.is_set()


async def test_retries_then_falls_back_before_the_first_token_only(
    fake: FakeWorkersAI, persona: Persona, settings: Any
) -> None:
    settings.QUOTES_POLICY = Policy(max_attempts=2, retry_delay_s=0.01, ttft_timeout_s=5, idle_timeout_s=2)
    persona.fallback_models = [FALLBACK]
    await sync_to_async(persona_save)(persona=persona)
    fake.script(Scenario.server_error(503), Scenario.out_of_capacity(), Scenario(tokens=["Saved"]))
    response = await post_quote()
    assert tokens(response.body) == "Saved"
    assert [r.model for r in fake.requests] == [MODEL, MODEL, FALLBACK]
    [row] = await rows()
    assert (row.model, row.fallback_step) == (FALLBACK, 1)
    fake.script(Scenario(tokens=["Half"], drop_after_tokens=1))
    response = await post_quote({"persona": "test-watts", "fresh": True})
    assert len(fake.requests) == 4  # no retry once text flowed
    assert parse_sse(response.body)[-1]["event"] == "error"


async def test_out_of_capacity_is_retried_after_cloudflares_retry_after_then_falls_back(
    fake: FakeWorkersAI, persona: Persona, settings: Any
) -> None:
    settings.QUOTES_POLICY = Policy(max_attempts=2, retry_delay_s=0.01, ttft_timeout_s=5, idle_timeout_s=2)
    await saved(persona, fallback_models=[FALLBACK])
    fake.script(*[Scenario.out_of_capacity(retry_after=1)] * 2, Scenario(tokens=["Saved"]))
    assert tokens((await post_quote()).body) == "Saved"
    first, second, third = fake.requests
    assert [first.model, second.model, third.model] == [MODEL, MODEL, FALLBACK]
    assert second.received_at - first.received_at >= 1  # Cloudflare's Retry-After, not our 10 ms
    # A Retry-After past the first-token deadline: the next model at once.
    settings.QUOTES_POLICY = Policy(max_attempts=2, retry_delay_s=0.01, ttft_timeout_s=3, idle_timeout_s=2)
    fake.script(Scenario.out_of_capacity(retry_after=30), Scenario(tokens=["Next"]))
    assert tokens((await post_quote({"persona": "test-watts", "fresh": True})).body) == "Next"
    assert [r.model for r in fake.requests[3:]] == [MODEL, FALLBACK]


async def test_a_persona_on_a_retired_model_streams_from_its_fallback_with_one_warning(
    fake: FakeWorkersAI, persona: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    """As a database from before the refresh holds it (the admin's form refuses a retired model):
    Workers AI answers 5007 for it, before any text, and the fallback serves."""
    retired = "@cf/meta/llama-3.1-8b-instruct"
    await Persona.objects.filter(pk=persona.pk).aupdate(model=retired, fallback_models=[FALLBACK])
    for topic in ("one", "two", "three"):
        response = await post_quote({"persona": "test-watts", "topic": topic})
        assert (response.status, tokens(response.body)) == (200, TEXT)
        assert response.headers["x-quote-model"] == FALLBACK and response.headers["cf-aig-step"] == "1"
    assert [r.model for r in fake.requests] == [retired, FALLBACK] * 3
    warned = [r for r in caplog.records if r.name == "quotes.backends.workers_ai"]
    assert (
        len(warned) == 1 and "model_not_found" in warned[0].getMessage() and retired in warned[0].getMessage()
    )
    assert [(row.model, row.fallback_step, row.status) for row in await rows()] == [(FALLBACK, 1, "ok")] * 3

    # With no fallback: a clear error, its own code, never a 500.
    await Persona.objects.filter(pk=persona.pk).aupdate(fallback_models=[])
    response = await post_quote({"persona": "test-watts", "topic": "four"})
    assert response.status == 502
    assert response.json()["error"] == {
        "code": "model_not_found",
        "message": "This persona's model is not offered by Workers AI any more. The site's admins have been told.",
    }


async def test_deadlines_first_token_and_idle(fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_POLICY = Policy(max_attempts=1, ttft_timeout_s=0.3, idle_timeout_s=0.3, total_timeout_s=5)
    fake.script(Scenario(stall_before_s=3))
    response = await post_quote()
    assert (response.status, response.json()["error"]["code"]) == (504, "upstream_timeout")
    fake.script(Scenario(tokens=["a", "b"], stall_after_tokens=1, stall_s=3))
    response = await post_quote({"persona": "test-watts", "fresh": True})
    assert parse_sse(response.body)[-1]["event"] == "error"
    assert b"idle_timeout" in response.body
    assert [row.error_code for row in await rows()] == ["upstream_timeout", "idle_timeout"]


async def test_keepalive_pings_while_the_model_stalls_mid_stream(fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_KEEPALIVE_S = 0.1
    fake.script(Scenario(tokens=["a", "b"], stall_after_tokens=1, stall_s=0.45))
    response = await post_quote()
    assert response.body.count(b": ping\n\n") >= 2
    assert tokens(response.body.replace(b": ping\n\n", b"")) == "ab"


async def test_a_drop_stops_the_upstream_and_the_row_says_abandoned(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 2)
    await stream.disconnect()
    fake.requests[0].client_disconnected.wait(5)
    assert fake.requests[0].client_disconnected.is_set()
    await asyncio.sleep(0.2)
    [row] = await rows()
    assert (row.status, row.error_code) == ("cancelled", "abandoned")
    assert row.text.startswith("tick")


async def test_an_over_budget_day_refuses_paid_generations_but_serves_cached_ones(
    fake: FakeWorkersAI, settings: Any
) -> None:
    await post_quote()  # costs something, and is cached
    settings.QUOTES_DAILY_SPEND_LIMIT_USD = Decimal("0.000001")
    cached = await post_quote()
    assert cached.status == 200 and cached.headers["cf-aig-cache-status"] == "HIT"
    refused = await post_quote({"persona": "test-watts", "fresh": True})
    assert refused.status == 503 and refused.json()["error"]["code"] == "budget_exhausted"
    assert 0 < int(refused.headers["retry-after"]) <= 86400
    assert len(fake.requests) == 1
