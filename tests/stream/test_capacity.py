"""The process's adaptive open-stream limit (quotes.ai.gateway.capacity): its arithmetic fed a
controlled lag signal and clock, then the real ASGI app refusing with 503 over_capacity and
Retry-After while its event loop is kept busy, and /metrics showing the limit and the lag."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.gateway import capacity
from quotes.ai.gateway.capacity import GradientLimit, OpenStreams
from quotes.models import Persona
from tests.asgi import AsgiStream, post_quote, post_stream, request

TARGET_S = 0.010  # 10 ms


# -- the arithmetic, fed a controlled signal --------------------------------------------------------


@pytest.mark.unit
def test_gradient_limit_shrinks_while_the_loop_lags_and_never_below_its_floor() -> None:
    limit = GradientLimit(initial=200)
    for _ in range(capacity.LAG_WINDOW):
        limit.observe(0.200)  # late for half a second already
    seen = [limit.sample(0.200, peak=200, target_s=TARGET_S, floor=12) for _ in range(60)]

    assert all(later <= earlier for earlier, later in zip([200.0, *seen], seen, strict=False))
    assert seen[0] < 200
    assert min(seen) == 12 and seen[-1] == 12


@pytest.mark.unit
def test_gradient_limit_shrinks_from_what_is_held_not_from_a_limit_never_reached() -> None:
    limit = GradientLimit(initial=500)  # grown once, but only 40 streams are open now
    for _ in range(capacity.LAG_WINDOW - 1):
        limit.observe(0.200)  # the loop has been late for a while

    assert limit.sample(0.200, peak=40, target_s=TARGET_S, floor=5) < 40


@pytest.mark.unit
def test_gradient_limit_one_stall_moves_nothing_a_late_loop_a_lot() -> None:
    limit = GradientLimit(initial=100)
    limit.sample(0.5, peak=50, target_s=TARGET_S, floor=1)  # one stall: a garbage collection, say
    for _ in range(capacity.LAG_WINDOW):
        limit.sample(0.001, peak=50, target_s=TARGET_S, floor=1)

    assert limit.limit == 100
    for _ in range(capacity.LAG_WINDOW):
        limit.sample(0.5, peak=100, target_s=TARGET_S, floor=1)
    assert limit.limit < 60


@pytest.mark.unit
def test_gradient_limit_holds_between_late_samples() -> None:
    limit = GradientLimit(initial=100)
    limit.sample(0.5, peak=100, target_s=TARGET_S, floor=1)
    shrunk = limit.sample(0.5, peak=100, target_s=TARGET_S, floor=1)  # late twice: the loop is late
    assert shrunk < 100

    # Back on time, but late twice in the last two seconds: neither shrinks nor grows yet.
    assert limit.sample(0.001, peak=100, target_s=TARGET_S, floor=1) == shrunk


@pytest.mark.unit
def test_gradient_limit_grows_back_while_the_loop_keeps_up_and_streams_are_turned_away() -> None:
    limit = GradientLimit(initial=10)
    seen = []
    for _ in range(30):
        # Every sample, as many streams asked as the limit allowed, and then some.
        seen.append(limit.sample(0.0005, peak=int(limit.limit) + 1, target_s=TARGET_S, floor=10))

    assert all(later > earlier for earlier, later in zip([10.0, *seen], seen, strict=False))
    assert seen[-1] > 100


@pytest.mark.unit
def test_gradient_limit_does_not_grow_past_what_is_asked_for() -> None:
    limit = GradientLimit(initial=50)
    for _ in range(100):
        limit.sample(0.0005, peak=3, target_s=TARGET_S, floor=10)

    assert limit.limit == 50


@pytest.mark.unit
def test_gradient_limit_stays_within_the_static_ceiling() -> None:
    limit = GradientLimit(initial=50)
    for _ in range(100):
        limit.sample(0.0, peak=int(limit.limit), target_s=TARGET_S, floor=10, ceiling=80)

    assert limit.limit == 80


@pytest.mark.unit
def test_the_limit_is_never_under_its_floor_nor_over_its_ceiling_even_before_a_sample(settings: Any) -> None:
    capacity.reset()  # the initial limit, no sample yet
    assert capacity.INITIAL_LIMIT < 80
    on = replace(settings.QUOTES_GATEWAY, loop_lag_target_ms=5.0, min_open_streams=80, max_open_streams=0)
    assert capacity.current_limit(on) == 80
    assert capacity.current_limit(replace(on, max_open_streams=60)) == 60  # the ceiling wins
    assert capacity.current_limit(replace(on, min_open_streams=10)) == capacity.INITIAL_LIMIT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_retry_after_is_when_enough_open_streams_are_expected_to_have_ended() -> None:
    clock = Clock()
    streams = OpenStreams(clock)
    assert streams.retry_after_s(1) == capacity.DEFAULT_RETRY_AFTER_S  # nothing known yet

    assert streams.try_enter(10)
    first = streams.open()
    clock.now += 30
    streams.close(first)  # streams here last about 30 s
    slots = []
    for _ in range(4):  # four open streams, opened 0, 5, 10 and 15 s ago
        assert streams.try_enter(10)
        slots.append(streams.open())
        clock.now += 5
    clock.now -= 5

    assert streams.expected_s == 30
    assert streams.retry_after_s(4) == 15  # the oldest ends in 30 - 15 s: then one fits
    assert streams.retry_after_s(2) == 25  # three must end: the third oldest is 5 s old
    assert streams.retry_after_s(0) == 30  # all four
    clock.now += 100
    assert streams.retry_after_s(4) == 1  # overdue: any moment now
    streams.close(slots[0])
    assert streams.count == 3 and not streams.try_enter(3)


# -- the app, its loop kept busy ------------------------------------------------------------------


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    yield fake_workers_ai
    await reset_backends()


@pytest.fixture
def adaptive(settings: Any) -> Iterator[None]:
    """The adaptive limit on (tests/conftest.py turns it off), from a floor of 1 stream, the
    per-client limits out of the way, metrics on."""
    settings.QUOTES_GATEWAY = replace(
        settings.QUOTES_GATEWAY,
        loop_lag_target_ms=TARGET_S * 1000,
        min_open_streams=1,
        max_open_streams=0,
        rate_limit=(100_000, 60),
        network_rate_limit=(1_000_000, 60),
        max_concurrent_streams=100_000,
        cache_ttl=0,
    )
    settings.QUOTES_METRICS_ENABLED = True
    settings.QUOTES_METRICS_TOKEN = "capacity-test-token"
    settings.QUOTES_METRICS_ALLOW = ()
    capacity.reset()
    yield
    capacity.reset()


@contextlib.asynccontextmanager
async def loop_kept_busy() -> AsyncIterator[None]:
    """A task that holds the event loop 70 ms at a time, with a bare yield between: what a loop
    with more streams than it can serve looks like to everything else on it (the probe's timer,
    every 100 ms, fires tens of ms late)."""
    stop = asyncio.Event()

    async def hog() -> None:
        while not stop.is_set():
            end = time.perf_counter() + 0.07
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0)

    task = asyncio.create_task(hog())
    try:
        yield
    finally:
        stop.set()
        await task


async def metrics() -> dict[str, float]:
    response = await request("GET", "/metrics", headers={"authorization": "Bearer capacity-test-token"})
    assert response.status == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.body.decode())
        for sample in family.samples
        if sample.name.startswith(("quotes_admission_", "quotes_event_loop_"))
    }


async def until(condition: Any, what: str, timeout_s: float = 30) -> None:
    """Poll `condition()` (on the loop, so the probe keeps sampling) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_a_busy_loop_lowers_the_limit_and_refuses_with_503_and_retry_after(
    persona: Persona, fake: FakeWorkersAI, settings: Any, adaptive: None
) -> None:
    fake.default = Scenario(tokens=["tick"] * 400, token_delay_s=0.05)
    held = post_stream({"persona": persona.slug, "topic": "held"})
    assert (await held.start()).status == 200
    await held.next_chunk()
    scraped = await metrics()
    assert scraped["quotes_admission_limit"] >= 1
    assert scraped["quotes_admission_open_streams"] == 1

    async with loop_kept_busy():
        options = settings.QUOTES_GATEWAY
        await until(lambda: capacity.current_limit(options) == 1, "the limit fell to the floor")
        refused = post_stream({"persona": persona.slug, "topic": "refused"})
        response = await refused.start()
        body = json.loads((await refused.read_all()).body)
        scraped = await metrics()

    assert response.status == 503
    assert body["error"]["code"] == "over_capacity"
    assert int(response.headers["retry-after"]) >= 1
    assert scraped["quotes_admission_limit"] == 1
    assert scraped["quotes_event_loop_lag_seconds"] > TARGET_S
    assert len(fake.requests) == 1  # the refused stream never reached the upstream

    # The loop free again, the limit grows back and the next stream is admitted.
    await until(lambda: capacity.current_limit(settings.QUOTES_GATEWAY) > 1, "the limit grew back")
    admitted = post_stream({"persona": persona.slug, "topic": "admitted"})
    assert (await admitted.start()).status == 200
    for stream in (admitted, held):
        await stream.disconnect()


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_the_static_ceiling_still_caps_the_adaptive_limit(
    persona: Persona, fake: FakeWorkersAI, settings: Any, adaptive: None
) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=1)
    fake.default = Scenario(tokens=["tick"] * 400, token_delay_s=0.05)
    held = post_stream({"persona": persona.slug, "topic": "held"})
    assert (await held.start()).status == 200

    refused: AsgiStream = post_stream({"persona": persona.slug, "topic": "refused"})
    response = await refused.start()
    await refused.read_all()

    assert response.status == 503 and int(response.headers["retry-after"]) >= 1
    assert (await metrics())["quotes_admission_limit"] == 1
    await held.disconnect()


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_a_stream_request_still_in_djangos_handler_counts_at_the_gate(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """A burst: a stream request the gate passed on is still in Django's handler (its body is
    still coming) when the next one comes. With room for one stream, the next is refused at the
    gate, and the first, once its body is in, is admitted (not refused behind the other)."""
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=1, cache_ttl=0)
    fake.default = Scenario(tokens=["tick"] * 3)
    # A persona this process has served (the gate refuses only those: the refusal counts on it).
    assert (await post_quote({"persona": persona.slug, "topic": "earlier"})).status == 200
    body = json.dumps({"persona": persona.slug, "topic": "first"}).encode()
    first = post_stream(body)
    await first.communicator.send_input({"type": "http.request", "body": body[:5], "more_body": True})
    await until(lambda: capacity.open_streams.entering == 1, "the first is in Django's handler")

    second = post_stream({"persona": persona.slug, "topic": "second"})
    refused = await second.start()
    refused_body = json.loads((await second.read_all()).body)
    first.sent = True
    await first.communicator.send_input({"type": "http.request", "body": body[5:], "more_body": False})
    admitted = await first.start()
    await first.read_all()

    assert (refused.status, refused_body["error"]["code"]) == (503, "over_capacity")
    assert int(refused.headers["retry-after"]) >= 1
    assert admitted.status == 200
    assert capacity.open_streams.entering == 0
    assert len(fake.requests) == 2  # the earlier one and the first: the second never got there


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_the_gates_admission_is_not_decided_again_behind_it(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """The gate lets a request in while there is room; the limit then falls (the loop's lag,
    here the static ceiling) before its body is in. Its stream opens all the same: the gate's
    answer is passed on, and the admission takes it over instead of deciding again."""
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=2, cache_ttl=0)
    fake.default = Scenario(tokens=["tick"] * 400, token_delay_s=0.05)
    held = post_stream({"persona": persona.slug, "topic": "held"})
    assert (await held.start()).status == 200
    body = json.dumps({"persona": persona.slug, "topic": "let in"}).encode()
    let_in = post_stream(body)
    await let_in.communicator.send_input({"type": "http.request", "body": body[:5], "more_body": True})
    await until(lambda: capacity.open_streams.entering == 1, "it is in Django's handler")

    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=1)
    let_in.sent = True
    await let_in.communicator.send_input({"type": "http.request", "body": body[5:], "more_body": False})
    admitted = await let_in.start()

    assert admitted.status == 200
    assert (capacity.open_streams.count, capacity.open_streams.entering) == (2, 0)
    for stream in (let_in, held):
        await stream.disconnect()
