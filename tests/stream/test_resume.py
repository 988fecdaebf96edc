"""Streams that survive a dropped connection (issue 14), in one process: every event's id, a
resume by `Last-Event-ID` (while the generation runs, in its grace after a drop, after its end),
the grace running out, the stop endpoint, and the WebSocket's `resume` frame. Through the real
ASGI app (a cut is a real `http.disconnect`) and the fake Workers AI upstream on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.cache import JSONSerializer
from quotes.ai.events import Done, Event, Meta, Token, Usage, decode_events, encode_events
from quotes.ai.gateway import admission
from quotes.ai.gateway import runs as runs_module
from quotes.ai.gateway.rows import Record, RowFacts
from quotes.ai.gateway.runs import STOPPED, EventLog, Flight, Run, merged
from quotes.models import Generation, Persona
from tests.asgi import TEST_CLIENT, AsgiStream, htmx_form_post, parse_sse, post_stream, read_events, request

pytestmark = pytest.mark.django_db(transaction=True)

STREAM_URL = "/api/quotes/stream"
TOKENS = [f"w{i} " for i in range(150)]  # over two of the log's joined chunks (64 tokens)
TEXT = "".join(TOKENS)
#: An event id of a generation nobody is writing (its id, and a resume key).
UNKNOWN = f"00000000-0000-4000-8000-000000000000.{'0' * 16}"
#: A page's fetch() of the stream (a GET must accept the stream, or say it is a fetch).
FETCH = {"sec-fetch-dest": "empty"}
LAST_ID = re.compile(rb"(?m)^id: ([0-9a-f-]{36}\.[0-9a-f]{16}:\d+)$")


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    workers_ai_settings.QUOTES_GATEWAY = replace(
        workers_ai_settings.QUOTES_GATEWAY, resume_grace_s=10.0, cache_ttl=0
    )
    yield fake_workers_ai
    # No run may outlive its test (its loop): those ending are waited for; any other is a bug,
    # stopped here and reported.
    left = [run for run in runs_module.runs.values() if not run.closing]
    for run in list(runs_module.runs.values()):
        await run.stop()
        if run.finishing is not None:
            await asyncio.wait_for(asyncio.shield(run.finishing), 10)
    await reset_backends()
    assert not left, f"runs left running after the test: {[run.public_id for run in left]}"


def text_of(body: bytes) -> str:
    text = ""
    for event in parse_sse(body):
        if event["event"] == "message" and event["data"] != "[DONE]":
            text += json.loads(event["data"]).get("response", "")
    return text


def last_id(body: bytes) -> str:
    return LAST_ID.findall(body)[-1].decode()


async def row_of(public_id: str, timeout_s: float = 10.0) -> Generation:
    for _ in range(int(timeout_s / 0.02)):
        row = await Generation.objects.filter(public_id=public_id).afirst()
        if row is not None:
            return row
        await asyncio.sleep(0.02)
    raise AssertionError(f"no row for {public_id}")


async def cut(fake: FakeWorkersAI, *, events: int = 6) -> tuple[AsgiStream, bytes, str]:
    """Start a slow stream, read `events` events, then drop the connection."""
    fake.script(Scenario(tokens=TOKENS, token_delay_s=0.01))
    stream = post_stream()
    received = await read_events(stream, events)
    generation_id = stream.response.headers["x-generation-id"] if stream.response else ""
    await stream.disconnect()
    return stream, received, generation_id


@pytest.mark.integration
def test_resume_event_log_gives_back_every_event_after_the_caches_json() -> None:
    gid = "0b4c2a5e-6f1d-4e2b-9c3a-7d8e9f0a1b2c"
    events: list[Event] = [Meta(model="m", headers={"cf-aig-log-id": "x"}, generation_id=gid)]
    events += [Token("é" * (i % 5) + str(i)) for i in range(200)]
    events += [Usage(prompt_tokens=3, completion_tokens=200), Done()]
    log = EventLog()
    for event in events:
        log.append(event)
        assert log.at(len(log) - 1) == event  # readable at once (a live listener)

    # As the cache keeps a finished one: its events as JSON, through the cache's serializer.
    serializer = JSONSerializer()
    stored = serializer.loads(serializer.dumps(encode_events(map(log.at, range(len(log))))))
    kept = EventLog.of(decode_events(stored))

    assert [kept.at(i) for i in range(len(kept))] == events
    assert kept.text(len(kept)) == "".join(e.text for e in events if isinstance(e, Token))
    assert kept.text(3) == "".join(e.text for e in events[:3] if isinstance(e, Token))
    assert merged(map(kept.at, range(5))) == events[0]


# -- the ids ----------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
async def test_resume_every_event_carries_its_generation_id_and_number(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    response = await request("POST", STREAM_URL, json_body={"persona": persona.slug})

    generation_id = response.headers["x-generation-id"]
    assert generation_id == response.headers["x-quote-id"]
    blocks = response.body.decode().split("\n\n")[:-1]
    numbers = [int(re.match(rf"id: {generation_id}\.[0-9a-f]{{16}}:(\d+)\n", block)[1]) for block in blocks]  # type: ignore[index]
    assert numbers == sorted(set(numbers)) and numbers[0] >= 1  # increasing, one per event


@pytest.mark.integration
@pytest.mark.services
async def test_resume_eventsource_gets_a_retry_first(persona: Persona, fake: FakeWorkersAI) -> None:
    response = await request(
        "GET", STREAM_URL, query=f"persona={persona.slug}", headers={"accept": "text/event-stream"}
    )
    assert response.status == 200
    assert re.match(rb"id: [0-9a-f-]{36}\.[0-9a-f]{16}:\d+\nretry: 1000\n\n", response.body)


# -- resume -----------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "client",
    [
        pytest.param(TEST_CLIENT, id="same-address", marks=pytest.mark.services),
        # The key is not tied to the address: a phone that moves from Wi-Fi to mobile resumes.
        pytest.param(("10.1.2.3", 40000), id="another-address"),
    ],
)
async def test_resume_after_a_cut_with_last_event_id_gives_exactly_the_rest(
    persona: Persona, fake: FakeWorkersAI, client: tuple[str, int]
) -> None:
    _, received, generation_id = await cut(fake)

    resumed = await request(
        "POST",
        STREAM_URL,
        json_body={"persona": persona.slug},
        headers={"last-event-id": last_id(received)},
        client=client,
    )

    assert resumed.status == 200 and resumed.headers["content-type"] == "text/event-stream"
    assert resumed.headers["x-generation-id"] == generation_id
    assert resumed.body.endswith(b"data: [DONE]\n\n")
    assert text_of(received) + text_of(resumed.body) == TEXT  # nothing lost, nothing twice
    assert len(fake.requests) == 1  # one generation
    row = await row_of(generation_id)
    assert (row.status, row.text) == (Generation.Status.OK, TEXT)
    assert await Generation.objects.acount() == 1


@pytest.mark.integration
@pytest.mark.services
async def test_resume_in_the_grace_by_query_parameter(persona: Persona, fake: FakeWorkersAI) -> None:
    _, received, generation_id = await cut(fake, events=3)
    await asyncio.sleep(0.3)  # the generation runs on with nobody reading it

    resumed = await request("GET", STREAM_URL, query=f"last_event_id={last_id(received)}", headers=FETCH)

    assert text_of(received) + text_of(resumed.body) == TEXT
    assert len(fake.requests) == 1
    assert (await row_of(generation_id)).status == Generation.Status.OK


@pytest.mark.integration
@pytest.mark.services
async def test_resume_after_the_end_from_the_finished_events(persona: Persona, fake: FakeWorkersAI) -> None:
    _, received, generation_id = await cut(fake)
    row = await row_of(generation_id)  # the generation finished in its grace, with nobody reading
    for _ in range(100):
        if generation_id not in runs_module.runs:
            break
        await asyncio.sleep(0.02)
    assert generation_id not in runs_module.runs  # ended: what follows comes from the cache

    resumed = await request("GET", STREAM_URL, query=f"last_event_id={last_id(received)}", headers=FETCH)
    again = await request("GET", STREAM_URL, query=f"last_event_id={last_id(resumed.body)}", headers=FETCH)

    assert row.status == Generation.Status.OK
    assert text_of(received) + text_of(resumed.body) == TEXT
    assert resumed.body.endswith(b"data: [DONE]\n\n")
    assert (again.status, again.body) == (200, b"")  # after the last event: nothing more
    assert len(fake.requests) == 1


@pytest.mark.system
async def test_resume_after_the_end_from_redis(
    persona: Persona, fake: FakeWorkersAI, redis_cache: Any
) -> None:
    """With Redis as the cache, a finished generation's log is kept there (so any process could
    serve a late resume), with its TTL."""
    _, received, generation_id = await cut(fake)
    await row_of(generation_id)
    for _ in range(100):
        if generation_id not in runs_module.runs:
            break
        await asyncio.sleep(0.02)
    [key] = [k for k in redis_cache.scan_iter(match=f"*quotes:run:{generation_id}")]
    assert 0 < redis_cache.ttl(key) <= 300

    resumed = await request("GET", STREAM_URL, query=f"last_event_id={last_id(received)}", headers=FETCH)

    assert text_of(received) + text_of(resumed.body) == TEXT
    assert len(fake.requests) == 1


@pytest.mark.integration
@pytest.mark.services
async def test_resume_is_a_connection_counted_at_the_open_stream_cap(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """The cap counts connections (quotes.ai.gateway.admission): a generation in its grace, its
    client gone, holds none, so a new stream is admitted; while that one is open, a resume is
    refused like a new stream (503, Retry-After); once it has closed, the resume is served."""
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=1)
    _, received, _ = await cut(fake)
    resume_query = f"persona={persona.slug}&last_event_id={last_id(received)}"
    fake.script(Scenario(tokens=TOKENS, token_delay_s=0.01))
    other = post_stream()
    await read_events(other, 2)  # the process's one connection

    refused = await request("GET", STREAM_URL, query=resume_query, headers=FETCH)
    await other.disconnect()
    resumed = await request("GET", STREAM_URL, query=resume_query, headers=FETCH)

    assert (refused.status, refused.json()["error"]["code"]) == (503, "over_capacity")
    assert refused.headers["retry-after"]
    assert resumed.status == 200
    assert text_of(received) + text_of(resumed.body) == TEXT


@pytest.mark.integration
@pytest.mark.services
async def test_resume_unknown_or_malformed_ids_are_refused(persona: Persona, fake: FakeWorkersAI) -> None:
    unknown = await request(
        "POST",
        STREAM_URL,
        json_body={"persona": persona.slug, "last_event_id": f"{UNKNOWN}:3"},
    )
    malformed = await request("GET", STREAM_URL, query="last_event_id=nonsense", headers=FETCH)
    htmx = await request(
        "POST",
        STREAM_URL,
        json_body={"persona": persona.slug},
        headers={"hx-request": "true", "last-event-id": f"{UNKNOWN}:3"},
    )

    assert (unknown.status, unknown.json()["error"]["code"]) == (404, "resume_unavailable")
    assert (malformed.status, malformed.json()["error"]["code"]) == (400, "invalid_last_event_id")
    assert htmx.status == 404 and htmx.headers["content-type"] == "text/event-stream"
    [error] = parse_sse(htmx.body)
    assert error["event"] == "error" and json.loads(error["data"])["code"] == "resume_unavailable"
    assert fake.requests == []  # none of them started a generation


@pytest.mark.integration
@pytest.mark.services
async def test_resume_the_page_form_by_its_last_event_id_field(persona: Persona, fake: FakeWorkersAI) -> None:
    fake.script(Scenario(tokens=TOKENS))
    whole = await htmx_form_post({"persona": persona.slug})
    blocks = whole.body.decode().split("\n\n")[:-1]
    fragments = [b for b in blocks if "\nevent: " not in b]  # unnamed messages: the text
    cut = LAST_ID.findall(fragments[9].encode())[0].decode()  # as if the page had seen 10

    resumed = await htmx_form_post({"persona": persona.slug, "last_event_id": cut})

    def text(body: str) -> str:
        return "".join(e["data"] for e in parse_sse(body.encode()) if e["event"] == "message")

    assert resumed.status == 200
    assert text("\n\n".join(fragments[:10]) + "\n\n") + text(resumed.body.decode()) == text(
        whole.body.decode()
    )
    assert parse_sse(resumed.body)[-1]["event"] == "done"
    assert len(fake.requests) == 1


@pytest.mark.integration
async def test_resume_by_the_quote_id_alone_reads_nothing_and_keeps_nothing_alive(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """Issue 29: a quote's id is in its permalink and its headers; another client that knows it
    got the whole text with `Last-Event-ID: <id>:0`, and kept the abandoned run alive reading
    it. Only the stream's own event ids carry its resume key."""
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, resume_grace_s=0.5)
    fake.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 3)
    quote_id = stream.response.headers["x-quote-id"] if stream.response else ""
    await stream.disconnect()
    stranger = ("10.9.8.7", 50000)

    def resume_as_stranger(last_event_id: str) -> Any:
        headers = {"last-event-id": last_event_id}
        return request(
            "POST", STREAM_URL, json_body={"persona": persona.slug}, headers=headers, client=stranger
        )

    by_id = await resume_as_stranger(f"{quote_id}:0")
    wrong_key = await resume_as_stranger(f"{quote_id}.{'0' * 16}:0")
    unknown = await resume_as_stranger(f"{UNKNOWN}:0")

    assert by_id.status == 400 and by_id.json()["error"]["code"] == "invalid_last_event_id"
    assert (wrong_key.status, wrong_key.json()) == (404, unknown.json())  # as if there were no such quote
    [upstream] = fake.requests
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)  # nobody kept it alive
    row = await row_of(quote_id)
    assert (row.status, row.error_code) == (Generation.Status.CANCELLED, "abandoned")
    assert b"tick" not in by_id.body + wrong_key.body


# -- gone, and stopped ------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
async def test_resume_grace_runs_out_the_upstream_is_closed_and_the_row_says_abandoned(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, resume_grace_s=0.3)
    fake.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 3)
    generation_id = stream.response.headers["x-generation-id"] if stream.response else ""
    await stream.disconnect()

    [upstream] = fake.requests
    assert not upstream.client_disconnected.is_set()  # still running: resumable
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)  # closed after the grace
    row = await row_of(generation_id)
    assert (row.status, row.error_code) == (Generation.Status.CANCELLED, "abandoned")
    assert row.text.startswith("ticktick") and len(row.text) < 4 * 500


@pytest.mark.integration
@pytest.mark.services
async def test_resume_stop_endpoint_stops_at_once_for_its_own_client_only(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    fake.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    stream = post_stream()
    await read_events(stream, 3)
    generation_id = stream.response.headers["x-generation-id"] if stream.response else ""
    stop_url = f"/api/quotes/{generation_id}/stop"

    other = await request("POST", stop_url, client=("10.9.8.7", 50000))
    unknown = await request("POST", "/api/quotes/00000000-0000-4000-8000-000000000000/stop")
    stopped = await request("POST", stop_url)
    rest = await stream.read_all()

    assert (other.status, other.json()["error"]["code"]) == (404, "unknown_stream")
    assert unknown.status == 404 and unknown.json() == other.json()  # an id tells nothing
    assert (stopped.status, stopped.json()) == (200, {"id": generation_id, "stopped": True})
    [upstream] = fake.requests
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 2)
    row = await Generation.objects.aget(public_id=generation_id)  # written before the answer
    assert (row.status, row.error_code) == (Generation.Status.CANCELLED, "stopped")
    assert parse_sse(rest.body)[-1]["event"] == "error"  # the open stream hears it too
    # Ended: nothing left to stop, said plainly to its client; still nothing to anyone else.
    again = await request("POST", stop_url)
    assert (again.status, again.json()) == (200, {"id": generation_id, "stopped": False})
    assert (await request("POST", stop_url, client=("10.9.8.7", 50000))).json() == other.json()


@pytest.mark.integration
async def test_a_stop_ends_a_connection_before_the_events_it_has_not_sent(persona: Persona) -> None:
    """`Run.stop()` ends its connections now: one that has not yet sent what the run holds (a
    slow client, a resume from far behind) hears `stopped` next, not the rest first."""
    facts = RowFacts(
        persona=persona,
        version=None,
        backend="local",
        topic="stop",
        request=persona.build_request(topic="stop"),
        client_hash="",
        preview=False,
        transport="other",
    )
    flight = Flight()
    run = Run(record=Record(started=time.perf_counter()), facts=facts, client_key="k", flight=flight)
    for n in range(10):
        flight.publish(Token(f" w{n}"))
    ticket = await admission.admit("k", django_settings.QUOTES_GATEWAY)
    assert isinstance(ticket, admission.Ticket)
    events = run.subscribe(1, ticket=ticket).events()  # after its opening Meta
    assert await anext(events) == Token(" w0")

    assert await run.stop()

    assert [event async for event in events] == [STOPPED]
    [row] = await sync_to_async(list)(Generation.objects.filter(public_id=run.public_id))
    assert (row.status, row.error_code) == ("cancelled", "stopped")


# -- the WebSocket ----------------------------------------------------------------------------------


async def connect() -> WebsocketCommunicator:
    from config.asgi import application

    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    connected, _ = await socket.connect()
    assert connected
    return socket


@pytest.mark.integration
@pytest.mark.services
async def test_resume_websocket_frame_gives_the_frames_after_the_id(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    fake.script(Scenario(tokens=TOKENS, token_delay_s=0.01))
    first = await connect()
    await first.send_json_to({"type": "start", "persona": persona.slug})
    frames = []
    while len([f for f in frames if f["type"] == "token"]) < 5:
        frames.append(await first.receive_json_from(timeout=10))
    await first.disconnect()
    seen = "".join(f["text"] for f in frames if f["type"] == "token")
    assert all(re.fullmatch(r"[0-9a-f-]{36}\.[0-9a-f]{16}:\d+", f["event_id"]) for f in frames)

    second = await connect()
    await second.send_json_to({"type": "resume", "last_event_id": frames[-1]["event_id"]})
    rest = []
    while not rest or rest[-1]["type"] not in ("done", "error"):
        rest.append(await second.receive_json_from(timeout=10))
    await second.send_json_to({"type": "resume", "last_event_id": "nonsense"})
    refused = await second.receive_json_from(timeout=10)
    quote_id = frames[0]["id"]
    await second.send_json_to({"type": "resume", "last_event_id": f"{quote_id}.{'0' * 16}:0"})
    wrong_key = await second.receive_json_from(timeout=10)
    await second.disconnect()

    assert rest[-1]["type"] == "done"
    assert seen + "".join(f["text"] for f in rest if f["type"] == "token") == TEXT
    assert len(fake.requests) == 1
    assert refused["code"] == "invalid_last_event_id"
    assert wrong_key["code"] == "resume_unavailable"  # the id alone reads nothing
    assert (await Generation.objects.aget()).status == Generation.Status.OK
