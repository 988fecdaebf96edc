"""The stream's htmx dialect through the real ASGI app: HTML-escaped text fragments (unnamed
messages, which hx-sse appends) and named `meta`, `done` and `error` events; the page's form,
posted to its own URL under Django's CSRF check; the JSON format untouched for everyone else."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.models import Generation, Persona
from tests.asgi import htmx_form_post, parse_sse, request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


def data_of(events: list[dict[str, str]], name: str) -> dict[str, Any]:
    [event] = [e for e in events if e["event"] == name]
    return json.loads(event["data"])


async def test_htmx_form_streams_escaped_fragments_and_named_events(persona: Persona, fake: Any) -> None:
    fake.script(Scenario(tokens=("A <b>", "&", " 'x'\n", "</b>.")))

    response = await htmx_form_post({"persona": persona.slug, "topic": "silence"})

    assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.body)
    assert [e["event"] for e in events] == ["meta", "message", "message", "message", "message", "done"]
    fragments = [e["data"] for e in events if e["event"] == "message"]
    assert fragments == ["A &lt;b&gt;", "&amp;", " 'x'\n", "&lt;/b&gt;."] and b"<b>" not in response.body
    row = await Generation.objects.aget()
    assert row.text == "A <b>& 'x'\n</b>."
    meta, done, permalink = data_of(events, "meta"), data_of(events, "done"), f"/q/{row.public_id}/"
    assert (meta["id"], meta["permalink"], meta["model"]) == (str(row.public_id), permalink, row.model)
    assert meta["model_url"].startswith("https://") and meta["cache_status"] in ("MISS", "BYPASS")
    usage = done["usage"]
    assert done["permalink"] == permalink
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert fake.requests[-1].json["messages"][-1]["content"].endswith("silence as if you were Alan Watts")


async def test_htmx_whitespace_only_token_travels_with_the_next_one(persona: Persona, fake: Any) -> None:
    """hx-sse swaps no message whose data is only whitespace, so a lone " " (Gemma writes one
    before a digit) would vanish from the page: "together - 3-4" showed as "together -3-4"."""
    fake.script(Scenario(tokens=("together", " -", " ", "3", "-", "4", " ", "\n", "months")))

    response = await htmx_form_post({"persona": persona.slug, "topic": "time"})

    fragments = [e["data"] for e in parse_sse(response.body) if e["event"] == "message"]
    assert all(fragment.strip() for fragment in fragments), fragments
    assert "".join(fragments) == (await Generation.objects.aget()).text == "together - 3-4 \nmonths"


async def test_htmx_form_sends_the_conversation_as_messages(persona: Persona, fake: FakeWorkersAI) -> None:
    turns = [{"role": "assistant", "content": "Be here."}, {"role": "user", "content": "Why?"}]

    response = await htmx_form_post({"persona": persona.slug, "messages": json.dumps(turns)})

    assert parse_sse(response.body)[-1]["event"] == "done"
    assert fake.requests[-1].json["messages"][-2:] == turns


ASSISTANT_LAST = '[{"role": "assistant", "content": "hi"}]'


@pytest.mark.parametrize(
    ("fields", "csrf", "status", "code"),
    [
        ({"persona": "test-watts"}, None, 403, "csrf_failed"),
        ({"persona": "test-watts"}, "b" * 32, 403, "csrf_failed"),
        ({}, "a" * 32, 400, "missing_persona"),
        ({"persona": "nobody"}, "a" * 32, 404, "unknown_persona"),
        ({"persona": "test-watts", "topic": "x" * 500}, "a" * 32, 400, "topic_too_long"),
        ({"persona": "test-watts", "messages": "not json"}, "a" * 32, 400, "invalid_messages"),
        ({"persona": "test-watts", "messages": ASSISTANT_LAST}, "a" * 32, 400, "invalid_messages"),
    ],
)
async def test_htmx_refusal_is_an_error_event_with_a_readable_message(
    persona: Persona, fields: dict[str, str], csrf: str | None, status: int, code: str
) -> None:
    response = await htmx_form_post(fields, csrf=csrf)

    assert response.status == status and response.headers["content-type"].startswith("text/event-stream")
    [event] = parse_sse(response.body)
    error = json.loads(event["data"])
    assert (event["event"], error["code"]) == ("error", code)
    assert len(error["message"]) > 10 and error.get("retry_after") is None
    if code == "csrf_failed":  # Django's CSRF failure view answers every client: it varies
        assert "Reload" in error["message"] and "hx-request" in response.headers["vary"].lower()
    assert await Generation.objects.acount() == 0


async def test_htmx_rate_limit_error_event_has_retry_after(persona: Any, fake: Any, settings: Any) -> None:
    settings.QUOTES_RATE_LIMIT = "1/minute"
    assert (await htmx_form_post({"persona": persona.slug})).status == 200

    response = await htmx_form_post({"persona": persona.slug})

    assert response.status == 429 and int(response.headers["retry-after"]) > 0
    [event] = parse_sse(response.body)
    error = json.loads(event["data"])
    assert (event["event"], error["code"]) == ("error", "rate_limited")
    assert error["retry_after"] == int(response.headers["retry-after"])


async def test_htmx_json_post_gets_the_htmx_dialect_and_others_workers_ai_s(persona: Any, fake: Any) -> None:
    watts = {"persona": persona.slug}

    async def post(body: dict[str, str], **headers: str) -> Any:
        return await request("POST", "/api/quotes/stream", json_body=body, headers=headers)

    htmx, plain = await post(watts, **{"hx-request": "true"}), await post(watts)
    refused_htmx, refused = await post({}, **{"hx-request": "true"}), await post({})

    assert parse_sse(htmx.body)[-1]["event"] == "done"
    assert parse_sse(plain.body)[-1] == {"event": "message", "data": "[DONE]"}
    assert b"event: meta" not in plain.body
    assert parse_sse(refused_htmx.body)[0]["event"] == "error"
    assert refused.json()["error"]["code"] == "missing_persona"
    for response in (htmx, plain, refused_htmx, refused):  # one URL, two dialects: a cache keeps them apart
        assert "hx-request" in response.headers["vary"].lower()
