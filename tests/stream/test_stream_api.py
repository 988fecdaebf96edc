"""The stream endpoint, through the real ASGI application, on the real embedded model."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

import pytest

from quotes.ai.backends.local import LocalBackend
from quotes.models import Generation, Persona
from tests.asgi import AsgiStream, parse_sse, request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

TOKEN_EVENT = re.compile(r'data: \{"response":"(?:[^"\\]|\\.)*"\}\n\n')


def post_stream(body: dict[str, object], **headers: str) -> AsgiStream:
    return AsgiStream(
        "POST",
        "/api/quotes/stream",
        body=json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
    )


async def test_stream_post_sends_the_workers_ai_wire_format(persona: Persona) -> None:
    # Asked as a browser asks (gzip, br accepted): the stream is still never compressed.
    response = await request(
        "POST",
        "/api/quotes/stream",
        json_body={"persona": persona.slug},
        headers={"accept-encoding": "gzip, br"},
    )

    assert response.status == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in response.headers
    assert response.headers["x-quote-model"] == "gemma-3-270m"

    events = parse_sse(response.body)
    *tokens, usage, done = events
    assert done == {"event": "message", "data": "[DONE]"}
    assert tokens, "at least one token"
    body_text = response.body.decode()
    for token in tokens:
        assert token["event"] == "message"
        assert TOKEN_EVENT.fullmatch(f"data: {token['data']}\n\n"), token
    usage_payload = json.loads(usage["data"])
    assert usage_payload["response"] == ""
    counts = usage_payload["usage"]
    assert counts["prompt_tokens"] > 0 < counts["completion_tokens"]
    assert counts["total_tokens"] == counts["prompt_tokens"] + counts["completion_tokens"]
    # Every event carries its resume id, `<generation id>.<key>:<n>` (n counts the generation's events).
    generation_id = response.headers["x-generation-id"]
    assert re.search(rf"}}}}\n\nid: {generation_id}\.[0-9a-f]{{16}}:\d+\ndata: \[DONE\]\n\n$", body_text)
    assert body_text.count("\nid: ") + body_text.startswith("id: ") == len(events)
    assert re.match(rb"id: [0-9a-f-]{36}\.[0-9a-f]{16}:\d+\ndata: ", response.body)

    text = "".join(json.loads(t["data"])["response"] for t in tokens)
    row = await Generation.objects.aget()
    assert response.headers["x-quote-id"] == str(row.public_id)  # the permalink, known up front
    assert row.status == Generation.Status.OK
    assert row.backend == "local"
    assert row.model == "gemma-3-270m"
    assert row.text == text
    assert row.topic == "hard honest work"
    assert row.prompt_tokens == counts["prompt_tokens"]
    assert row.completion_tokens == counts["completion_tokens"]
    assert row.ttft_ms is not None and row.duration_ms is not None and row.ttft_ms <= row.duration_ms


async def test_stream_get_for_eventsource_matches_post(persona: Persona) -> None:
    response = await request(
        "GET",
        "/api/quotes/stream",
        query=f"persona={persona.slug}&topic=the%20sea",
        headers={"accept": "text/event-stream"},
    )

    assert response.status == 200
    events = parse_sse(response.body)
    assert (events[-1]["event"], events[-2]["data"]) == ("done", "[DONE]")
    assert "usage" in json.loads(events[-3]["data"])
    row = await Generation.objects.aget()
    assert (row.status, row.topic) == (Generation.Status.OK, "the sea")


async def test_stream_sends_the_first_event_before_generation_finishes(
    persona: Persona, local_backend: LocalBackend
) -> None:
    stream = post_stream({"persona": persona.slug})
    await stream.start()
    first, more = await stream.next_chunk()
    job = local_backend.jobs[-1]
    assert re.match(rb'id: [0-9a-f-]{36}\.[0-9a-f]{16}:\d+\ndata: \{"response":', first)
    assert more
    response = await stream.read_all()
    # The first token left the server while the model thread was still writing.
    assert job.finished_at is not None
    assert response.chunk_times[0] < job.finished_at
    assert job.generated_tokens >= 2


BAD_REQUESTS = [
    pytest.param(
        "POST",
        {"content-type": "text/plain"},
        b'{"persona": "test-watts"}',
        415,
        "unsupported_media_type",
        id="not-json-type",
    ),
    pytest.param(
        "POST",
        {"content-type": "application/x-www-form-urlencoded"},
        b"persona=test-watts",
        415,
        "unsupported_media_type",
        id="form-post",
    ),
    pytest.param(
        "POST",
        {"content-type": "application/json"},
        b'{"persona": ',
        400,
        "invalid_json",
        id="truncated-json",
    ),
    pytest.param(
        "POST", {"content-type": "application/json"}, b"\xff\xfe{}", 400, "invalid_json", id="invalid-utf8"
    ),
    pytest.param(
        "POST", {"content-type": "application/json"}, b'["test-watts"]', 400, "invalid_json", id="json-array"
    ),
    pytest.param(
        "POST", {"content-type": "application/json"}, b"{}", 400, "missing_persona", id="missing-persona"
    ),
    pytest.param(
        "POST",
        {"content-type": "application/json"},
        b'{"persona": 7}',
        400,
        "invalid_persona",
        id="persona-number",
    ),
    pytest.param(
        "POST",
        {"content-type": "application/json"},
        b'{"persona": "nobody"}',
        404,
        "unknown_persona",
        id="unknown-persona",
    ),
    pytest.param(
        "POST",
        {"content-type": "application/json"},
        b'{"persona": "test-watts", "topic": ["a"]}',
        400,
        "invalid_topic",
        id="topic-list",
    ),
    pytest.param(
        "POST",
        {"content-type": "application/json"},
        json.dumps({"persona": "test-watts", "topic": "x" * 201}).encode(),
        400,
        "topic_too_long",
        id="topic-too-long",
    ),
    pytest.param(
        "POST",
        {"content-type": "application/json"},
        b'{"persona": "' + b"x" * 100_000 + b'"}',
        413,
        "body_too_large",
        id="huge-body",
    ),
    pytest.param(
        "PUT",
        {"content-type": "application/json"},
        b'{"persona": "test-watts"}',
        405,
        "method_not_allowed",
        id="put",
    ),
    pytest.param("DELETE", {}, b"", 405, "method_not_allowed", id="delete"),
]


@pytest.mark.parametrize(("method", "headers", "body", "status", "code"), BAD_REQUESTS)
async def test_stream_rejects_bad_input_with_a_json_error(
    persona: Persona, method: str, headers: dict[str, str], body: bytes, status: int, code: str
) -> None:
    headers = {**headers, "content-length": str(len(body))}
    response = await request(method, "/api/quotes/stream", body=body, headers=headers)

    assert response.status == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"]
    assert not await Generation.objects.aexists()  # nothing was generated, so nothing to log


async def test_stream_rejects_an_inactive_persona(persona: Persona) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(is_active=False)
    response = await request(
        "GET", "/api/quotes/stream", query=f"persona={persona.slug}", headers={"accept": "text/event-stream"}
    )
    assert response.status == 404
    assert response.json()["error"]["code"] == "unknown_persona"


async def test_stream_treats_the_topic_as_text_not_a_template(persona: Persona) -> None:
    topic = "{topic} {0} {__class__} %s"
    response = await request(
        "POST", "/api/quotes/stream", json_body={"persona": persona.slug, "topic": topic}
    )
    assert response.status == 200
    row = await Generation.objects.aget()
    assert row.topic == topic
    assert row.request["messages"][1]["content"].endswith(f"about {topic} as if you were Alan Watts")


async def test_stream_rate_limit_counts_concurrent_requests_exactly(persona: Persona, settings: Any) -> None:
    """Counting is atomic: of 12 requests at once under a limit of 5, exactly 5 get through.
    (Django's async cache `aincr` is a get then a set, and would let more through.)"""
    settings.QUOTES_GATEWAY = replace(
        settings.QUOTES_GATEWAY,
        rate_limit=(5, 3600),  # a window that will not turn over mid-test
        max_concurrent_streams=100,
    )
    bodies = [{"persona": persona.slug, "topic": f"topic {i}"} for i in range(12)]
    streams = [post_stream(body) for body in bodies]
    starts = await asyncio.gather(*(stream.start(timeout=120) for stream in streams))
    for stream in streams:
        await stream.read_all(timeout=120)

    statuses = sorted(response.status for response in starts)
    assert statuses == [200] * 5 + [429] * 7
    assert all(
        s.response and s.response.headers.get("retry-after") for s in streams if s.response.status == 429
    )
