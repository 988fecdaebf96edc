"""The app's own gateway (quotes/ai/gateway.py), through the real stream endpoint and the real ASGI
app: the request log, the answer cache, coalescing, rate limits, retries, fallbacks, timeouts and
keep-alive. Upstream is the fake Workers AI server (a real HTTP server on 127.0.0.1) or, where
stated, the embedded model; the cache is LocMem, or a real redis-server for the Redis tests.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import hmac
import io
import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings
from django.core.cache import cache
from django.utils import timezone

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import backend_for, get_backend, reset_backends
from quotes.ai.backends.local import LocalBackend
from quotes.ai.cache import answer_key
from quotes.ai.catalog import estimate_cost
from quotes.ai.events import Done, Token
from quotes.ai.gateway.policy import Plan, generate
from quotes.ai.gateway.runs import flights
from quotes.models import Generation, Persona
from quotes.services import persona_save
from tests.abuse.test_redis_limits import logged
from tests.asgi import (
    StreamedResponse,
    parse_sse,
    post_quote,
    post_stream,
    read_events,
    request,
    without_ids,
)
from tests.conftest import slots_held
from tests.fixtures import upstream_configs
from tests.limits import at_start_of_window, configure

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "@cf/meta/llama-3.1-8b-instruct"
FALLBACK = "@cf/meta/llama-3.2-3b-instruct"
LOCAL_MODEL = "gemma-3-270m"
DEFAULT_TOKENS = ("Stay", " hungry", ",", " stay", " foolish", ".")
DEFAULT_TEXT = "Stay hungry, stay foolish."
DEFAULT_USAGE = (12, 6)
HEX32 = re.compile(r"[0-9a-f]{32}")
PING = b": ping\n\n"


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    """The workers-ai backend against the fake; its httpx client is closed on the test's loop."""
    yield fake_workers_ai
    await reset_backends()


@pytest.fixture(autouse=True)
async def _no_flight_left_behind() -> AsyncIterator[None]:
    """Every flight (a generation shared by listeners) must be gone once its requests are."""
    yield
    for _ in range(100):
        if not flights:
            break
        await asyncio.sleep(0.02)
    left = dict(flights)
    for flight in left.values():
        if flight.task is not None:
            flight.task.cancel()
    flights.clear()
    assert not left, f"flights still registered after the test: {list(left)}"


@dataclass
class Upstream:
    """What answers the persona, and how many times it was asked."""

    name: str
    model: str
    calls: Callable[[], int]
    fake: FakeWorkersAI | None = None


def local_calls(backend: LocalBackend) -> Callable[[], int]:
    """Jobs started on the embedded model since now (its `jobs` list is bounded: count by identity)."""
    marker = backend.jobs[-1] if backend.jobs else None

    def calls() -> int:
        jobs = backend.jobs
        if marker is None:
            return len(jobs)
        for index, job in enumerate(jobs):
            if job is marker:
                return len(jobs) - index - 1
        return len(jobs)

    return calls


@pytest.fixture(params=["workers-ai", "local"])
def upstream(request: pytest.FixtureRequest) -> Upstream:
    if request.param == "workers-ai":
        fake_server: FakeWorkersAI = request.getfixturevalue("fake")
        return Upstream("workers-ai", MODEL, lambda: len(fake_server.requests), fake_server)
    backend: LocalBackend = request.getfixturevalue("local_backend")
    return Upstream("local", LOCAL_MODEL, local_calls(backend))


# -- helpers ------------------------------------------------------------------------------------


async def use_workers_ai(settings: Any, fake_server: FakeWorkersAI, **overrides: Any) -> None:
    settings.WORKERS_AI, settings.AI_HTTP = upstream_configs(fake_server, **overrides)
    await reset_backends()


def without_pings(body: bytes) -> bytes:
    return body.replace(PING, b"")


def events_of(body: bytes) -> list[dict[str, str]]:
    return parse_sse(without_pings(body))


def text_of(body: bytes) -> str:
    """The quote in an SSE body (token events only; usage, [DONE] and errors ignored)."""
    text = ""
    for event in events_of(body):
        if event["event"] != "message" or event["data"] == "[DONE]":
            continue
        text += json.loads(event["data"]).get("response", "")
    return text


def assert_complete(response: StreamedResponse) -> None:
    assert response.status == 200, response.body
    assert response.headers["content-type"] == "text/event-stream"
    assert response.body.endswith(b"data: [DONE]\n\n"), response.body[-200:]


def assert_error_event(response: StreamedResponse, code: str) -> dict[str, str]:
    assert response.status == 200
    assert b"[DONE]" not in response.body
    *_, last = events_of(response.body)
    assert last["event"] == "error", response.body
    error = json.loads(last["data"])["error"]
    assert error["code"] == code, error
    assert error["message"]
    return error


def assert_json_error(response: StreamedResponse, status: int, code: str) -> str:
    assert response.status == status, response.body
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert payload["error"]["code"] == code, payload
    assert payload["error"]["message"]
    return str(payload["error"]["message"])


def cost_of(model: str, prompt: int, completion: int) -> Decimal | None:
    estimate = estimate_cost(model, prompt, completion)
    return None if estimate is None else Decimal(str(round(estimate, 8)))


def ip_hash(ip: str) -> str:
    return hmac.new(django_settings.SECRET_KEY.encode(), ip.encode(), hashlib.sha256).hexdigest()[:32]


async def rows() -> list[Generation]:
    return [row async for row in Generation.objects.order_by("id")]


async def wait_for_rows(count: int, timeout_s: float = 5.0) -> list[Generation]:
    """For requests that ended with a disconnect: their handler may still be writing the row."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await rows()
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) == count, [(r.status, r.text) for r in found]
            return found
        await asyncio.sleep(0.02)


async def save(persona: Persona) -> None:
    """Save the persona as an editor does (a new version when its generation settings changed)."""
    await sync_to_async(persona_save)(persona=persona)


async def latest_version_id(persona: Persona) -> int:
    version = await persona.versions.order_by("-number").afirst()
    assert version is not None
    return version.pk


def answer_keys_in_locmem() -> list[str]:
    from django.core.cache.backends.locmem import _caches

    return [key for store in _caches.values() for key in store if "quotes:answer:" in key]


async def five_identical_at_once(settings: Any, fake: FakeWorkersAI) -> list[StreamedResponse]:
    """Five identical requests at once on a slow upstream: one upstream call, and five complete
    answers that differ only in their event ids."""
    configure(settings, max_concurrent_streams=10)
    fake.default = Scenario(token_delay_s=0.1)

    responses = await asyncio.gather(*(post_quote() for _ in range(5)))

    assert len(fake.requests) == 1
    for response in responses:
        assert_complete(response)
        assert without_ids(response.body) == without_ids(responses[0].body)
    return responses


# -- 1. the request log --------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
async def test_log_ok_row_has_every_field_by_the_time_done_is_read(
    persona: Persona, upstream: Upstream
) -> None:
    persona.system_prompt = "You are Alan Watts, the philosopher"
    await save(persona)  # a second version: the row must point at the latest
    started = timezone.now()

    response = await post_quote(client=("203.0.113.7", 4242))

    assert_complete(response)
    [row] = await rows()  # no sleep: the row is written before [DONE] goes out
    assert row.status == Generation.Status.OK
    assert row.persona_id == persona.pk
    assert row.persona_version_id == await latest_version_id(persona)
    assert (await persona.versions.acount()) == 2
    assert row.backend == upstream.name
    assert row.model == upstream.model
    assert row.fallback_step == 0
    assert row.cache_status == Generation.CacheStatus.MISS
    assert row.text == text_of(response.body) != ""
    usage = json.loads(events_of(response.body)[-2]["data"])["usage"]
    assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    if upstream.name == "workers-ai":
        assert (row.prompt_tokens, row.completion_tokens) == DEFAULT_USAGE
    expected_cost = cost_of(row.model, row.prompt_tokens, row.completion_tokens)
    assert row.cost_usd == expected_cost
    assert isinstance(row.cost_usd, Decimal)
    if upstream.name == "workers-ai":
        assert row.cost_usd > 0
    assert row.ttft_ms is not None and row.duration_ms is not None
    assert 0 < row.ttft_ms <= row.duration_ms
    assert HEX32.fullmatch(row.client_hash)
    assert "203.0.113.7" not in row.client_hash
    assert row.client_hash == ip_hash("203.0.113.7")
    assert row.client_hash != hashlib.sha256(b"203.0.113.7").hexdigest()[:32]  # salted
    assert started - timedelta(seconds=1) <= row.created_at <= timezone.now()
    assert (row.error_code, row.error_message) == ("", "")


@pytest.mark.integration
@pytest.mark.services
async def test_log_error_row_has_the_code_and_message(persona: Persona, fake: FakeWorkersAI) -> None:
    fake.script(Scenario.server_error(503))

    response = await post_quote()

    message = assert_json_error(response, 502, "upstream_unavailable")
    [row] = await rows()
    assert row.status == Generation.Status.ERROR
    assert (row.error_code, row.error_message) == ("upstream_unavailable", message)
    assert row.text == ""
    assert row.backend == "workers-ai" and row.model == MODEL
    assert row.persona_version_id == await latest_version_id(persona)
    assert row.cost_usd is None and row.ttft_ms is None
    assert HEX32.fullmatch(row.client_hash)


@pytest.mark.integration
@pytest.mark.services
async def test_log_cancelled_row_keeps_the_partial_text_and_closes_the_upstream(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    stream = post_stream()
    received = await read_events(stream, 3)

    disconnected_at = time.monotonic()
    await stream.disconnect()

    [upstream_request] = fake.requests
    assert await asyncio.to_thread(upstream_request.client_disconnected.wait, 5)
    assert upstream_request.disconnected_at is not None
    assert upstream_request.disconnected_at - disconnected_at < 2.0
    [row] = await wait_for_rows(1)
    assert row.status == Generation.Status.CANCELLED
    assert row.text.startswith(text_of(received + b"data: [DONE]\n\n")) and row.text.startswith("ticktick")
    assert row.text == "tick" * (len(row.text) // 4) and len(row.text) < 4 * 300
    assert row.error_code == "abandoned"  # dropped, nobody resumed (no grace in the tests)
    assert row.persona_version_id == await latest_version_id(persona)
    assert row.ttft_ms is not None and row.duration_ms is not None and row.ttft_ms <= row.duration_ms


@pytest.mark.integration
async def test_log_busy_row_on_the_embedded_model(
    persona: Persona, local_backend: LocalBackend, settings: Any
) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=40)
    local_backend.queue_timeout_s = 0.05
    async with slots_held(local_backend, local_backend.slots - 1):
        first = post_stream()
        await read_events(first, 1)  # the last free slot is taken now

        # Another topic: an identical request would share the first one's generation.
        second = await post_quote({"persona": persona.slug, "topic": "rest"})

    assert_json_error(second, 503, "busy")
    finished = await first.read_all()
    assert_complete(finished)
    logged = await rows()
    assert len(logged) == 2
    statuses = {row.topic: row for row in logged}
    busy = statuses["rest"]
    assert busy.status == Generation.Status.BUSY
    assert busy.error_code == "busy" and busy.backend == "local" and busy.model == LOCAL_MODEL
    assert statuses["hard honest work"].status == Generation.Status.OK


# -- 2. the answer cache ----------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
async def test_cache_second_identical_request_is_a_hit_replayed_as_the_same_stream(
    persona: Persona, upstream: Upstream
) -> None:
    first = await post_quote()
    calls_after_first = upstream.calls()
    second = await post_quote()

    assert_complete(first)
    assert_complete(second)
    assert calls_after_first == 1
    assert upstream.calls() == 1  # nothing reached the upstream the second time
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert second.headers["cf-aig-cache-status"] == "HIT"
    assert without_ids(second.body) == without_ids(first.body)  # same wire format, same text, same usage
    assert second.headers["x-quote-model"] == first.headers["x-quote-model"] == upstream.model
    miss, hit = await rows()
    assert (miss.cache_status, hit.cache_status) == ("miss", "hit")
    assert hit.status == Generation.Status.OK
    assert hit.cost_usd == Decimal(0)
    assert hit.text == miss.text == text_of(first.body)
    assert hit.model == miss.model == upstream.model
    assert (hit.prompt_tokens, hit.completion_tokens) == (miss.prompt_tokens, miss.completion_tokens)
    assert hit.persona_version_id == miss.persona_version_id


@pytest.mark.integration
@pytest.mark.services
async def test_cache_fresh_true_bypasses_the_cache(persona: Persona, upstream: Upstream) -> None:
    first = await post_quote()
    fresh = await post_quote({"persona": persona.slug, "fresh": True})

    assert_complete(fresh)
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert fresh.headers["cf-aig-cache-status"] == "BYPASS"
    assert upstream.calls() == 2
    assert [row.cache_status for row in await rows()] == ["miss", "bypass"]


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize("how", ["persona-ttl-0", "skip_cache"])
async def test_cache_can_be_turned_off(
    persona: Persona, fake: FakeWorkersAI, settings: Any, how: str
) -> None:
    if how == "persona-ttl-0":
        persona.cache_ttl = 0
        await save(persona)
    else:
        configure(settings, skip_cache=True)

    first = await post_quote()
    second = await post_quote()

    assert_complete(first)
    assert_complete(second)
    assert first.headers["cf-aig-cache-status"] == second.headers["cf-aig-cache-status"] == "BYPASS"
    assert len(fake.requests) == 2
    assert answer_keys_in_locmem() == []
    assert [row.cache_status for row in await rows()] == ["bypass", "bypass"]


@pytest.mark.integration
@pytest.mark.services
async def test_cache_uses_the_persona_ttl_override(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    # Read the expiry from the in-memory cache (the Redis variant checks Redis's own TTL).
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "persona-quotes"}
    }
    persona.cache_ttl = 120
    await save(persona)

    await post_quote()

    [key] = answer_keys_in_locmem()
    expires_in = cache._expire_info[key] - time.time()  # type: ignore[attr-defined]
    assert 100 < expires_in <= 121
    assert (await post_quote()).headers["cf-aig-cache-status"] == "HIT"


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize("fault", ["upstream-drop", "client-disconnect", "upstream-error"])
async def test_cache_stores_only_complete_answers(persona: Persona, fake: FakeWorkersAI, fault: str) -> None:
    if fault == "upstream-drop":
        fake.script(Scenario(drop_after_tokens=2))
        assert_error_event(await post_quote(), "upstream_dropped")
    elif fault == "client-disconnect":
        fake.script(Scenario(tokens=["tick"] * 100, token_delay_s=0.02))
        stream = post_stream()
        await read_events(stream, 2)
        await stream.disconnect()
        await asyncio.to_thread(fake.requests[0].client_disconnected.wait, 5)
        await wait_for_rows(1)
    else:
        fake.script(Scenario.server_error(503))
        assert_json_error(await post_quote(), 502, "upstream_unavailable")

    after = await post_quote()

    assert_complete(after)
    assert after.headers["cf-aig-cache-status"] == "MISS"
    assert text_of(after.body) == DEFAULT_TEXT
    assert len(fake.requests) == 2
    assert [row.cache_status for row in await rows()] == ["miss", "miss"]


@pytest.mark.integration
@pytest.mark.services
async def test_cache_local_disconnect_is_not_stored(persona: Persona, local_backend: LocalBackend) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=200)
    calls = local_calls(local_backend)
    stream = post_stream()
    await read_events(stream, 1)
    await stream.disconnect()
    [cancelled] = await wait_for_rows(1)
    assert cancelled.status == Generation.Status.CANCELLED

    after = await post_quote()

    assert_complete(after)
    assert after.headers["cf-aig-cache-status"] == "MISS"
    assert calls() == 2


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize("change", ["system-prompt", "fallback-models"])
async def test_cache_a_new_persona_version_is_a_miss(
    persona: Persona, fake: FakeWorkersAI, change: str
) -> None:
    first = await post_quote()
    if change == "system-prompt":
        persona.system_prompt = "You are Alan Watts, speaking softly"
    else:
        persona.fallback_models = [FALLBACK]  # same request to the primary model, new version
    await save(persona)

    second = await post_quote()

    assert first.headers["cf-aig-cache-status"] == second.headers["cf-aig-cache-status"] == "MISS"
    assert len(fake.requests) == 2
    one, two = await rows()
    assert one.persona_version_id != two.persona_version_id == await latest_version_id(persona)
    assert (await post_quote()).headers["cf-aig-cache-status"] == "HIT"  # the new version is cached in turn


@pytest.mark.integration
@pytest.mark.services
async def test_cache_hit_is_replayed_with_pacing(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, replay_pacing_ms=50)
    await post_quote()

    hit = await post_quote()

    assert hit.headers["cf-aig-cache-status"] == "HIT"
    assert_complete(hit)
    n = len(DEFAULT_TOKENS)
    assert len(hit.chunks) >= n  # several chunks, not one buffered body
    spread = hit.chunk_times[-1] - hit.chunk_times[0]
    assert spread >= 0.8 * (n - 1) * 0.05, spread


@pytest.mark.integration
@pytest.mark.services
async def test_cache_an_answer_kept_in_the_old_format_is_a_miss(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """An answer a release before this one kept (its model, token texts, usage and step, not an
    event list) reads as a miss after the deploy, logged once: asked afresh and kept anew."""
    await post_quote()
    key = answer_key(
        backend=backend_for(persona).name,
        request=persona.build_request(topic=persona.default_topic),
        version_id=await latest_version_id(persona),
    )
    assert await cache.aget(key) is not None  # the app's own key
    old = {
        "model": MODEL,
        "tokens": list(DEFAULT_TOKENS),
        "prompt_tokens": 12,
        "completion_tokens": 6,
        "step": 0,
    }
    await cache.aset(key, old)

    with logged("quotes", "django") as records:
        again = await post_quote()

    assert_complete(again)
    assert again.headers["cf-aig-cache-status"] == "MISS"
    assert len(fake.requests) == 2
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == [
        "an answer in the cache has an unexpected shape: read as a miss"
    ]
    assert (await post_quote()).headers["cf-aig-cache-status"] == "HIT"
    assert len(fake.requests) == 2


# -- 3. coalescing --------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
async def test_coalescing_identical_concurrent_requests_share_one_upstream_call(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    responses = await five_identical_at_once(settings, fake)

    assert text_of(responses[0].body) == DEFAULT_TEXT
    statuses = sorted(response.headers["cf-aig-cache-status"] for response in responses)
    assert statuses == ["HIT", "HIT", "HIT", "HIT", "MISS"]
    logged = await rows()
    assert len(logged) == 5
    assert sorted(row.cache_status for row in logged) == ["hit", "hit", "hit", "hit", "miss"]
    assert all(row.status == Generation.Status.OK and row.text == DEFAULT_TEXT for row in logged)
    [miss] = [row for row in logged if row.cache_status == "miss"]
    assert miss.cost_usd == cost_of(MODEL, *DEFAULT_USAGE)
    assert all(row.cost_usd == 0 for row in logged if row.cache_status == "hit")


@pytest.mark.integration
@pytest.mark.services
async def test_log_every_coalesced_listener_leaves_its_row(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """Ten listeners of one flight all finish at the same instant, each writing its row from its
    own request thread: none may be lost (a failed write is only logged by `_shielded`)."""
    configure(settings, max_concurrent_streams=20)
    fake.default = Scenario(token_delay_s=0.05)

    responses = await asyncio.gather(*(post_quote() for _ in range(10)))

    assert all(response.body.endswith(b"data: [DONE]\n\n") for response in responses)
    assert len(await rows()) == 10


@pytest.mark.integration
@pytest.mark.services
async def test_coalescing_a_late_joiner_gets_the_whole_text_from_the_start(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    fake.script(Scenario(token_delay_s=0.1))
    leader = post_stream()
    await read_events(leader, 2)

    joiner = await post_quote()
    led = await leader.read_all()

    assert len(fake.requests) == 1
    assert_complete(joiner)
    assert without_ids(joiner.body) == without_ids(led.body)
    assert text_of(joiner.body) == DEFAULT_TEXT
    assert joiner.headers["cf-aig-cache-status"] == "HIT"
    assert sorted(row.cache_status for row in await rows()) == ["hit", "miss"]


@pytest.mark.integration
@pytest.mark.services
async def test_coalescing_all_listeners_gone_closes_the_upstream(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    first = post_stream()
    await read_events(first, 2)
    second = post_stream()
    await read_events(second, 2)
    [upstream_request] = fake.requests

    await first.disconnect()
    await asyncio.sleep(0.2)
    assert not upstream_request.client_disconnected.is_set()  # one listener is still reading
    disconnected_at = time.monotonic()
    await second.disconnect()

    assert await asyncio.to_thread(upstream_request.client_disconnected.wait, 5)
    assert upstream_request.disconnected_at is not None
    assert upstream_request.disconnected_at - disconnected_at < 2.0
    logged = await wait_for_rows(2)
    assert [row.status for row in logged] == ["cancelled", "cancelled"]
    assert len(fake.requests) == 1


@pytest.mark.integration
@pytest.mark.services
async def test_coalescing_one_listener_leaving_does_not_stop_the_other(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    fake.script(Scenario(token_delay_s=0.1))
    leaving = post_stream()
    await read_events(leaving, 1)
    staying = post_stream()
    await read_events(staying, 1)

    await leaving.disconnect()
    stayed = await staying.read_all()

    assert_complete(stayed)
    assert text_of(stayed.body) == DEFAULT_TEXT
    [upstream_request] = fake.requests
    assert await asyncio.to_thread(upstream_request.finished.wait, 5)
    assert not upstream_request.client_disconnected.is_set()
    logged = await wait_for_rows(2)
    assert sorted(row.status for row in logged) == ["cancelled", "ok"]
    # The answer was complete, so it was cached although its first listener left.
    again = await post_quote()
    assert again.headers["cf-aig-cache-status"] == "HIT"
    assert len(fake.requests) == 1


@pytest.mark.integration
@pytest.mark.services
async def test_coalescing_requests_arriving_as_their_flight_is_cancelled_get_an_answer(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """The last listener leaving cancels a flight, whose task then takes a moment (under a
    millisecond) to close its upstream. A request arriving in that moment used to join the dead
    flight and wait on it for ever, holding a stream slot. Each round here, a leader waits on a
    slow upstream, a burst of identical requests is sent, and the leader hangs up `offset`
    seconds after the burst (before it, when `offset` is negative); `offset` walks to where the
    burst stops keeping the leader's flight alive and starts a flight of its own, so the rounds
    land requests around the moment of the cancel. Every request must get its quote."""
    configure(settings, max_concurrent_streams=100, rate_limit=(10_000, 60), ttft_timeout_s=1.0)
    # The moment depends on how fast this machine handles the burst (on a fast one the burst has
    # joined the flight before a hang-up sent right after it lands), so the walk searches for it:
    # it steps `offset` away from the outcome it got, doubling the step, until a round comes out
    # the other way, then bisects between the latest early and late offsets.
    offset, step = 0.004, 0.002
    latest: dict[str, float] = {}
    outcomes: list[str] = []
    for round_number in range(20):
        body = {"persona": persona.slug, "topic": f"race {round_number}"}
        asked = len(fake.requests)
        fake.script(Scenario(stall_before_headers_s=0.1))  # the leader's flight: slow to start
        leader = post_stream(body, client=("198.51.100.7", 1000 + round_number))
        await leader.send()
        await asyncio.to_thread(fake.wait_for_requests, asked + 1)
        joiners = [post_stream(body, client=(f"198.51.100.{10 + index}", 1000)) for index in range(8)]
        if offset < 0:
            await leader.disconnect()
            await asyncio.sleep(-offset)
        for joiner in joiners:
            await joiner.send()
        if offset >= 0:
            await asyncio.sleep(offset)
            await leader.disconnect()
        for joiner in joiners:
            try:
                await joiner.start(timeout=10)
                answered = await joiner.read_all(timeout=10)
            except TimeoutError:
                pytest.fail(f"round {round_number}: a request joined a cancelled flight and got nothing")
            assert_complete(answered)
        # One upstream call: a request came before the cancel and kept the flight alive.
        outcome = "early" if len(fake.requests) == asked + 1 else "late"
        outcomes.append(outcome)
        latest[outcome] = offset
        if {"early", "late"} <= latest.keys():
            offset = (latest["early"] + latest["late"]) / 2
        else:
            offset = offset - step if outcome == "early" else min(offset + step, 1.0)
            step *= 2
    assert {"early", "late"} <= set(outcomes), outcomes  # the rounds did reach the moment of the cancel


# -- 4. rate limits -------------------------------------------------------------------------------


def assert_rate_limited(response: StreamedResponse, code: str = "rate_limited") -> int:
    assert_json_error(response, 429, code)
    retry_after = response.headers["retry-after"]
    assert retry_after.isdigit(), retry_after
    return int(retry_after)


@pytest.mark.integration
@pytest.mark.services
async def test_rate_limit_fourth_request_from_a_client_is_429(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, rate_limit=(3, 3600))
    await at_start_of_window(60)
    for _ in range(3):
        assert_complete(await post_quote(client=("198.51.100.1", 1000)))

    limited = await post_quote(client=("198.51.100.1", 1001))
    other_ip = await post_quote(client=("198.51.100.2", 1000))

    assert 1 <= assert_rate_limited(limited) <= 3600
    assert_complete(other_ip)
    logged = await rows()
    assert [row.status for row in logged] == ["ok", "ok", "ok", "rate_limited", "ok"]
    row = logged[3]
    assert row.error_code == "rate_limited" and row.error_message == limited.json()["error"]["message"]
    assert row.client_hash == ip_hash("198.51.100.1")
    assert row.persona_version_id == await latest_version_id(persona)
    assert len(fake.requests) == 1  # the rest were hits; the limited request never got that far


@pytest.mark.integration
@pytest.mark.services
async def test_rate_limit_a_logged_in_user_is_limited_across_ips(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    from django.contrib.auth.models import User
    from django.test import AsyncClient

    configure(settings, rate_limit=(3, 3600))
    await User.objects.acreate_user(username="reader", password="a-long-test-password-42")
    browser = AsyncClient()
    assert await browser.alogin(username="reader", password="a-long-test-password-42")
    cookie = {
        "cookie": f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}"
    }
    await at_start_of_window(60)

    for index in range(3):
        assert_complete(await post_quote(client=(f"192.0.2.{index + 1}", 1000), headers=cookie))
    limited = await post_quote(client=("192.0.2.9", 1000), headers=cookie)
    anonymous_same_ip = await post_quote(client=("192.0.2.9", 1000))

    assert_rate_limited(limited)
    assert_complete(anonymous_same_ip)  # that IP itself had asked nothing yet
    logged = await rows()
    assert [row.status for row in logged] == ["ok", "ok", "ok", "rate_limited", "ok"]
    assert logged[3].client_hash == ip_hash("192.0.2.9")


@pytest.mark.integration
@pytest.mark.services
async def test_rate_limit_concurrent_streams_are_capped(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, max_concurrent_streams=2)
    fake.default = Scenario(token_delay_s=0.1)
    first = post_stream({"persona": persona.slug, "topic": "one"})
    second = post_stream({"persona": persona.slug, "topic": "two"})
    await read_events(first, 1)
    await read_events(second, 1)

    third = await post_quote({"persona": persona.slug, "topic": "three"})

    retry_after = assert_rate_limited(third, "too_many_streams")
    assert 1 <= retry_after <= 60
    assert_complete(await first.read_all())
    fourth = await post_quote({"persona": persona.slug, "topic": "four"})
    assert_complete(fourth)
    assert_complete(await second.read_all())
    logged = await rows()
    [refused] = [row for row in logged if row.status == Generation.Status.RATE_LIMITED]
    assert (refused.error_code, refused.topic, refused.request_count) == ("too_many_streams", "", 1)
    assert {row.topic: row.status for row in logged if row != refused} == {
        "one": "ok",
        "two": "ok",
        "four": "ok",
    }


async def wait_for_request_count(row: Generation, count: int, timeout_s: float = 10.0) -> Generation:
    """Refusals after a window's first are copied to its row a moment later (refusals.py)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await row.arefresh_from_db()
        if row.request_count == count or time.monotonic() > deadline:
            assert row.request_count == count
            return row
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.services
async def test_rate_limit_refusals_share_one_small_row_and_the_analytics_count_each(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client as DjangoClient

    from quotes.admin import CSV_COLUMNS
    from quotes.selectors import gateway_stats

    configure(settings, rate_limit=(2, 3600))
    await at_start_of_window(60, margin_s=20)
    client = ("198.51.100.30", 1000)
    for _ in range(2):
        assert_complete(await post_quote(client=client))
    # A large request: refused rows used to keep all of it.
    big = {
        "persona": persona.slug,
        "topic": "t" * 200,
        "messages": [{"role": "user", "content": "m" * 2000}] * 9,
    }
    refused = 40

    for _ in range(refused):
        assert_rate_limited(await post_quote(big, client=client))

    logged = await rows()
    assert [row.status for row in logged] == ["ok", "ok", "rate_limited"]
    row = await wait_for_request_count(logged[2], refused)
    assert (row.request, row.topic, row.text, row.upstream_headers) == ({}, "", "", {})
    assert (row.error_code, row.client_hash) == ("rate_limited", ip_hash("198.51.100.30"))

    since, until = timezone.now() - timedelta(hours=1), timezone.now() + timedelta(minutes=1)
    stats = await sync_to_async(gateway_stats)(since=since, until=until)
    assert (stats.requests, stats.by_status["rate_limited"], stats.errors) == (refused + 2, refused, refused)
    assert stats.errors_by_code == [("rate_limited", refused)]
    assert sum(bucket.by_status["rate_limited"] for bucket in stats.buckets) == refused
    [by_persona] = stats.by_persona
    assert (by_persona.requests, by_persona.errors) == (refused + 2, refused)

    def command_and_session() -> tuple[dict[str, Any], str]:
        out = io.StringIO()
        call_command("gateway_stats", "--since", "1h", "--json", stdout=out)
        admin = User.objects.create_superuser("root", password="root-password-123")
        browser = DjangoClient()
        browser.force_login(admin)
        return json.loads(out.getvalue()), browser.cookies["sessionid"].value

    command, session = await sync_to_async(command_and_session)()
    assert (command["requests"], command["by_status"]["rate_limited"]) == (refused + 2, refused)
    exported = await request(
        "GET", "/admin/quotes/generation/export.csv", headers={"cookie": f"sessionid={session}"}
    )
    assert exported.status == 200
    csv_rows = list(csv.DictReader(io.StringIO(exported.body.decode())))
    assert sorted(int(r["requests"]) for r in csv_rows) == [1, 1, refused]
    assert list(csv_rows[0]) == list(CSV_COLUMNS)


# -- 5. retries (before the first token only) ------------------------------------------------------


@pytest.mark.integration
async def test_retry_503_then_3040_then_success(persona: Persona, fake: FakeWorkersAI, settings: Any) -> None:
    configure(settings, max_attempts=3, retry_delay_ms=10)
    fake.script(Scenario.server_error(503), Scenario.out_of_capacity())

    response = await post_quote()

    assert_complete(response)
    assert text_of(response.body) == DEFAULT_TEXT
    assert len(fake.requests) == 3
    assert {r.model for r in fake.requests} == {MODEL}
    [row] = await rows()
    assert (row.status, row.model, row.fallback_step) == ("ok", MODEL, 0)


@pytest.mark.integration
async def test_retry_a_connection_dropped_before_the_first_token(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, max_attempts=2, retry_delay_ms=10)
    # An empty-text event, then the TCP connection is aborted: no token was seen.
    fake.script(Scenario(tokens=("",), usage=None, drop_after_tokens=1))

    response = await post_quote()

    assert_complete(response)
    assert text_of(response.body) == DEFAULT_TEXT
    assert len(fake.requests) == 2


@pytest.mark.integration
async def test_retry_model_not_found_is_not_retried(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, max_attempts=3, retry_delay_ms=10)
    fake.script(Scenario.model_not_found())

    response = await post_quote()

    assert_json_error(response, 400, "model_not_found")
    await asyncio.sleep(0.1)
    assert len(fake.requests) == 1
    [row] = await rows()
    assert (row.status, row.error_code) == ("error", "model_not_found")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("backoff", "minimum_gaps"),
    [
        ("constant", (0.15, 0.15, 0.15)),
        ("linear", (0.15, 0.30, 0.45)),
        ("exponential", (0.15, 0.30, 0.60)),
    ],
)
async def test_retry_backoff(
    persona: Persona, fake: FakeWorkersAI, settings: Any, backoff: str, minimum_gaps: tuple[float, ...]
) -> None:
    configure(settings, max_attempts=4, retry_delay_ms=150, backoff=backoff)
    fake.script(*[Scenario.server_error(503)] * 3)

    response = await post_quote()

    assert_complete(response)
    times = [r.received_at for r in fake.requests]
    assert len(times) == 4
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    for gap, minimum in zip(gaps, minimum_gaps, strict=True):
        assert gap >= minimum * 0.9, gaps
    if backoff == "constant":
        assert gaps[2] < 0.55, gaps  # generous: not growing like the others (0.45 / 0.60)


# -- 6. fallbacks ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("where", ["persona", "settings"])
async def test_fallback_model_answers_when_the_primary_is_out_of_capacity(
    persona: Persona, fake: FakeWorkersAI, settings: Any, where: str
) -> None:
    configure(settings, max_attempts=2, retry_delay_ms=10)
    if where == "persona":
        persona.fallback_models = [FALLBACK]
        await save(persona)
    else:
        configure(settings, fallback_models=[FALLBACK])
    fake.script(Scenario.out_of_capacity(), Scenario.out_of_capacity())

    response = await post_quote()

    assert_complete(response)
    assert text_of(response.body) == DEFAULT_TEXT
    assert [r.model for r in fake.requests] == [MODEL, MODEL, FALLBACK]
    assert fake.requests[-1].path.endswith(f"/ai/run/{FALLBACK}")
    assert response.headers["cf-aig-step"] == "1"
    assert response.headers["x-quote-model"] == FALLBACK
    [row] = await rows()
    assert (row.status, row.model, row.fallback_step) == ("ok", FALLBACK, 1)
    assert row.cost_usd == cost_of(FALLBACK, *DEFAULT_USAGE)
    assert row.persona_version_id == await latest_version_id(persona)


@pytest.mark.integration
async def test_fallback_never_after_the_first_token(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, max_attempts=3, retry_delay_ms=10, fallback_models=[FALLBACK])
    fake.script(Scenario(drop_after_tokens=2))

    response = await post_quote()

    assert_error_event(response, "upstream_dropped")
    assert text_of(response.body) == "Stay hungry"  # no text repeated
    await asyncio.sleep(0.2)
    assert len(fake.requests) == 1  # no retry, no fallback
    [row] = await rows()
    assert (row.status, row.error_code, row.text) == ("error", "upstream_dropped", "Stay hungry")


@pytest.mark.integration
async def test_fallback_not_for_an_auth_error(persona: Persona, fake: FakeWorkersAI, settings: Any) -> None:
    configure(settings, max_attempts=3, retry_delay_ms=10, fallback_models=[FALLBACK])
    fake.script(Scenario.unauthorized())

    response = await post_quote()

    assert_json_error(response, 502, "upstream_auth")
    await asyncio.sleep(0.1)
    assert len(fake.requests) == 1


# -- 7. timeouts ----------------------------------------------------------------------------------


@pytest.mark.integration
async def test_timeout_connect_is_retried_then_504(
    persona: Persona, fake: FakeWorkersAI, settings: Any, unaccepting_port: int
) -> None:
    configure(settings, max_attempts=2, retry_delay_ms=10, ttft_timeout_s=5)
    await use_workers_ai(
        settings,
        fake,
        base_url=f"http://127.0.0.1:{unaccepting_port}/client/v4",
        connect_timeout_s=0.2,
    )
    started = time.monotonic()

    response = await post_quote()

    elapsed = time.monotonic() - started
    assert_json_error(response, 504, "upstream_timeout")
    assert 0.35 <= elapsed < 4, elapsed  # two connect timeouts of 0.2 s
    [row] = await rows()
    assert (row.status, row.error_code) == ("error", "upstream_timeout")


@pytest.mark.integration
async def test_timeout_unreachable_is_retried_then_502(
    persona: Persona, fake: FakeWorkersAI, settings: Any, closed_port: int
) -> None:
    configure(settings, max_attempts=2, retry_delay_ms=300)
    await use_workers_ai(settings, fake, base_url=f"http://127.0.0.1:{closed_port}/client/v4")
    started = time.monotonic()

    response = await post_quote()

    assert_json_error(response, 502, "upstream_unreachable")
    assert time.monotonic() - started >= 0.27  # the retry's delay was waited
    assert fake.requests == []


@pytest.mark.integration
async def test_timeout_first_token_budget_is_the_total_across_attempts(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """QUOTES_TTFT_TIMEOUT bounds the whole wait for a first token (issue 21): three attempts at
    a hung upstream share it, instead of taking it three times over (a load balancer's idle
    timeout would cut the request first)."""
    configure(settings, max_attempts=3, retry_delay_ms=10, ttft_timeout_s=1.0)
    fake.script(*[Scenario(stall_before_s=10)] * 3)
    started = time.monotonic()

    response = await post_quote()

    assert_json_error(response, 504, "upstream_timeout")
    assert time.monotonic() - started < 2.5  # one budget of 1 s (three would take 3 s)
    assert len(fake.requests) == 3  # each attempt had its share
    assert await asyncio.to_thread(fake.requests[0].client_disconnected.wait, 2)  # abandoned attempt closed
    [row] = await rows()
    assert (row.status, row.error_code) == ("error", "upstream_timeout")


@pytest.mark.integration
async def test_timeout_an_upstream_timeout_is_logged_as_a_warning_not_an_error(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """A hung upstream's 504 (issue 21) is the upstream's fault: the configured console handler
    writes Django's line for it at WARNING, not ERROR, and with no traceback."""
    import config.asgi  # noqa: F401  (its first import configures logging)

    configure(settings, max_attempts=1, ttft_timeout_s=0.3)
    fake.script(Scenario(stall_before_s=5))
    [console] = [h for h in logging.getLogger().handlers if h.get_name() == "console"]
    assert isinstance(console, logging.StreamHandler)
    buffer = io.StringIO()
    previous = console.setStream(buffer)
    try:
        response = await post_quote()
    finally:
        console.setStream(previous)

    assert_json_error(response, 504, "upstream_timeout")
    lines = [line for line in buffer.getvalue().splitlines() if "Gateway Timeout" in line]
    assert lines and all("WARNING" in line for line in lines), buffer.getvalue()
    assert "ERROR" not in buffer.getvalue() and "Traceback" not in buffer.getvalue()


@pytest.mark.integration
async def test_timeout_idle_mid_stream_ends_with_an_error_event(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, max_attempts=2, retry_delay_ms=10, idle_timeout_s=0.3)
    fake.script(Scenario(stall_after_tokens=2, stall_s=5))
    started = time.monotonic()

    response = await post_quote()

    assert_error_event(response, "idle_timeout")
    assert text_of(response.body) == "Stay hungry"
    assert time.monotonic() - started < 3
    assert len(fake.requests) == 1
    assert await asyncio.to_thread(fake.requests[0].client_disconnected.wait, 2)
    [row] = await rows()
    assert (row.status, row.error_code, row.text) == ("error", "idle_timeout", "Stay hungry")


@pytest.mark.integration
async def test_timeout_total_deadline_mid_stream(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, total_timeout_s=0.6)
    fake.script(Scenario(tokens=DEFAULT_TOKENS * 50, token_delay_s=0.05))
    started = time.monotonic()

    response = await post_quote()

    assert_error_event(response, "deadline_exceeded")
    assert time.monotonic() - started < 3
    text = text_of(response.body)
    assert text.startswith("Stay hungry") and len(text) < len(DEFAULT_TEXT) * 50
    [row] = await rows()
    assert (row.status, row.error_code, row.text) == ("error", "deadline_exceeded", text)


@pytest.mark.integration
async def test_timeout_never_charges_a_slow_consumer(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """The deadlines guard the policy's waits for the backend, never its yields: a consumer that
    takes longer than the idle and first-token timeouts over each event (the run's log on a slow
    Redis) still gets the whole quote."""
    configure(settings, ttft_timeout_s=0.2, idle_timeout_s=0.2)
    request = await sync_to_async(persona.build_request)(topic="work")
    plan = Plan(
        backend=get_backend("workers-ai"),
        persona=persona,
        topic="work",
        messages=(),
        primary=request,
        models=[request.model],
    )
    events = []
    async with aclosing(generate(plan)) as stream:
        async for event in stream:
            events.append(event)
            await asyncio.sleep(0.3)

    assert "".join(e.text for e in events if isinstance(e, Token)) == DEFAULT_TEXT
    assert isinstance(events[-1], Done)


# -- 8. keep-alive ---------------------------------------------------------------------------------


@pytest.mark.integration
async def test_keepalive_pings_during_a_stall_and_the_stream_completes(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, keepalive_s=0.15, idle_timeout_s=5)
    fake.script(Scenario(stall_after_tokens=2, stall_s=0.7))

    response = await post_quote()

    assert_complete(response)
    body = response.body
    assert body.count(PING) >= 2
    first_ping = body.index(PING)
    assert b'{"response":" hungry"}' in body[:first_ping]
    assert b'{"response":","}' in body[first_ping:]  # pings sit between tokens
    assert text_of(body) == DEFAULT_TEXT
    [row] = await rows()
    assert (row.status, row.text) == ("ok", DEFAULT_TEXT)


@pytest.mark.integration
async def test_keepalive_before_the_first_token_keeps_the_error_status(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """The defaults have keepalive (15 s) < ttft timeout (30 s): a ping sent while waiting for
    the first token must not commit a 200, or a TTFT timeout can never be the documented 504."""
    configure(settings, max_attempts=1, ttft_timeout_s=0.6, keepalive_s=0.1)
    fake.script(Scenario(stall_before_s=5))

    response = await post_quote()

    assert_json_error(response, 504, "upstream_timeout")


@pytest.mark.integration
async def test_keepalive_before_the_first_token_keeps_the_fallback_headers(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, max_attempts=1, keepalive_s=0.1, fallback_models=[FALLBACK])
    fake.script(Scenario.error(3040, stall_before_headers_s=0.4))

    response = await post_quote()

    assert_complete(response)
    assert response.headers["x-quote-model"] == FALLBACK
    assert response.headers.get("cf-aig-step") == "1"


# -- 9. Redis ------------------------------------------------------------------------------------


def redis_keys(client: Any, pattern: str) -> list[bytes]:
    return sorted(client.scan_iter(match=pattern))


@pytest.mark.system
async def test_redis_cache_hit_lives_in_redis(
    persona: Persona, fake: FakeWorkersAI, redis_cache: Any
) -> None:
    persona.cache_ttl = 120
    await save(persona)

    first = await post_quote()
    second = await post_quote()

    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert second.headers["cf-aig-cache-status"] == "HIT"
    assert without_ids(second.body) == without_ids(first.body)
    assert len(fake.requests) == 1
    [answer_key] = redis_keys(redis_cache, "*quotes:answer:*")
    assert 100 < redis_cache.ttl(answer_key) <= 120  # the persona's TTL, not the site's hour
    assert redis_keys(redis_cache, "*quotes:rate:*")
    assert answer_keys_in_locmem() == []
    assert [row.cache_status for row in await rows()] == ["miss", "hit"]
    # Gone from Redis means gone: the next request is a miss again.
    redis_cache.delete(answer_key)
    assert (await post_quote()).headers["cf-aig-cache-status"] == "MISS"
    assert len(fake.requests) == 2


@pytest.mark.system
async def test_redis_coalescing_then_cached(
    persona: Persona, fake: FakeWorkersAI, settings: Any, redis_cache: Any
) -> None:
    await five_identical_at_once(settings, fake)

    assert sorted(row.cache_status for row in await rows()) == ["hit", "hit", "hit", "hit", "miss"]
    assert len(redis_keys(redis_cache, "*quotes:answer:*")) == 1
    assert answer_keys_in_locmem() == []
    assert (await post_quote()).headers["cf-aig-cache-status"] == "HIT"
    assert len(fake.requests) == 1


@pytest.mark.system
async def test_redis_rate_limit_counts_in_redis(
    persona: Persona, fake: FakeWorkersAI, settings: Any, redis_cache: Any
) -> None:
    configure(settings, rate_limit=(3, 60))
    await at_start_of_window(60)
    for _ in range(3):
        assert_complete(await post_quote())

    [rate_key] = redis_keys(redis_cache, "*quotes:rate:*")
    assert int(redis_cache.get(rate_key)) == 3
    limited = await post_quote()
    assert 1 <= assert_rate_limited(limited) <= 60
    assert int(redis_cache.get(rate_key)) == 4
    assert 0 < redis_cache.ttl(rate_key) <= 61
    # The count is Redis's: remove it there and the client may ask again.
    redis_cache.delete(rate_key)
    assert_complete(await post_quote())
    assert [row.status for row in await rows()] == ["ok", "ok", "ok", "rate_limited", "ok"]
