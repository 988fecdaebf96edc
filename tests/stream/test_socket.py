"""The WebSocket transport (Channels' communicator against the real ASGI app): the same
generations as the HTTP stream, as JSON frames; a cancel stops one, a resume frame reads one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.models import Generation, Persona
from tests.fixtures import saved

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    await saved(persona, model="@cf/meta/llama-3.1-8b-instruct-fp8")
    return fake


@pytest.fixture
async def socket() -> AsyncIterator[WebsocketCommunicator]:
    from config.asgi import application

    communicator = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://testserver"), (b"host", b"testserver")]
    )
    communicator.scope["client"] = ("127.0.0.1", 50000)
    connected, _ = await communicator.connect()
    assert connected
    yield communicator
    await communicator.disconnect()


async def frames_until(socket: WebsocketCommunicator, kind: str) -> list[dict[str, Any]]:
    frames = []
    while not frames or frames[-1]["type"] != kind:
        frames.append(await socket.receive_json_from(timeout=10))
        assert frames[-1]["type"] != "error" or kind == "error", frames[-1]
    return frames


async def test_a_start_streams_meta_tokens_and_done_and_logs_a_row(
    fake: FakeWorkersAI, socket: WebsocketCommunicator
) -> None:
    await socket.send_json_to({"type": "start", "persona": "test-watts", "topic": "rain"})
    frames = await frames_until(socket, "done")
    assert frames[0]["type"] == "meta" and frames[0]["model"] == "@cf/meta/llama-3.1-8b-instruct-fp8"
    assert "".join(f["text"] for f in frames if f["type"] == "token") == "Stay hungry, stay foolish."
    assert frames[-1]["usage"]["total_tokens"] == 18 and all("event_id" in f for f in frames)
    row = await Generation.objects.aget(public_id=frames[-1]["id"])
    assert row.status == "ok"


async def test_a_cancel_stops_the_upstream_and_a_second_start_waits_for_it(
    fake: FakeWorkersAI, socket: WebsocketCommunicator
) -> None:
    fake.script(Scenario(tokens=["tick"] * 300, token_delay_s=0.02))
    await socket.send_json_to({"type": "start", "persona": "test-watts"})
    frames = await frames_until(socket, "token")
    await socket.send_json_to({"type": "start", "persona": "test-watts"})
    assert (await frames_until(socket, "error"))[-1]["code"] == "busy_socket"
    await socket.send_json_to({"type": "cancel"})
    while (await socket.receive_json_from(timeout=5))["type"] != "cancelled":
        pass
    assert fake.requests[0].client_disconnected.wait(1)
    row = await Generation.objects.aget(public_id=frames[0]["id"])
    assert (row.status, row.error_code) == ("cancelled", "stopped")


async def test_a_resume_frame_gives_the_frames_after_the_id(
    fake: FakeWorkersAI, socket: WebsocketCommunicator
) -> None:
    await socket.send_json_to({"type": "start", "persona": "test-watts"})
    frames = await frames_until(socket, "done")
    await socket.send_json_to({"type": "resume", "last_event_id": frames[2]["event_id"]})
    again = await frames_until(socket, "done")
    assert [f["event_id"] for f in again] == [f["event_id"] for f in frames[3:]]
    await socket.send_json_to({"type": "resume", "last_event_id": "nonsense"})
    assert (await frames_until(socket, "error"))[-1]["code"] == "invalid_last_event_id"
