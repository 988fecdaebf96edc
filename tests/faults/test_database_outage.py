"""The database down (issue 21, point 2), through the real ASGI app (config.asgi) with the
database made unreachable for every new connection: personas this process has loaded keep
streaming from memory, anything else is a 503 `service_unavailable` with Retry-After in its
request's dialect (JSON, the htmx error event, a WebSocket error frame, a readable page), and the
outage is one WARNING, not a traceback per request."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connection, connections
from django.test import override_settings

from harness.services import free_port
from harness.workers_ai import FakeWorkersAI
from quotes import database, personas
from quotes.ai.backends import reset_backends
from quotes.ai.gateway.rows import writer
from quotes.logging import ClientErrorFilter, RequestIdFilter
from quotes.models import Persona
from quotes.services import persona_save
from tests.asgi import htmx_form_post, parse_sse, post_quote, request
from tests.redis_server import REDIS_CACHE_BACKEND

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.services]

UNSEEN = "never-loaded"  # a persona slug this process has never loaded
#: a session cookie with a well-formed key: reading it (the visitor's user) is a query
SESSION = "sessionid=" + "s" * 32


class Capture(logging.Handler):
    """Every record as the console handler of config/settings.py passes it on (its filters: a
    503 that says when to come back is an INFO there, not an ERROR)."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.addFilter(ClientErrorFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def outage_warnings(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name == "quotes.database" and r.levelno >= logging.WARNING]

    def errors_of_requests(self) -> list[logging.LogRecord]:
        """What the requests themselves logged at ERROR, or with a traceback (the log writer's own
        lines about the rows it cannot write are another part of issue 21)."""
        return [
            r
            for r in self.records
            if r.name in ("django.request", "quotes.request", "quotes.personas", "quotes.database")
            and (r.levelno >= logging.ERROR or r.exc_info is not None)
        ]


@pytest.fixture
def captured() -> Iterator[Capture]:
    import config.asgi  # noqa: F401  (its first import configures logging, which replaces root handlers)

    handler = Capture()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)


class DatabaseDown:
    """The default database, unreachable for every connection opened after `cut()`: for SQLite a
    file in a directory that is gone, for a server a port nothing listens on. Connections open
    now are closed in asgiref's thread (the test's own ORM calls); each request and each persona
    load opens its own, CONN_MAX_AGE being 0."""

    def __init__(self, tmp_path: Path) -> None:
        self.settings = connections["default"].settings_dict  # shared by every thread's connection
        self.saved = {key: self.settings.get(key) for key in ("NAME", "HOST", "PORT")}
        self.tmp_path = tmp_path
        self.down = False

    async def cut(self) -> None:
        if self.settings["ENGINE"] == "django.db.backends.sqlite3":
            gone = self.tmp_path / "gone"
            gone.mkdir()
            self.settings["NAME"] = str(gone / "db.sqlite3")
            shutil.rmtree(gone)
        else:
            self.settings.update(HOST="127.0.0.1", PORT=str(free_port()))
        self.down = True
        await _close_connections()

    async def restore(self) -> None:
        if self.down:
            self.settings.update(self.saved)
            self.down = False
            await _close_connections()


async def _close_connections() -> None:
    await sync_to_async(connections.close_all)()  # asgiref's thread: the test's own ORM calls


@pytest.fixture
async def database_down(persona: Persona, tmp_path: Path) -> AsyncIterator[DatabaseDown]:
    """After the `persona` fixture (saved while the database is up), and restored before the
    test database is flushed."""
    down = DatabaseDown(tmp_path)
    yield down
    await down.restore()
    database.outage.recovered()  # the next test starts with no outage in this process
    # The rows the outage sent to the outbox go in now, into this test's database: left there,
    # the next test's rows would queue behind them (not in its database when it reads them).
    assert await asyncio.to_thread(writer.flush, 30.0, outbox=True)


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    workers_ai_settings.QUOTES_GATEWAY = replace(workers_ai_settings.QUOTES_GATEWAY, cache_ttl=0)
    yield fake_workers_ai
    await reset_backends()


def is_quote(body: bytes) -> bool:
    return b'data: {"response":"Stay"' in body and body.endswith(b"data: [DONE]\n\n")


def retry_after(headers: dict[str, str]) -> int:
    value = int(headers["retry-after"])
    assert value >= 1
    return value


# -- a persona loaded before the outage -----------------------------------------------------------


async def test_outage_a_persona_loaded_before_still_streams_and_the_database_is_asked_after_a_backoff(
    persona: Persona,
    fake: FakeWorkersAI,
    database_down: DatabaseDown,
    captured: Capture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert is_quote((await post_quote({"persona": persona.slug, "topic": "before"})).body)
    # As if MAX_AGE_S had passed before every request: each one would read the database again.
    monkeypatch.setattr(personas, "MAX_AGE_S", 0.0)
    monkeypatch.setattr(database, "RETRY_S", 3600.0)

    await database_down.cut()
    during = [await post_quote({"persona": persona.slug, "topic": f"during {n}"}) for n in range(3)]

    assert [r.status for r in during] == [200, 200, 200]
    assert all(is_quote(r.body) for r in during)
    assert len(captured.outage_warnings()) == 1  # one per outage, not one per request
    assert captured.errors_of_requests() == []

    # The database is back, with a change made behind the ORM's back; within the backoff the
    # process does not ask it yet (the quote still has the prompt it had)...
    await database_down.restore()
    await sync_to_async(_set_prompt)(persona.pk, "You are Alan Watts, after the outage")
    assert is_quote((await post_quote({"persona": persona.slug, "topic": "in the backoff"})).body)
    # ...and once the backoff is over, it does, and hears the change.
    monkeypatch.setattr(database, "RETRY_S", 0.0)
    assert is_quote((await post_quote({"persona": persona.slug, "topic": "after"})).body)

    prompts = [r.json["messages"][0]["content"] for r in fake.requests]
    assert prompts == ["You are Alan Watts"] * 5 + ["You are Alan Watts, after the outage"]
    back = [r for r in captured.records if r.name == "quotes.database" and r.levelno == logging.INFO]
    assert len(back) == 1 and "answers again" in back[0].getMessage()


def _set_prompt(pk: int, prompt: str) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE quotes_persona SET system_prompt = %s WHERE id = %s", [prompt, pk])
    finally:
        connection.close()


async def test_outage_a_loaded_persona_keeps_its_page(persona: Persona, database_down: DatabaseDown) -> None:
    assert (await request("GET", f"/personas/{persona.slug}/")).status == 200
    await database_down.cut()

    page = await request("GET", f"/personas/{persona.slug}/")

    assert page.status == 200
    assert persona.name in page.body.decode()


async def test_outage_with_redis_down_too_a_loaded_persona_keeps_its_page(
    persona: Persona, database_down: DatabaseDown, closed_port: int
) -> None:
    """With the shared cache down, the persona version value cannot be read, so the process's
    fresh entries are dropped on every request: the persona as last loaded is still there."""
    assert (await request("GET", f"/personas/{persona.slug}/")).status == 200
    await database_down.cut()
    dead_redis = {
        "default": {"BACKEND": REDIS_CACHE_BACKEND, "LOCATION": f"redis://127.0.0.1:{closed_port}/0"}
    }

    with override_settings(CACHES=dead_redis):
        page = await request("GET", f"/personas/{persona.slug}/")

    assert page.status == 200
    assert persona.name in page.body.decode()


async def test_outage_a_persona_this_process_deactivated_is_not_served_from_memory(
    persona: Persona, database_down: DatabaseDown
) -> None:
    assert (await request("GET", f"/personas/{persona.slug}/")).status == 200
    persona.is_active = False
    await sync_to_async(persona_save)(persona=persona)
    await database_down.cut()

    page = await request("GET", f"/personas/{persona.slug}/")

    assert page.status == 503


# -- nothing in memory: a 503 in the request's dialect --------------------------------------------


async def test_outage_an_unseen_persona_is_a_json_503_with_retry_after(
    persona: Persona, database_down: DatabaseDown, captured: Capture
) -> None:
    await database_down.cut()

    answers = [await post_quote({"persona": UNSEEN}) for _ in range(3)]

    for answer in answers:
        assert answer.status == 503
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "service_unavailable"
        assert answer.json()["error"]["message"]
        retry_after(answer.headers)
    assert len(captured.outage_warnings()) == 1
    assert captured.errors_of_requests() == []


async def test_outage_htmx_gets_its_error_event(persona: Persona, database_down: DatabaseDown) -> None:
    await database_down.cut()

    form = await htmx_form_post({"persona": UNSEEN})
    api = await post_quote({"persona": UNSEEN}, headers={"hx-request": "true"})

    for answer in (form, api):
        assert answer.status == 503
        assert answer.headers["content-type"].startswith("text/event-stream")
        retry_after(answer.headers)
        [event] = parse_sse(answer.body)
        assert event["event"] == "error"
        assert (
            '"code": "service_unavailable"' in event["data"]
            or '"code":"service_unavailable"' in event["data"]
        )


async def test_outage_websocket_gets_an_error_frame(persona: Persona, database_down: DatabaseDown) -> None:
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    connected, _ = await socket_.connect()
    assert connected
    await database_down.cut()
    try:
        await socket_.send_json_to({"type": "start", "persona": UNSEEN})
        frame = await socket_.receive_json_from(timeout=10)
    finally:
        await socket_.disconnect(timeout=10)

    assert frame["type"] == "error"
    assert frame["code"] == "service_unavailable"
    assert isinstance(frame["retry_after"], int) and frame["retry_after"] >= 1


async def test_outage_pages_are_a_readable_503(
    persona: Persona, database_down: DatabaseDown, captured: Capture
) -> None:
    await database_down.cut()

    persona_page = await request("GET", f"/personas/{UNSEEN}/")
    index = await request("GET", "/")  # lists the personas from the database itself

    for page in (persona_page, index):
        html = page.body.decode()
        assert page.status == 503
        assert page.headers["content-type"].startswith("text/html")
        retry_after(page.headers)
        assert "Back in a moment" in html and "Server Error" not in html
    assert len(captured.outage_warnings()) == 1
    assert captured.errors_of_requests() == []


async def test_outage_escaping_an_api_view_is_a_json_503(
    persona: Persona, database_down: DatabaseDown, captured: Capture
) -> None:
    """The database error is raised in the view itself, not by the persona cache: the vote's
    look-up of its quote, and the session a signed-in visitor's stream reads for its user."""
    await database_down.cut()

    vote = await request(
        "POST", "/api/quotes/00000000-0000-4000-8000-000000000000/feedback", json_body={"value": 1}
    )
    signed_in = await post_quote({"persona": persona.slug}, headers={"cookie": SESSION})
    signed_in_htmx = await post_quote(
        {"persona": persona.slug}, headers={"cookie": SESSION, "hx-request": "true"}
    )

    for answer in (vote, signed_in):
        assert answer.status == 503
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "service_unavailable"
        retry_after(answer.headers)
    assert signed_in_htmx.status == 503
    assert [event["event"] for event in parse_sse(signed_in_htmx.body)] == ["error"]
    assert len(captured.outage_warnings()) == 1
    assert captured.errors_of_requests() == []
