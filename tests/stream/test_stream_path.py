"""The stream path under load, through the real ASGI app (config.asgi) and the fake Workers AI
upstream: the per-process open-stream cap (a quick 503 with Retry-After), open streams holding no
OS thread, the group-commit log writer losing no row, and the process-local persona cache
following every change."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.core.cache import cache
from django.db import connection, connections

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.gateway import admission
from quotes.models import Generation, Persona
from quotes.request_threads import MAX_THREADS
from tests.asgi import AsgiStream, StreamedResponse, post_stream

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/quotes/stream"


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    yield fake_workers_ai
    await reset_backends()


@pytest.fixture(autouse=True)
def _roomy_limits(settings: Any) -> None:
    """One test client opens many streams: the per-client limits are not what is tested here."""
    settings.QUOTES_GATEWAY = replace(
        settings.QUOTES_GATEWAY,
        rate_limit=(100_000, 60),
        network_rate_limit=(1_000_000, 60),
        max_concurrent_streams=100_000,
        cache_ttl=0,
    )


def stream(topic: str, *, headers: dict[str, str] | None = None) -> AsgiStream:
    return post_stream({"persona": "test-watts", "topic": topic}, headers=headers)


async def first_token(s: AsgiStream) -> StreamedResponse:
    response = await s.start()
    assert response.status == 200, response
    chunk, more = await s.next_chunk()
    assert more and b'"response":"' in chunk
    return response


async def cap_of_one_held(settings: Any, fake: FakeWorkersAI) -> AsgiStream:
    """The open-stream cap set to 1, and a slow stream (40 tokens, 50 ms apart) holding it."""
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=1)
    fake.default = Scenario(tokens=["tick"] * 40, token_delay_s=0.05)
    held = stream("held")
    await first_token(held)
    return held


async def wait_for_rows(count: int, timeout_s: float = 10.0) -> list[Generation]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        rows = [row async for row in Generation.objects.order_by("id")]
        if len(rows) >= count or asyncio.get_running_loop().time() > deadline:
            return rows
        await asyncio.sleep(0.05)


# -- the open-stream cap --------------------------------------------------------------------------


@pytest.mark.integration
async def test_open_stream_cap_refuses_at_once_with_503_and_retry_after(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, max_open_streams=2)
    fake.default = Scenario(tokens=["tick"] * 40, token_delay_s=0.05)
    held = [stream("one"), stream("two")]
    for s in held:
        await first_token(s)

    refused = stream("three")
    response = await refused.start()
    body = json.loads((await refused.read_all()).body)

    assert response.status == 503
    assert response.headers["retry-after"].isdigit() and int(response.headers["retry-after"]) > 0
    assert body["error"]["code"] == "over_capacity" and body["error"]["message"]
    assert len(fake.requests) == 2  # the refused stream never reached the upstream
    # The held streams are not disturbed, and once one ends a new stream is admitted.
    await held[0].disconnect()
    for _ in range(100):
        if admission.open_streams.count < 2:
            break
        await asyncio.sleep(0.02)
    admitted = stream("four")
    await first_token(admitted)
    await admitted.disconnect()
    await held[1].disconnect()
    rows = await wait_for_rows(4)
    # A refusal is counted in a small row per client and window (quotes/ai/refusals.py).
    [refusal] = [row for row in rows if row.error_code == "over_capacity"]
    assert (refusal.status, refusal.request_count) == (Generation.Status.BUSY, 1)
    assert {row.topic: row.status for row in rows if row.topic}["four"] == Generation.Status.CANCELLED


@pytest.mark.integration
async def test_open_stream_cap_counts_websockets_and_refuses_with_an_error_frame(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    from config.asgi import application

    held = await cap_of_one_held(settings, fake)
    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://testserver"), (b"host", b"testserver")]
    )
    connected, _ = await socket.connect()
    assert connected

    await socket.send_json_to({"type": "start", "persona": persona.slug, "topic": "socket"})
    frame = await socket.receive_json_from(timeout=10)

    assert frame["type"] == "error" and frame["code"] == "over_capacity" and frame["retry_after"] > 0
    await socket.disconnect()
    await held.disconnect()


@pytest.mark.integration
async def test_open_stream_cap_for_htmx_is_a_503_error_event(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    held = await cap_of_one_held(settings, fake)

    refused = stream("htmx", headers={"hx-request": "true"})
    response = await refused.start()
    body = (await refused.read_all()).body

    assert response.status == 503 and int(response.headers["retry-after"]) > 0
    assert response.headers["content-type"].startswith("text/event-stream")
    assert b"event: error\n" in body and b'"over_capacity"' in body
    await held.disconnect()


@pytest.mark.integration
async def test_open_stream_cap_refuses_before_the_session_csrf_auth_and_message_middleware(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """At the cap most requests are refusals: StreamAdmissionGate answers them before Django's
    handler. The answer is the view's (503, Retry-After, the JSON envelope, the refusal counted
    in its row), but none of the later middleware left a mark on it: no session touched (no
    `Vary: Cookie`, no cookie set), no Content-Security-Policy, no X-Frame-Options. The request
    id and the security headers are there, as on every response."""
    held = await cap_of_one_held(settings, fake)

    refusals = [stream(f"refused {i}") for i in range(3)]
    responses = [await s.start() for s in refusals]
    bodies = [json.loads((await s.read_all()).body) for s in refusals]

    for response, body in zip(responses, bodies, strict=True):
        assert response.status == 503 and int(response.headers["retry-after"]) > 0
        assert response.headers["content-type"] == "application/json"
        assert body["error"]["code"] == "over_capacity" and body["error"]["message"]
        assert "cookie" not in response.headers.get("vary", "").lower().split(", ")
        assert "hx-request" in response.headers["vary"].lower()
        assert "set-cookie" not in response.headers
        assert "content-security-policy" not in response.headers
        assert "x-frame-options" not in response.headers
        assert response.headers["x-request-id"] and response.headers["x-content-type-options"] == "nosniff"
    assert len(fake.requests) == 1
    await held.disconnect()
    rows = await wait_for_rows(2)
    # Counted like any refusal: one row for the client's window, its count copied within a second.
    [refusal] = [row for row in rows if row.error_code == "over_capacity"]
    assert refusal.status == Generation.Status.BUSY
    for _ in range(100):
        await refusal.arefresh_from_db()
        if refusal.request_count == 3:
            break
        await asyncio.sleep(0.05)
    assert refusal.request_count == 3


@pytest.mark.integration
async def test_open_stream_cap_refuses_before_djangos_handler_and_its_threads(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """A refusal at the cap never reaches Django's handler (StreamAdmissionGate): no
    request_started signal, whose receivers cost a thread hop per request, and no request
    thread. A request the gate does not refuse (a Host not allowed) goes on to Django, which
    answers it as ever."""
    from django.core.signals import request_started

    held = await cap_of_one_held(settings, fake)
    started: list[object] = []

    def count(**kwargs: Any) -> None:
        started.append(kwargs)

    request_started.connect(count)
    try:
        refusals = [stream(f"refused {i}") for i in range(3)]
        answers = [await s.start() for s in refusals]
        for s in refusals:
            await s.read_all()
        refused_started = len(started)
        bad_host = AsgiStream(
            "POST",
            URL,
            body=json.dumps({"persona": persona.slug, "topic": "t"}).encode(),
            headers={
                "content-type": "application/json",
                "host": "evil.example",
                "origin": "http://evil.example",
            },
        )
        bad_host_answer = await bad_host.start()
        await bad_host.read_all()
    finally:
        request_started.disconnect(count)

    assert [a.status for a in answers] == [503, 503, 503]
    assert refused_started == 0
    assert bad_host_answer.status == 400 and len(started) == 1  # Django's handler, its own answer
    await held.disconnect()


@pytest.mark.integration
async def test_open_stream_cap_refuses_the_page_form_early_but_csrf_still_meets_cross_site_posts(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """The persona page's form (htmx, Django's CSRF) is refused early too when it is a same-site
    post with its CSRF cookie and token: the htmx error event with Retry-After, counted, without
    the marks of the later middleware. A post from another site's page, or without a token,
    still meets Django's CSRF check (403 csrf_failed), at the cap as anywhere."""
    from urllib.parse import urlencode

    held = await cap_of_one_held(settings, fake)
    token = "a" * 32  # an unmasked secret: valid as both the cookie and the form token

    async def form_post(fields: dict[str, str], **headers: str) -> StreamedResponse:
        s = AsgiStream(
            "POST",
            "/quotes/stream",
            body=urlencode({"persona": persona.slug, **fields}).encode(),
            headers={
                "content-type": "application/x-www-form-urlencoded",
                "hx-request": "true",
                "cookie": f"csrftoken={token}",
                **headers,
            },
        )
        await s.start()
        return await s.read_all()

    refused = await form_post({"csrfmiddlewaretoken": token}, origin="http://testserver")
    cross_site = await form_post({"csrfmiddlewaretoken": token}, origin="https://elsewhere.example")
    tokenless = await form_post({})

    assert refused.status == 503 and int(refused.headers["retry-after"]) > 0
    assert refused.headers["content-type"].startswith("text/event-stream")
    assert b"event: error\n" in refused.body and b'"over_capacity"' in refused.body
    assert "x-frame-options" not in refused.headers and "content-security-policy" not in refused.headers
    for answer in (cross_site, tokenless):
        assert answer.status == 403 and b'"csrf_failed"' in answer.body
    assert len(fake.requests) == 1
    await held.disconnect()
    rows = await wait_for_rows(2)
    [refusal] = [row for row in rows if row.error_code == "over_capacity"]
    assert (refusal.status, refusal.request_count) == (Generation.Status.BUSY, 1)


@pytest.mark.integration
async def test_open_stream_cap_refuses_a_request_with_a_session_in_the_view(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    """A request with a session cookie may be a user's, whose refusal is counted under their
    key: it goes through the whole chain and the view refuses it, with every header."""
    held = await cap_of_one_held(settings, fake)

    refused = stream("with a session", headers={"cookie": f"{settings.SESSION_COOKIE_NAME}=not-a-session"})
    response = await refused.start()
    body = json.loads((await refused.read_all()).body)

    assert response.status == 503 and int(response.headers["retry-after"]) > 0
    assert body["error"]["code"] == "over_capacity"
    assert response.headers["x-frame-options"] == "DENY"  # the whole chain ran
    await held.disconnect()


@pytest.mark.integration
async def test_stream_responses_carry_no_csp_but_pages_do(persona: Persona, fake: FakeWorkersAI) -> None:
    """No browser renders a stream (or its JSON error) as a page, so it gets no policy (and the
    policy is not built for it); the pages keep theirs."""
    fake.default = Scenario(tokens=["tick"] * 3)
    ok = stream("a stream")
    response = await first_token(ok)
    await ok.read_all()
    unknown = AsgiStream(
        "POST",
        URL,
        body=b'{"persona": "nobody"}',
        headers={"content-type": "application/json"},
    )
    error = await unknown.start()
    await unknown.read_all()
    page = AsgiStream("GET", f"/personas/{persona.slug}/")
    page_response = await page.start()
    await page.read_all()

    assert "content-security-policy" not in response.headers
    assert error.status == 404 and "content-security-policy" not in error.headers
    assert page_response.status == 200
    assert "frame-ancestors 'none'" in page_response.headers["content-security-policy"]
    # The stream keeps the other security headers.
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"


# -- threads --------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_open_streams_hold_no_thread(persona: Persona, fake: FakeWorkersAI) -> None:
    """Django used to keep a thread per request until its last byte: one per open stream."""
    fake.default = Scenario(tokens=["tick"] * 200, token_delay_s=0.05)
    for warm in range(3):  # the pools of the first requests (request threads, the log writer)
        s = stream(f"warm {warm}")
        await first_token(s)
        await s.disconnect()
    before = threading.active_count()

    streams = [stream(f"open {index}") for index in range(24)]
    for s in streams:
        await first_token(s)
    during = threading.active_count()
    for s in streams:
        await s.disconnect()

    assert during - before < 4, (before, during, [t.name for t in threading.enumerate()])


@pytest.mark.integration
async def test_requests_whose_bodies_never_end_hold_no_request_thread(persona: Persona) -> None:
    """More POSTs than there are request threads send half a body and stall (a server that
    streams bodies hands them on as they come; daphne, which buffers them, does not): a page is
    still served at once. The handler used to lease the request's thread before Django read the
    body, so the 33rd request waited for a thread as long as the stalled clients liked."""
    stalled = [
        AsgiStream("POST", URL, headers={"content-type": "application/json"}) for _ in range(MAX_THREADS + 8)
    ]
    for s in stalled:
        await s.communicator.send_input({"type": "http.request", "body": b'{"persona": ', "more_body": True})
    await asyncio.sleep(0.2)  # every stalled request is in the app, waiting for the rest
    try:
        page = AsgiStream("GET", "/")
        response = await page.start(timeout=10)
        await page.read_all()
    finally:
        for s in stalled:
            await s.disconnect()
    assert response.status == 200


# -- the group-commit log writer ------------------------------------------------------------------


def hold_the_write_lock(locked: threading.Event, release: threading.Event) -> None:
    """Another connection holds the table's write lock until `release` (as a long admin write or
    a backup would): the streams' rows must wait for it, not be lost."""
    try:
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("BEGIN EXCLUSIVE")
            else:
                cursor.execute("BEGIN")
                cursor.execute("LOCK TABLE quotes_generation IN EXCLUSIVE MODE")
            locked.set()
            release.wait(10)
            cursor.execute("COMMIT")
    finally:
        connections.close_all()


@pytest.mark.integration
@pytest.mark.services
async def test_log_writer_loses_no_row_of_many_concurrent_streams(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """Forty streams end together in every way a stream can (done, client gone, upstream dropped,
    upstream error) while another connection holds the write lock: every request has its row,
    and no stream says [DONE] before its row is in."""
    rng = random.Random(7)
    outcomes = [rng.choice(["done", "leave", "drop", "error"]) for _ in range(40)]
    go = threading.Event()
    stall = {"stall_after_tokens": 1, "hold": go}  # all streams are mid-way when the lock is taken
    scripts = {
        "done": Scenario(tokens=["a", "b", "c"], **stall),
        "leave": Scenario(tokens=["tick"] * 100, token_delay_s=0.05, **stall),
        "drop": Scenario(tokens=["a", "b", "c"], drop_after_tokens=2, **stall),
        "error": Scenario.server_error(503),
    }
    fake.script(*(scripts[outcome] for outcome in outcomes))
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_the_write_lock, args=(locked, release))
    lock_taken = asyncio.Event()
    ends: dict[str, str] = {}

    async def one(index: int, outcome: str) -> None:
        s = stream(f"topic {index}")
        response = await s.start()
        if outcome == "error":
            assert response.status == 502
            await s.read_all()
            return
        assert response.status == 200
        await s.next_chunk()
        await lock_taken.wait()
        if outcome == "leave":
            await s.disconnect()
            return
        body = (await s.read_all()).body
        ends[f"topic {index}"] = "done" if body.endswith(b"data: [DONE]\n\n") else "error"
        if body.endswith(b"data: [DONE]\n\n"):
            assert release.is_set()  # the row was written before [DONE], so after the lock

    # Requests go out one after another (the fake answers them in order), then run together.
    tasks = []
    for index, outcome in enumerate(outcomes):
        tasks.append(asyncio.create_task(one(index, outcome)))
        await asyncio.to_thread(fake.wait_for_requests, index + 1)
    holder.start()
    await asyncio.to_thread(locked.wait, 10)
    lock_taken.set()
    go.set()
    await asyncio.sleep(1.5)  # every stream has reached its end, or its wait for its row
    release.set()
    await asyncio.gather(*tasks)
    await asyncio.to_thread(holder.join, 10)

    rows = await wait_for_rows(40)
    by_topic = {row.topic: row.status for row in rows}
    assert len(rows) == 40 and len(by_topic) == 40
    expected = {"done": "ok", "leave": "cancelled", "drop": "error", "error": "error"}
    assert by_topic == {f"topic {i}": expected[o] for i, o in enumerate(outcomes)}
    assert "done" in ends.values() and "error" in ends.values()


@pytest.mark.integration
@pytest.mark.services
async def test_log_writer_a_row_that_cannot_be_written_costs_no_other_row(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """Rows are inserted in batches; a batch with one row the database refuses (its persona was
    deleted while it streamed) is written again row by row, so only that row is lost."""
    doomed = await Persona.objects.acreate(
        slug="doomed", name="Doomed", system_prompt="s", user_prompt_template="u", default_topic="t"
    )
    fake.default = Scenario(tokens=["a", "b"], stall_after_tokens=1, stall_s=0.5)
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_the_write_lock, args=(locked, release))
    streams = [stream(f"kept {index}") for index in range(8)]
    streams.append(
        AsgiStream(
            "POST",
            URL,
            body=json.dumps({"persona": "doomed"}).encode(),
            headers={"content-type": "application/json"},
        )
    )
    for s in streams:
        await first_token(s)
    await sync_to_async(Persona.objects.filter(pk=doomed.pk).delete)()  # no row of it yet: allowed
    holder.start()  # the rows queue up behind the lock, and go in as one batch
    await asyncio.to_thread(locked.wait, 10)
    readers = [asyncio.create_task(s.read_all()) for s in streams]
    await asyncio.sleep(1.0)
    release.set()
    await asyncio.gather(*readers)
    await asyncio.to_thread(holder.join, 10)

    rows = await wait_for_rows(8)
    assert sorted(row.topic for row in rows) == sorted(f"kept {index}" for index in range(8))
    assert all(row.status == Generation.Status.OK for row in rows)


@pytest.mark.integration
@pytest.mark.services
async def test_log_row_keeps_text_postgresql_cannot_store(persona: Persona, fake: FakeWorkersAI) -> None:
    """A NUL from the model used to make PostgreSQL refuse the row (lost); it is dropped instead."""
    fake.script(Scenario(tokens=["a\x00b", " c"]))

    s = stream("nul")
    await s.start()
    await s.read_all()

    [row] = await wait_for_rows(1)
    assert (row.status, row.text) == (Generation.Status.OK, "ab c")


# -- the persona cache ----------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
async def test_persona_cache_follows_saves_updates_and_deactivation(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    async def ask() -> StreamedResponse:
        s = stream("cache")
        await s.start()
        return await s.read_all()

    assert (await ask()).status == 200
    persona.system_prompt = "You are Alan Watts, whispering"
    await persona.asave()
    await ask()
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=7)
    await ask()
    persona.is_active = False
    await persona.asave()
    gone = await ask()

    sent = [request.json for request in fake.requests]
    assert sent[1]["messages"][0]["content"] == "You are Alan Watts, whispering"
    assert sent[2]["max_tokens"] == 7
    assert gone.status == 404


@pytest.mark.system
async def test_persona_cache_follows_another_processs_change_through_redis(
    persona: Persona, fake: FakeWorkersAI, redis_cache: Any
) -> None:
    """Another process changes a persona: its save replaces the version value in Redis, and this
    process, whose memory still holds the old persona, must notice on its next request."""
    from quotes import personas

    first = stream("before")
    await first.start()
    await first.read_all()
    # The change as another process makes it: the row changes (behind this process's back), and
    # that process's save replaces the shared value.
    await asyncio.to_thread(_raw_update, persona.pk, "You are somebody else")
    await asyncio.to_thread(cache.set, personas.VERSION_KEY, "another process's value", None)

    second = stream("after")
    await second.start()
    await second.read_all()

    assert fake.requests[-1].json["messages"][0]["content"] == "You are somebody else"


def _raw_update(pk: int, prompt: str) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE quotes_persona SET system_prompt = %s WHERE id = %s", [prompt, pk])
    finally:
        connections.close_all()


@pytest.mark.integration
async def test_a_drain_cuts_a_stream_whose_body_each_chunk_is_read_in_a_task_of_its_own(
    persona: Persona, settings: Any, fake: FakeWorkersAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain reaches a stream through its run, whatever task reads it: Django happens to
    run a view and its response's body in one task, but does not say so. Here the view's part
    (`stream_response`) runs in the test's task and each body chunk is read in a new task; at
    the deadline the stream still ends with `event: reconnect`, and its row says drained."""
    from quotes import server
    from quotes.ai.gateway.admission import drain
    from quotes.ai.gateway.capacity import open_streams
    from quotes.ai.gateway.generation import Client
    from quotes.quote_request import events_for, parse_quote_request
    from quotes.transports import WorkersAIEncoder, stream_response

    for name in ("draining", "cut"):  # this process drains for this test only
        monkeypatch.setattr(drain, name, False)
    monkeypatch.setattr(open_streams, "emptied", None)
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, drain_timeout_s=0.2)
    fake.default = Scenario(tokens=[f" word{n}" for n in range(200)], token_delay_s=0.05)  # 10 s
    quote = await parse_quote_request({"persona": persona.slug, "topic": "drain"})
    response = await stream_response(
        events_for(quote, Client.from_request("127.0.0.1", None), "sse"), WorkersAIEncoder()
    )
    assert response.status_code == 200
    body = aiter(response)  # as Django's ASGIHandler reads it, but chunk by chunk in new tasks
    received = [await asyncio.create_task(anext(body))]
    draining = asyncio.create_task(server.drain_and_close())
    while (chunk := await asyncio.wait_for(asyncio.create_task(anext(body, None)), 30)) is not None:
        received.append(chunk)
    await asyncio.wait_for(draining, 30)

    *sent, last = received
    assert b"\nevent: reconnect\n" in last, received[-3:]
    assert b"[DONE]" not in b"".join(sent)
    ids = re.findall(rb"^id: (\S+)$", b"".join(sent), re.M)
    assert json.loads(last.rpartition(b"data: ")[2])["last_event_id"].encode() == ids[-1]
    assert [(row.status, row.error_code) for row in await wait_for_rows(1)] == [
        ("cancelled", "server_draining")
    ]
