"""The stream's htmx dialect, through the real ASGI app: HTML-escaped text fragments (unnamed
messages, which hx-sse appends) and named `meta`, `done` and `error` events; the page's form,
posted to its own URL under Django's CSRF check; the JSON format untouched for everyone else."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlencode

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.gateway.runs import resume_key
from quotes.models import Generation, Persona
from tests.asgi import CSRF, AsgiStream, htmx_form_post, parse_sse, request
from tests.limits import at_start_of_window

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture(autouse=True)
async def _close_backends_on_this_loop() -> AsyncIterator[None]:
    yield
    await reset_backends()


def data_of(events: list[dict[str, str]], name: str) -> dict[str, Any]:
    [event] = [e for e in events if e["event"] == name]
    return json.loads(event["data"])


async def test_htmx_form_post_streams_escaped_fragments_and_named_events(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(Scenario(tokens=("A <b>", "&", " 'x'\n", "</b>.")))

    response = await htmx_form_post({"persona": persona.slug, "topic": "silence"})

    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.body)
    assert [e["event"] for e in events] == ["meta", "message", "message", "message", "message", "done"]
    fragments = [e["data"] for e in events if e["event"] == "message"]
    assert fragments == ["A &lt;b&gt;", "&amp;", " 'x'\n", "&lt;/b&gt;."]
    assert b"<b>" not in response.body

    row = await Generation.objects.aget()
    assert row.text == "A <b>& 'x'\n</b>."
    meta = data_of(events, "meta")
    assert meta["id"] == str(row.public_id)
    assert meta["permalink"] == f"/q/{row.public_id}/"
    assert meta["model"] == row.model
    assert meta["model_url"].startswith("https://")
    assert meta["cache_status"] in ("MISS", "BYPASS")
    done = data_of(events, "done")
    assert done["permalink"] == f"/q/{row.public_id}/"
    assert (
        done["usage"]["total_tokens"] == done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
    )
    assert (
        fake_workers_ai.requests[-1]
        .json["messages"][1]["content"]
        .endswith("about silence as if you were Alan Watts")
    )


async def test_htmx_whitespace_only_token_travels_with_the_next_one(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    """hx-sse swaps no message whose data is only whitespace, so a lone " " (Gemma writes one
    before a digit) would vanish from the page: "together - 3-4" showed as "together -3-4"."""
    fake_workers_ai.script(Scenario(tokens=("together", " -", " ", "3", "-", "4", " ", "\n", "months")))

    response = await htmx_form_post({"persona": persona.slug, "topic": "time"})

    fragments = [e["data"] for e in parse_sse(response.body) if e["event"] == "message"]
    assert all(fragment.strip() for fragment in fragments), fragments
    assert "".join(fragments) == "together - 3-4 \nmonths"
    assert (await Generation.objects.aget()).text == "together - 3-4 \nmonths"


async def test_htmx_form_post_sends_the_conversation_as_messages(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    turns = [{"role": "assistant", "content": "Be here."}, {"role": "user", "content": "Why?"}]
    response = await htmx_form_post({"persona": persona.slug, "messages": json.dumps(turns)})

    assert response.status == 200
    assert parse_sse(response.body)[-1]["event"] == "done"
    sent = fake_workers_ai.requests[-1].json["messages"]
    assert sent[-2:] == turns


async def test_htmx_form_post_without_a_valid_csrf_token_is_refused_readably(persona: Persona) -> None:
    for token in (None, "b" * 32):
        response = await htmx_form_post({"persona": persona.slug}, csrf=token)

        assert response.status == 403
        [event] = parse_sse(response.body)
        assert event["event"] == "error"
        error = json.loads(event["data"])
        assert error["code"] == "csrf_failed"
        assert "Reload" in error["message"]
    assert await Generation.objects.acount() == 0


async def test_the_json_api_takes_no_form_post(persona: Persona) -> None:
    response = await request(
        "POST",
        "/api/quotes/stream",
        body=urlencode({"persona": persona.slug, "csrfmiddlewaretoken": CSRF}).encode(),
        headers={"content-type": "application/x-www-form-urlencoded", "cookie": f"csrftoken={CSRF}"},
    )
    assert response.status == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    ("fields", "status", "code"),
    [
        ({}, 400, "missing_persona"),
        ({"persona": "nobody"}, 404, "unknown_persona"),
        ({"persona": "test-watts", "topic": "x" * 500}, 400, "topic_too_long"),
        ({"persona": "test-watts", "messages": "not json"}, 400, "invalid_messages"),
        (
            {"persona": "test-watts", "messages": '[{"role": "assistant", "content": "hi"}]'},
            400,
            "invalid_messages",
        ),
    ],
)
async def test_htmx_bad_input_is_an_error_event_with_a_readable_message(
    persona: Persona, fields: dict[str, str], status: int, code: str
) -> None:
    response = await htmx_form_post(fields)

    assert response.status == status
    assert response.headers["content-type"].startswith("text/event-stream")
    [event] = parse_sse(response.body)
    assert event["event"] == "error"
    error = json.loads(event["data"])
    assert error["code"] == code
    assert len(error["message"]) > 10
    assert error["retry_after"] is None


async def test_htmx_rate_limit_is_an_error_event_with_retry_after(persona: Persona, settings: Any) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, rate_limit=(1, 60))
    await at_start_of_window(60, margin_s=20)  # a fixed window: both requests must fall in one
    first = await htmx_form_post({"persona": persona.slug})
    assert first.status == 200

    response = await htmx_form_post({"persona": persona.slug})

    assert response.status == 429
    assert int(response.headers["retry-after"]) > 0
    [event] = parse_sse(response.body)
    error = json.loads(event["data"])
    assert (event["event"], error["code"]) == ("error", "rate_limited")
    assert error["retry_after"] == int(response.headers["retry-after"])


async def test_htmx_json_post_gets_the_htmx_dialect_and_others_keep_the_workers_ai_format(
    persona: Persona,
) -> None:
    body = {"persona": persona.slug}
    htmx = await request("POST", "/api/quotes/stream", json_body=body, headers={"hx-request": "true"})
    plain = await request("POST", "/api/quotes/stream", json_body=body)

    assert parse_sse(htmx.body)[-1]["event"] == "done"
    assert parse_sse(plain.body)[-1] == {"event": "message", "data": "[DONE]"}
    assert b"event: meta" not in plain.body
    # One URL, two dialects: a cache between must keep them apart.
    for response in (htmx, plain):
        assert "hx-request" in response.headers["vary"].lower()


async def test_refusals_vary_on_hx_request_too(persona: Persona) -> None:
    for headers in ({"hx-request": "true"}, {}):
        response = await request("POST", "/api/quotes/stream", json_body={}, headers=headers)
        assert response.status == 400
        assert "hx-request" in response.headers["vary"].lower()
    refused = await htmx_form_post({"persona": persona.slug}, csrf=None)
    assert refused.status == 403
    assert "hx-request" in refused.headers["vary"].lower()


async def test_eventsource_get_ends_with_a_named_done_event(persona: Persona) -> None:
    response = await request(
        "GET",
        "/api/quotes/stream",
        query=f"persona={persona.slug}",
        headers={"accept": "text/event-stream"},
    )

    events = parse_sse(response.body)
    assert events[-2] == {"event": "message", "data": "[DONE]"}
    assert events[-1]["event"] == "done"
    row = await Generation.objects.aget()
    assert json.loads(events[-1]["data"]) == {"id": str(row.public_id), "permalink": f"/q/{row.public_id}/"}


async def test_htmx_client_disconnect_logs_cancelled_and_closes_the_upstream(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    import asyncio

    fake_workers_ai.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    stream = AsgiStream(
        "POST",
        "/api/quotes/stream",
        body=json.dumps({"persona": persona.slug}).encode(),
        headers={"content-type": "application/json", "hx-request": "true"},
    )
    await stream.start()
    meta, _ = await stream.next_chunk()
    generation_id = stream.response.headers["x-generation-id"]
    ids = f"id: {generation_id}.{resume_key(generation_id)}"
    assert meta.startswith(f"{ids}:2\nevent: meta\n".encode())  # our Meta, the upstream's
    token, _ = await stream.next_chunk()
    assert token == f"{ids}:3\ndata: tick\n\n".encode()

    await stream.disconnect()

    [upstream] = fake_workers_ai.requests
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)
    for _ in range(100):
        row = await Generation.objects.afirst()
        if row is not None:
            break
        await asyncio.sleep(0.05)
    assert row is not None and row.status == Generation.Status.CANCELLED
