"""Dropped connections, resume and stop, through the real ASGI app: a drop is not a stop (the
generation runs on for its grace), `Last-Event-ID` gives exactly the rest, a stop closes the
upstream at once, and only for the client that started it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.models import Generation, Persona
from tests.asgi import parse_sse, post_quote, post_stream, read_events, request
from tests.fixtures import saved

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

TICKS = [f"t{n} " for n in range(40)]


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona, settings: Any) -> FakeWorkersAI:
    await saved(persona, model="@cf/meta/llama-3.1-8b-instruct-fp8")
    settings.QUOTES_RESUME_GRACE_S = 5
    return fake


def last_id(body: bytes) -> str:
    return [line for line in body.decode().splitlines() if line.startswith("id: ")][-1][4:]


def text_of(body: bytes) -> str:
    return "".join(
        json.loads(e["data"])["response"]
        for e in parse_sse(body)
        if e["event"] == "message" and e["data"][:1] == "{"
    )


async def test_a_cut_stream_resumes_with_exactly_the_rest(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=TICKS, token_delay_s=0.02))
    stream = post_stream()
    head = await read_events(stream, 5)
    await stream.disconnect()  # the connection drops; the generation runs on
    resumed = await request(
        "GET", "/api/quotes/stream", headers={"last-event-id": last_id(head), "accept": "text/event-stream"}
    )
    assert resumed.status == 200
    assert text_of(head + resumed.body) == "".join(TICKS)
    assert len(fake.requests) == 1
    [row] = [row async for row in Generation.objects.all()]
    assert row.status == "ok" and row.text == "".join(TICKS)


async def test_a_finished_generation_resumes_from_its_kept_events(fake: FakeWorkersAI) -> None:
    whole = await post_quote()
    ids = [line[4:] for line in whole.body.decode().splitlines() if line.startswith("id: ")]
    resumed = await post_quote({"last_event_id": ids[2]})
    assert resumed.status == 200
    assert whole.body.endswith(resumed.body)
    assert await post_quote({"last_event_id": ids[-1]}) is not None  # after the end: nothing more, no error


@pytest.mark.parametrize(
    ("last_event_id", "status", "code"),
    [
        ("not-an-id", 400, "invalid_last_event_id"),
        ("7d1f4c5e-0000-4000-8000-000000000000", 400, "invalid_last_event_id"),  # the id alone
        ("7d1f4c5e-0000-4000-8000-000000000000.0123456789abcdef:3", 404, "resume_unavailable"),
    ],
)
async def test_ids_this_site_never_sent_are_refused(
    fake: FakeWorkersAI, last_event_id: str, status: int, code: str
) -> None:
    response = await post_quote({"last_event_id": last_event_id})
    assert (response.status, response.json()["error"]["code"]) == (status, code)


async def test_a_generation_id_with_another_key_resumes_nothing(fake: FakeWorkersAI) -> None:
    whole = await post_quote()
    forged = f"{whole.headers['x-quote-id']}.{'0' * 16}:2"
    response = await post_quote({"last_event_id": forged})
    assert response.status == 404


async def test_stop_closes_the_upstream_at_once_for_its_own_client_only(fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 3)
    quote_id = stream.response.headers["x-quote-id"]  # type: ignore[union-attr]
    stranger = await request("POST", f"/api/quotes/{quote_id}/stop", client=("192.0.2.9", 1))
    assert stranger.status == 404
    started = time.monotonic()
    stopped = await request("POST", f"/api/quotes/{quote_id}/stop")
    assert stopped.status == 200 and stopped.json() == {"id": quote_id, "stopped": True}
    assert fake.requests[0].client_disconnected.wait(1)
    assert fake.requests[0].disconnected_at - started < 0.1  # type: ignore[operator]
    events = parse_sse(await stream.read_all() and stream.response.body)  # type: ignore[union-attr]
    assert json.loads(events[-1]["data"])["error"]["code"] == "stopped"
    row = await Generation.objects.aget(public_id=quote_id)
    assert (row.status, row.error_code) == ("cancelled", "stopped") and row.text.startswith("tick")
    again = await request("POST", f"/api/quotes/{quote_id}/stop")
    assert again.json()["stopped"] is False


async def test_a_resume_counts_against_the_rate_limit(fake: FakeWorkersAI, settings: Any) -> None:
    whole = await post_quote()
    settings.QUOTES_RATE_LIMIT = "2/minute"
    ids = [line[4:] for line in whole.body.decode().splitlines() if line.startswith("id: ")]
    statuses = [(await post_quote({"last_event_id": ids[1]})).status for _ in range(4)]
    assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429]


async def test_the_drain_tells_open_streams_to_resume_elsewhere(fake: FakeWorkersAI) -> None:
    from quotes.admission import drain

    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 3)
    assert await drain(0.1) == 1
    body = (await stream.read_all()).body
    reconnect = parse_sse(body)[-1]
    assert reconnect["event"] == "reconnect" and json.loads(reconnect["data"])["retry_ms"] == 1000
    assert b"retry: 1000" in body
    refused = await post_quote()
    assert (refused.status, refused.json()["error"]["code"]) == (503, "server_draining")
    row = await Generation.objects.aget(public_id=stream.response.headers["x-quote-id"])  # type: ignore[union-attr]
    assert (row.status, row.error_code) == ("cancelled", "server_draining")
    await asyncio.sleep(0)
