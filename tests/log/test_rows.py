"""The request log's writer (quotes/rows.py) through the real ASGI app (issue 39): an upstream's
counts no column holds are clamped to the columns, a row the database refuses is set aside (said
once, counted lost, /healthz `failing`) and the writer goes on with the next, and the queue of
rows waiting for a database that is down counts generations, not writes. Run on SQLite and again
on PostgreSQL (`services`), whose refusals differ: SQLite's OverflowError, PostgreSQL's DataError."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from prometheus_client import REGISTRY

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes import personas, rows
from quotes.models import Generation, Persona
from tests.asgi import post_quote, request
from tests.faults.test_database_outage import captured, database_down, errors  # noqa: F401  (fixture)
from tests.fixtures import saved

pytestmark = [pytest.mark.integration, pytest.mark.services, pytest.mark.django_db(transaction=True)]

HUGE = 2**63


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona, workers_ai_settings: Any) -> FakeWorkersAI:
    workers_ai_settings.QUOTES_CACHE_TTL = 0
    await saved(persona, model="@cf/meta/llama-3.1-8b-instruct-fp8")
    return fake


def lost_so_far() -> float:
    return REGISTRY.get_sample_value("quotes_log_rows_lost_total") or 0.0


async def row_of(topic: str) -> Generation:
    for _ in range(100):
        if rows.writer().waiting:  # (SQLite's shared in-memory test database locks a table being written)
            await asyncio.sleep(0.05)
            continue
        found = [row async for row in Generation.objects.filter(topic=topic).exclude(status="running")]
        if found:
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no finished row for {topic!r}")


async def health_of_the_log() -> dict[str, Any]:
    response = await request("GET", "/healthz")
    check: dict[str, Any] = response.json()["checks"]["log"]
    return check


async def test_counts_and_costs_no_column_holds_are_clamped_and_the_log_goes_on(
    fake: FakeWorkersAI, persona: Persona
) -> None:
    """A usage of 2**63 tokens killed the writer (SQLite's OverflowError; on PostgreSQL a count over
    2**31-1 is a DataError): no later row was written. The cost is the clamped counts' (the cost
    column's own bound, $9,999.99999999, is beyond any catalog model's price for them)."""
    fake.script(Scenario(usage=(HUGE, HUGE)))
    assert (await post_quote({"persona": persona.slug, "topic": "huge"})).status == 200
    assert (await post_quote({"persona": persona.slug, "topic": "after"})).status == 200
    huge, after = await row_of("huge"), await row_of("after")
    assert (huge.status, huge.prompt_tokens, huge.completion_tokens) == ("ok", 2**31 - 1, 2**31 - 1)
    # llama-3.1-8b-instruct-fp8: $0.152 and $0.287 per million tokens in and out.
    assert huge.cost_usd == Decimal(str(round((2**31 - 1) * (0.152 + 0.287) / 1e6, 8)))
    assert (after.status, after.prompt_tokens) == ("ok", 12)
    assert (await health_of_the_log())["status"] == "ok"


@pytest.fixture
def refusing_database() -> Iterator[None]:
    """The database refuses any row about the topic "refused", as it refuses a value no column
    holds: PostgreSQL with a DataError (SQLSTATE 22023), SQLite with a constraint error."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION refuse_row() RETURNS trigger AS $$ BEGIN "
                "IF NEW.topic = 'refused' THEN RAISE EXCEPTION 'value out of range' USING ERRCODE = '22023'; "
                "END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                "CREATE TRIGGER refuse_row BEFORE INSERT OR UPDATE ON quotes_generation "
                "FOR EACH ROW EXECUTE FUNCTION refuse_row()"
            )
        else:
            for event in ("INSERT", "UPDATE"):
                cursor.execute(
                    f"CREATE TRIGGER refuse_row_{event.lower()} BEFORE {event} ON quotes_generation "
                    "WHEN NEW.topic = 'refused' BEGIN SELECT RAISE(ABORT, 'value out of range'); END"
                )
    yield
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("DROP TRIGGER refuse_row ON quotes_generation")
            cursor.execute("DROP FUNCTION refuse_row()")
        else:
            for event in ("insert", "update"):
                cursor.execute(f"DROP TRIGGER refuse_row_{event}")


async def test_a_row_the_database_refuses_is_said_once_set_aside_and_the_next_is_written(
    fake: FakeWorkersAI,
    persona: Persona,
    refusing_database: None,
    captured: list[logging.LogRecord],  # noqa: F811
    settings: Any,
) -> None:
    settings.DEBUG = True  # /healthz's details
    before = lost_so_far()
    assert (await post_quote({"persona": persona.slug, "topic": "refused"})).status == 200
    assert (await post_quote({"persona": persona.slug, "topic": "fine"})).status == 200
    assert (await row_of("fine")).status == "ok"
    assert not [row async for row in Generation.objects.filter(topic="refused")]
    said = [r for r in captured if r.name == "quotes.rows" and "log row not written" in r.getMessage()]
    assert len(said) == 1 and '"topic": "refused"' in said[0].getMessage()
    assert "value out of range" in said[0].getMessage()
    assert lost_so_far() - before == 1
    log = await health_of_the_log()
    assert log["status"] == "failing" and "value out of range" in log["detail"]
    assert [r for r in errors(captured) if r not in said] == []  # no traceback: one line, the row's


async def test_the_queue_counts_generations_and_a_row_is_lost_only_when_nothing_of_it_is_written(
    fake: FakeWorkersAI,
    persona: Persona,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured: list[logging.LogRecord],  # noqa: F811
) -> None:
    """Three generations fit while the database is down (each an insert and an end, one entry);
    the fourth has no room: its row is logged and counted lost, once."""
    monkeypatch.setattr(rows, "MAX_WAITING", 3)
    await personas.get_active(persona.slug)  # in memory; no row yet, so the writer connects after the cut
    before = lost_so_far()
    async with database_down(tmp_path) as cut:
        await cut()
        for n in range(4):
            assert (await post_quote({"persona": persona.slug, "topic": f"down {n}"})).status == 200
        assert len(rows.writer().waiting) == 3
    assert {(await row_of(f"down {n}")).status for n in range(3)} == {"ok"}
    assert not [row async for row in Generation.objects.filter(topic="down 3")]
    said = [r.getMessage() for r in captured if r.name == "quotes.rows"]
    assert len(said) == 1 and '"topic": "down 3"' in said[0] and "too many rows waiting" in said[0]
    assert lost_so_far() - before == 1
