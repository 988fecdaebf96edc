"""The database down, through the real ASGI app (config.asgi) with the database made unreachable
for every new connection: a persona this process has loaded keeps streaming from memory (past the
30 s after which it would read it again), its rows wait in memory and are written once the
database is back; anything memory cannot answer is a 503 `service_unavailable` with Retry-After
in its request's dialect (JSON, the htmx error event, a WebSocket error frame, a readable page);
and the outage is one WARNING, not a traceback per request. tests/faults/test_faults.py stops a
real PostgreSQL under load for 35 s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections

from harness.services import free_port
from harness.workers_ai import FakeWorkersAI
from quotes import personas
from quotes.models import Generation, Persona
from quotes.ops.logging import ClientErrorFilter, RequestIdFilter
from tests.asgi import htmx_form_post, parse_sse, post_quote, request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.services]

UNSEEN = "never-loaded"  # a persona slug this process has never loaded


@pytest.fixture
def captured() -> Iterator[list[logging.LogRecord]]:
    """Every record as config/settings.py's console handler passes it on (through its filters)."""
    import config.asgi  # noqa: F401  (its first import configures logging, which replaces root handlers)

    handler = BufferingHandler(capacity=1_000_000)
    handler.addFilter(RequestIdFilter())
    handler.addFilter(ClientErrorFilter())
    logging.getLogger().addHandler(handler)
    yield handler.buffer
    logging.getLogger().removeHandler(handler)


def outage_warnings(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "quotes.personas" and r.levelno >= logging.WARNING]


def errors(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.levelno >= logging.ERROR or r.exc_info]


@contextlib.asynccontextmanager
async def database_down(tmp_path: Path) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Yields `cut()`: from then on every new connection to the default database fails (SQLite: a
    file in a directory that is gone; a server: a port nothing listens on). Restored on the way
    out, before the test's rows are flushed."""
    db = connections["default"].settings_dict  # shared by every thread's connection
    saved = {key: db.get(key) for key in ("NAME", "HOST", "PORT")}

    async def cut() -> None:
        if db["ENGINE"] == "django.db.backends.sqlite3":
            (tmp_path / "gone").mkdir()
            db["NAME"] = str(tmp_path / "gone" / "db.sqlite3")
            shutil.rmtree(tmp_path / "gone")
        else:
            db.update(HOST="127.0.0.1", PORT=str(free_port()))
        await sync_to_async(connections.close_all)()

    try:
        yield cut
    finally:
        db.update(saved)
        await sync_to_async(connections.close_all)()


@pytest.fixture
async def fake(fake: FakeWorkersAI, workers_ai_settings: Any) -> AsyncIterator[FakeWorkersAI]:
    workers_ai_settings.QUOTES_CACHE_TTL = 0
    yield fake
    personas.memory.outage.recovered()  # the next test starts with no outage in this process


def is_quote(body: bytes) -> bool:
    return b'data: {"response":"Stay"' in body and body.endswith(b"data: [DONE]\n\n")


async def test_a_loaded_persona_streams_through_the_outage_and_its_rows_are_written_after(
    persona: Persona,
    fake: FakeWorkersAI,
    captured: list[logging.LogRecord],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert is_quote((await post_quote({"persona": persona.slug, "topic": "before"})).body)
    monkeypatch.setattr(personas, "MAX_AGE_S", 0.0)  # as if its 30 s had passed: it would read it again
    async with database_down(tmp_path) as cut:
        await cut()
        during = [await post_quote({"persona": persona.slug, "topic": f"during {n}"}) for n in range(3)]
        page = await request("GET", f"/personas/{persona.slug}/")
    assert [r.status for r in during] == [200] * 3 and all(is_quote(r.body) for r in during)
    assert page.status == 200 and persona.name in page.body.decode()
    assert len(outage_warnings(captured)) == 1  # one per outage, not one per request
    assert errors(captured) == []
    # The database is back: the rows that waited in memory are written.
    ids = [r.headers["x-quote-id"] for r in during]
    for _ in range(100):
        written = [row async for row in Generation.objects.filter(public_id__in=ids, status="ok")]
        if len(written) == 3:
            break
        await asyncio.sleep(0.1)
    assert sorted(row.topic for row in written) == ["during 0", "during 1", "during 2"]
    assert all(row.text == "Stay hungry, stay foolish." for row in written)


async def test_what_memory_cannot_answer_is_a_503_in_the_requests_dialect(
    persona: Persona, fake: FakeWorkersAI, captured: list[logging.LogRecord], tmp_path: Path
) -> None:
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://testserver"), (b"host", b"testserver")]
    )
    socket_.scope["client"] = ("127.0.0.1", 50000)
    assert (await socket_.connect())[0]
    async with database_down(tmp_path) as cut:
        await cut()
        api = await post_quote({"persona": UNSEEN})
        vote = await request(
            "POST", "/api/quotes/00000000-0000-4000-8000-000000000000/feedback", json_body={"value": 1}
        )
        htmx = [
            await htmx_form_post({"persona": UNSEEN}),
            await post_quote({"persona": UNSEEN}, headers={"hx-request": "true"}),
        ]
        pages = [await request("GET", f"/personas/{UNSEEN}/"), await request("GET", "/")]
        await socket_.send_json_to({"type": "start", "persona": UNSEEN})
        frame = await socket_.receive_json_from(timeout=10)
        await socket_.disconnect(timeout=10)
    for answer in (api, vote):
        assert answer.status == 503 and answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "service_unavailable" and answer.json()["error"]["message"]
    for answer in htmx:
        assert answer.status == 503 and answer.headers["content-type"].startswith("text/event-stream")
        [event] = parse_sse(answer.body)
        assert event["event"] == "error" and "service_unavailable" in event["data"]
    for page in pages:
        assert page.status == 503 and page.headers["content-type"].startswith("text/html")
        assert "Back in a moment" in page.body.decode() and "Server Error" not in page.body.decode()
    assert all(int(a.headers["retry-after"]) >= 1 for a in (api, vote, *htmx, *pages))
    assert frame["type"] == "error" and frame["code"] == "service_unavailable" and frame["retry_after"] >= 1
    assert len(outage_warnings(captured)) == 1
    assert errors(captured) == []
