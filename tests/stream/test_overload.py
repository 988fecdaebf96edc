"""A process that takes no more streams (its event loop late while it serves LAG_FLOOR streams
or more, or its ceiling reached) refuses a new one at quotes.gate, before Django: a 503 with Retry-After in the
dialect of the URL asked, counted per persona as every refusal is; what the view answers first
(a resume, another origin's page, a body it refuses) still gets the view's answer."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.admission import LAG_FLOOR
from quotes.models import Generation, Persona, Refusal
from quotes.rows import writer
from tests.asgi import STREAM_URL, htmx_form_post, parse_sse, post_quote, post_stream, read_events, request
from tests.fixtures import saved

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona, unlimited: Any) -> FakeWorkersAI:
    await saved(persona, model="@cf/meta/llama-3.1-8b-instruct-fp8", cache_ttl=0)
    return fake


def refused(response: Any) -> bool:
    return response.status == 503 and int(response.headers["retry-after"]) > 0


async def test_a_full_process_refuses_each_url_in_its_own_dialect_and_counts_it(
    fake: FakeWorkersAI, persona: Persona, settings: Any
) -> None:
    body = {"persona": persona.slug}
    assert (await post_quote(body)).status == 200  # the persona served (and known) here
    settings.QUOTES_MAX_OPEN_STREAMS = 0  # every new stream refused: over_capacity
    api = await post_quote(body, headers={"x-request-id": "overload-1"})
    htmx = await post_quote(body, headers={"hx-request": "true"})
    eventsource = await request(
        "GET", STREAM_URL, query=f"persona={persona.slug}", headers={"accept": "text/event-stream"}
    )
    form = await htmx_form_post({"persona": persona.slug})
    chat = await request(
        "POST",
        "/v1/chat/completions",
        json_body={"model": persona.slug, "messages": [{"role": "user", "content": "time"}]},
    )

    answers = [api, htmx, eventsource, form, chat]
    assert all(refused(answer) for answer in answers), [(a.status, a.headers) for a in answers]
    assert api.json()["error"]["code"] == "over_capacity" and api.headers["x-request-id"] == "overload-1"
    assert api.headers["vary"] == "HX-Request" and api.headers["x-content-type-options"] == "nosniff"
    for page in (htmx, form):  # the page shows the message from a named event
        assert page.headers["content-type"].startswith("text/event-stream")
        (error,) = [event for event in parse_sse(page.body) if event["event"] == "error"]
        assert json.loads(error["data"])["code"] == "over_capacity"
    assert eventsource.json()["error"]["code"] == "over_capacity"
    assert chat.json()["error"]["code"] == "over_capacity" and chat.json()["error"]["type"]
    assert len(fake.requests) == 1 and await Generation.objects.acount() == 1

    await writer().flush(5.0)
    counts = [(r.persona_id, r.code, r.count) async for r in Refusal.objects.all()]
    assert counts == [(persona.pk, "over_capacity", 5)]


async def test_what_the_view_answers_first_gets_through_a_full_process(
    fake: FakeWorkersAI, persona: Persona, settings: Any
) -> None:
    settings.QUOTES_MAX_OPEN_STREAMS = 0
    settings.QUOTES_MAX_BODY_BYTES = 200
    header_resume = await post_quote({"persona": persona.slug}, headers={"last-event-id": "nonsense"})
    body_resume = await post_quote({"persona": persona.slug, "last_event_id": "nonsense"})
    elsewhere = await post_quote(
        {"persona": persona.slug},
        headers={"origin": "https://elsewhere.example", "sec-fetch-site": "cross-site"},
    )
    not_json = await post_quote(b"{persona")
    too_large = await post_quote({"persona": persona.slug, "topic": "x" * 300})
    not_eventsource = await request("GET", STREAM_URL, query=f"persona={persona.slug}")

    codes = [
        (answer.status, answer.json()["error"]["code"])
        for answer in (header_resume, body_resume, elsewhere, not_json, too_large, not_eventsource)
    ]
    assert codes == [
        (400, "invalid_last_event_id"),
        (400, "invalid_last_event_id"),
        (403, "cross_site"),
        (400, "invalid_json"),
        (413, "body_too_large"),
        (406, "not_acceptable"),
    ]
    assert fake.requests == []


async def test_a_process_whose_loop_runs_late_takes_no_new_stream_while_it_serves_its_floor(
    fake: FakeWorkersAI,
) -> None:
    fake.default = Scenario(tokens=["tick"] * 100, token_delay_s=0.05)
    held = [post_stream(client=(f"198.51.{n}.1", 1)) for n in range(LAG_FLOOR)]
    for stream in held:
        await read_events(stream, 1)
    time.sleep(0.4)  # noqa: ASYNC251 (the loop held, as a burst of requests or a slow callback holds it)

    late = await post_quote(client=("198.51.100.2", 1))

    assert refused(late) and late.json()["error"]["code"] == "over_capacity"
    assert len(fake.requests) == LAG_FLOOR
    # Once the loop keeps time again (a few probes), streams are taken again.
    fake.default = Scenario()
    for _ in range(200):
        if (answer := await post_quote(client=("198.51.100.3", 1))).status == 200:
            break
        await asyncio.sleep(0.05)
    assert answer.status == 200, answer.body
    await asyncio.gather(*(stream.disconnect() for stream in held))


async def test_with_lag_admission_off_only_the_ceiling_refuses(fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_LAG_ADMISSION = False  # (bench/load.py measures a stream's cost so)
    fake.default = Scenario(tokens=["tick"] * 100, token_delay_s=0.05)
    held = [post_stream(client=(f"198.51.{n}.1", 1)) for n in range(LAG_FLOOR)]
    for stream in held:
        await read_events(stream, 1)
    time.sleep(0.4)  # noqa: ASYNC251 (late)
    fake.default = Scenario()  # a short one

    assert (await post_quote(client=("198.51.100.2", 1))).status == 200
    await asyncio.gather(*(stream.disconnect() for stream in held))


async def test_a_late_loop_refuses_nothing_while_it_serves_fewer_than_its_floor(fake: FakeWorkersAI) -> None:
    fake.default = Scenario(tokens=["tick"] * 100, token_delay_s=0.05)
    held = [post_stream(client=(f"198.51.{n}.1", 1)) for n in range(LAG_FLOOR - 1)]
    for stream in held:
        await read_events(stream, 1)
    time.sleep(0.4)  # noqa: ASYNC251 (late, but a burst's set-ups lag a loop for a moment)
    fake.default = Scenario()  # a short one

    assert (await post_quote(client=("198.51.100.2", 1))).status == 200
    await asyncio.gather(*(stream.disconnect() for stream in held))
