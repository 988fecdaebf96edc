"""The WebSocket transport (/ws/quotes/) through the real ASGI app and Channels' communicator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.gateway import capacity
from quotes.models import Generation, Persona
from tests.limits import at_start_of_window

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture(autouse=True)
async def _close_backends_on_this_loop() -> AsyncIterator[None]:
    yield
    await reset_backends()


@pytest.fixture
async def socket() -> AsyncIterator[WebsocketCommunicator]:
    from config.asgi import application

    communicator = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    connected, _ = await communicator.connect()
    assert connected
    yield communicator
    # A test that timed out waiting for a frame has had the app cancelled: disconnecting then
    # raises CancelledError, a BaseException, and pytest would skip the finalizers after this one
    # (the database's flush): every later test on that process would fail on the leftover rows.
    with contextlib.suppress(asyncio.CancelledError):
        await communicator.disconnect(timeout=10)


async def frames_until(socket: WebsocketCommunicator, *types: str) -> list[dict[str, Any]]:
    frames = []
    while True:
        frame = await socket.receive_json_from(timeout=30)
        frames.append(frame)
        if frame["type"] in types:
            return frames


async def wait_for_row(status: str) -> Generation:
    for _ in range(100):
        row = await Generation.objects.afirst()
        if row is not None and row.status == status:
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {status} row")


async def test_socket_streams_meta_tokens_and_done(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    await socket.send_json_to({"type": "start", "persona": persona.slug, "topic": "rain"})

    frames = await frames_until(socket, "done", "error")

    assert frames[0]["type"] == "meta"
    tokens = [f["text"] for f in frames if f["type"] == "token"]
    assert tokens == ["Stay", " hungry", ",", " stay", " foolish", "."]
    done = frames[-1]
    row = await Generation.objects.aget()
    assert row.status == Generation.Status.OK and row.text == "".join(tokens)
    assert done["type"] == "done"
    assert done["id"] == str(row.public_id)
    assert done["permalink"] == f"/q/{row.public_id}/"
    assert done["usage"]["total_tokens"] > 0
    assert any(f["type"] == "meta" and f["model"] == row.model for f in frames)
    assert (
        fake_workers_ai.requests[-1]
        .json["messages"][1]["content"]
        .endswith("about rain as if you were Alan Watts")
    )


async def test_socket_sends_the_conversation(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    turns = [{"role": "assistant", "content": "Be here."}, {"role": "user", "content": "Why?"}]
    await socket.send_json_to({"type": "start", "persona": persona.slug, "messages": turns})
    assert (await frames_until(socket, "done", "error"))[-1]["type"] == "done"
    assert fake_workers_ai.requests[-1].json["messages"][-2:] == turns


async def test_socket_cancel_stops_the_upstream_and_logs_cancelled(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    # A cancel is a stop, not a drop: no resume grace however long it is.
    workers_ai_settings.QUOTES_GATEWAY = replace(workers_ai_settings.QUOTES_GATEWAY, resume_grace_s=30.0)
    fake_workers_ai.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    await frames_until(socket, "token")

    await socket.send_json_to({"type": "cancel"})

    frames = await frames_until(socket, "cancelled")
    assert all(f["type"] in ("token", "meta", "cancelled") for f in frames)
    [upstream] = fake_workers_ai.requests
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)
    row = await wait_for_row(Generation.Status.CANCELLED)
    assert row.error_code == "stopped"
    assert row.text.startswith("tick") and len(row.text) < 4 * 500
    # The socket is free again: a new start works.
    fake_workers_ai.script(Scenario())
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    assert (await frames_until(socket, "done", "error"))[-1]["type"] == "done"


async def test_socket_disconnect_stops_the_upstream_and_logs_cancelled(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    from config.asgi import application

    fake_workers_ai.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    assert (await socket.connect())[0]
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    await frames_until(socket, "token")

    await socket.disconnect()

    [upstream] = fake_workers_ai.requests
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)
    row = await wait_for_row(Generation.Status.CANCELLED)
    assert row.text.startswith("tick")


async def test_socket_refuses_a_second_start_while_one_runs(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(Scenario(tokens=["tick"] * 20, token_delay_s=0.02))
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    await frames_until(socket, "token")

    await socket.send_json_to({"type": "start", "persona": persona.slug})

    frames = await frames_until(socket, "error")
    assert frames[-1]["code"] == "busy_socket"
    assert (await frames_until(socket, "done"))[-1]["type"] == "done"
    assert len(fake_workers_ai.requests) == 1


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ({"type": "start"}, "missing_persona"),
        ({"type": "start", "persona": "nobody"}, "unknown_persona"),
        ({"type": "start", "persona": "test-watts", "topic": "x" * 500}, "topic_too_long"),
        ({"type": "start", "persona": "test-watts", "messages": "hi"}, "invalid_messages"),
        ({"type": "dance"}, "invalid_frame"),
        (["start"], "invalid_frame"),
    ],
)
async def test_socket_bad_input_is_an_error_frame(
    socket: WebsocketCommunicator, persona: Persona, frame: Any, code: str
) -> None:
    await socket.send_json_to(frame)

    error = await socket.receive_json_from(timeout=10)

    assert error["type"] == "error"
    assert error["code"] == code
    assert len(error["message"]) > 10
    # The socket survives bad input.
    await socket.send_json_to({"type": "cancel"})
    assert await socket.receive_nothing(timeout=0.2)


async def test_socket_invalid_json_is_an_error_frame(socket: WebsocketCommunicator, persona: Persona) -> None:
    await socket.send_to(text_data="{nope")
    error = await socket.receive_json_from(timeout=10)
    assert (error["type"], error["code"]) == ("error", "invalid_json")


async def test_socket_rate_limit_is_an_error_frame(
    socket: WebsocketCommunicator, persona: Persona, settings: Any
) -> None:
    # An hour's window: a minute's could turn over between the two starts and admit the second.
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, rate_limit=(1, 3600))
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    assert (await frames_until(socket, "done", "error"))[-1]["type"] == "done"

    await socket.send_json_to({"type": "start", "persona": persona.slug})

    error = (await frames_until(socket, "error"))[-1]
    assert error["code"] == "rate_limited"
    assert error["retry_after"] > 0
    rows = [row.status async for row in Generation.objects.order_by("id")]
    assert rows == [Generation.Status.OK, Generation.Status.RATE_LIMITED]


async def test_socket_flood_of_refused_starts_writes_one_counted_row(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    """One socket sent 181 refused `start` frames in 0.9 s, and each wrote a full log row."""
    settings = workers_ai_settings
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, rate_limit=(1, 3600))
    window_left = 60 - time.time() % 60
    if window_left < 15:  # the limit's window must not turn over mid-test
        await asyncio.sleep(window_left + 0.05)
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    assert (await frames_until(socket, "done", "error"))[-1]["type"] == "done"

    for _ in range(100):
        await socket.send_json_to({"type": "start", "persona": persona.slug, "topic": "again"})
        assert (await frames_until(socket, "error"))[-1]["code"] == "rate_limited"

    rows = [row async for row in Generation.objects.order_by("id")]
    assert [row.status for row in rows] == [Generation.Status.OK, Generation.Status.RATE_LIMITED]
    refused = rows[1]
    for _ in range(200):  # counts after the first reach the row a moment later
        await refused.arefresh_from_db()
        if refused.request_count == 100:
            break
        await asyncio.sleep(0.05)
    assert (refused.request_count, refused.topic, refused.request) == (100, "", {})


async def test_socket_from_another_origin_is_refused(persona: Persona) -> None:
    from config.asgi import application

    socket = WebsocketCommunicator(application, "/ws/quotes/", headers=[(b"origin", b"https://evil.example")])
    connected, _ = await socket.connect()
    assert not connected


# -- issue 13, point 4: the frame cap, and every start counted -------------------------------------

MAX_FRAME = 65536  # QUOTES_MAX_FRAME_BYTES's default (that of QUOTES_MAX_BODY_BYTES)


@pytest.mark.parametrize(
    "topic",
    [
        pytest.param("x" * MAX_FRAME, id="ascii"),
        # fewer characters than the cap, more bytes: the cap is on UTF-8 bytes
        pytest.param("€" * (MAX_FRAME // 3 + 10), id="multibyte"),
    ],
)
async def test_socket_frame_over_the_cap_gets_an_error_frame_then_close_1009(
    socket: WebsocketCommunicator, persona: Persona, settings: Any, topic: str
) -> None:
    assert settings.QUOTES_MAX_FRAME_BYTES == MAX_FRAME
    frame = json.dumps({"type": "start", "persona": persona.slug, "topic": topic}, ensure_ascii=False)
    assert len(frame.encode()) > MAX_FRAME

    await socket.send_to(text_data=frame)

    error = await socket.receive_json_from(timeout=10)
    assert error["type"] == "error" and error["code"] == "frame_too_large", error
    assert str(MAX_FRAME) in error["message"]
    assert await socket.receive_output(timeout=10) == {"type": "websocket.close", "code": 1009}
    assert not await Generation.objects.aexists()


async def test_socket_frame_at_the_cap_is_parsed(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    frame = json.dumps({"type": "start", "persona": persona.slug, "topic": ""})
    frame = frame[:-1] + " " * (MAX_FRAME - len(frame)) + "}"  # JSON whitespace up to the cap
    assert len(frame.encode()) == MAX_FRAME

    await socket.send_to(text_data=frame)

    assert (await frames_until(socket, "done", "error"))[-1]["type"] == "done"


async def test_socket_every_start_counts_against_the_rate_limit(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    workers_ai_settings.QUOTES_GATEWAY = replace(workers_ai_settings.QUOTES_GATEWAY, rate_limit=(3, 3600))
    await at_start_of_window()
    for _ in range(3):
        await socket.send_json_to({"type": "start", "persona": "nobody"})
        assert (await socket.receive_json_from(timeout=10))["code"] == "unknown_persona"

    await socket.send_json_to({"type": "start", "persona": "nobody"})
    over = await socket.receive_json_from(timeout=10)
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    valid = (await frames_until(socket, "error", "done"))[-1]

    assert over["code"] == "rate_limited" and over["retry_after"] > 0, over
    assert valid["code"] == "rate_limited", valid  # the invalid starts used up the window
    assert fake_workers_ai.requests == []
    assert [row.status async for row in Generation.objects.all()] == [Generation.Status.RATE_LIMITED]


async def test_socket_a_start_refused_as_busy_counts_too(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    workers_ai_settings.QUOTES_GATEWAY = replace(workers_ai_settings.QUOTES_GATEWAY, rate_limit=(2, 3600))
    await at_start_of_window()
    fake_workers_ai.script(Scenario(tokens=["tick"] * 200, token_delay_s=0.02))
    await socket.send_json_to({"type": "start", "persona": persona.slug})  # 1: the gateway counts it
    await frames_until(socket, "token")

    await socket.send_json_to({"type": "start", "persona": persona.slug})  # 2: refused here, counted
    busy = await frames_until(socket, "error")
    await socket.send_json_to({"type": "start", "persona": persona.slug})  # 3: over the limit
    over = await frames_until(socket, "error")

    assert busy[-1]["code"] == "busy_socket"
    assert over[-1]["code"] == "rate_limited"
    assert len(fake_workers_ai.requests) == 1


async def test_socket_a_refused_start_gives_its_place_back(
    socket: WebsocketCommunicator, persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    """The consumer decides a start's admission before it reads the start; a start refused for
    its input gives its place within the open-stream limit back, so the next one is admitted."""
    options = workers_ai_settings.QUOTES_GATEWAY
    workers_ai_settings.QUOTES_GATEWAY = replace(options, max_open_streams=1)
    await socket.send_json_to({"type": "start", "persona": "nobody-here"})
    refused = await frames_until(socket, "error")
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    admitted = await frames_until(socket, "done", "error")

    assert refused[-1]["code"] == "unknown_persona"
    assert admitted[-1]["type"] == "done"
    assert capacity.open_streams.entering == 0
