"""Retention of the request log: `manage.py prune_generations` on real rows, and the share that
marks a quote to keep (opening its permalink does not)."""

from __future__ import annotations

import datetime as dt
import io
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from quotes.models import Generation, Persona, Refusal, Vote

pytestmark = [pytest.mark.django_db, pytest.mark.integration, pytest.mark.services]

REQUEST = {
    "model": "@cf/meta/llama-3.1-8b-instruct-fp8",
    "messages": [{"role": "user", "content": "x" * 500}],
}


def logged(persona: Persona, *, days_ago: float, **fields: Any) -> Generation:
    values: dict[str, Any] = {"persona": persona, "backend": "workers-ai", "model": REQUEST["model"]}
    values |= {"status": "ok", "cache_status": "miss", "topic": "rain", "text": "A quiet quote."}
    values |= {"request": REQUEST, "upstream_headers": {"cf-aig-log-id": "abc"}, "client_hash": "f" * 32}
    row = Generation.objects.create(**values)
    created_at = timezone.now() - dt.timedelta(days=days_ago)
    Generation.objects.filter(pk=row.pk).update(created_at=created_at, **fields)
    row.refresh_from_db()
    return row


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("prune_generations", *args, stdout=out)
    return out.getvalue()


def remaining() -> set[int]:
    return set(Generation.objects.values_list("pk", flat=True))


@pytest.fixture
def watts(db: None) -> Persona:
    return Persona.objects.get(slug="alan-watts")


@pytest.fixture
def old_and_new(watts: Persona, client: Client, settings: Any) -> dict[str, Generation]:
    """Rows past the 90-day retention and rows within it; one old quote shared (its page's share
    button, the real endpoint), one whose permalink page was only opened, some rated."""
    settings.QUOTES_LOG_RETENTION_DAYS, settings.QUOTES_KEPT_QUOTE_RETENTION_DAYS = 90, 0
    rows = {
        "old_ok": logged(watts, days_ago=100),
        "old_error": logged(watts, days_ago=95, status="error", error_code="upstream_error", text=""),
        "old_cancelled": logged(watts, days_ago=120, status="cancelled"),
        "old_lost": logged(watts, days_ago=91, status="running"),
        "old_preview": logged(watts, days_ago=100, is_preview=True, feedback=1),
        "old_rated_error": logged(watts, days_ago=100, status="error", feedback=-1),
        "old_rated": logged(watts, days_ago=100, feedback=1),
        "old_shared": logged(watts, days_ago=200),
        "old_only_opened": logged(watts, days_ago=200),
        "old_votes_cancel_out": logged(watts, days_ago=150),
        "ancient_rated": logged(watts, days_ago=800, feedback=-1),
        "new_ok": logged(watts, days_ago=89),
        "new_error": logged(watts, days_ago=1, status="error"),
    }
    for client_key, value in (("ip:a", 1), ("ip:b", -1)):  # voted on, the verdict empty
        Vote.objects.create(generation=rows["old_votes_cancel_out"], client_key=client_key, value=value)
    assert client.post(f"/api/quotes/{rows['old_shared'].public_id}/share").status_code == 200
    for _ in range(3):  # a link preview's bot, a crawler, the visitor
        assert client.get(f"/q/{rows['old_only_opened'].public_id}/").status_code == 200
    for row in rows.values():
        row.refresh_from_db()
    assert rows["old_shared"].shared_at is not None and rows["old_only_opened"].shared_at is None
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for days in (91, 1):
        Refusal.objects.create(persona=watts, hour=hour - dt.timedelta(days=days), code="busy", count=3)
    return rows


def test_opening_the_permalink_keeps_nothing_and_a_share_marks_it_once(watts: Any, client: Client) -> None:
    row = logged(watts, days_ago=3)
    page = f"/q/{row.public_id}/"
    assert client.get(page).status_code == client.head(page).status_code == 200
    row.refresh_from_db()
    assert row.shared_at is None
    assert client.post(f"/api/quotes/{row.public_id}/share").status_code == 200
    row.refresh_from_db()
    first = row.shared_at
    assert client.post(f"/api/quotes/{row.public_id}/share").status_code == 200
    row.refresh_from_db()
    assert first is not None and row.shared_at == first


def test_prune_deletes_old_rows_and_keeps_rated_and_shared_quotes(old_and_new: Any, client: Client) -> None:
    out = prune()

    kept = {name for name, row in old_and_new.items() if row.pk in remaining()}
    assert kept == {"old_rated", "old_shared", "old_votes_cancel_out", "ancient_rated", "new_ok", "new_error"}
    assert "Deleted 7 log rows and 1 refusal counts, and trimmed 4 kept quotes" in out
    assert Refusal.objects.count() == 1
    # What the permalink and the analytics need stays; the visitor's words and the request go.
    for name in ("old_rated", "old_shared", "old_votes_cancel_out", "ancient_rated"):
        row = Generation.objects.get(pk=old_and_new[name].pk)
        assert (row.request, row.upstream_headers, row.topic, row.client_hash) == ({}, {}, "", "")
        assert row.text == "A quiet quote." and row.feedback == old_and_new[name].feedback
    new = Generation.objects.get(pk=old_and_new["new_ok"].pk)
    assert (new.request, new.topic) == (REQUEST, "rain")
    assert client.get(f"/q/{old_and_new['old_shared'].public_id}/").status_code == 200
    assert client.get(f"/q/{old_and_new['old_ok'].public_id}/").status_code == 404
    assert client.get(f"/q/{old_and_new['old_only_opened'].public_id}/").status_code == 404
    assert "Deleted 0 log rows and 0 refusal counts, and trimmed 0 kept quotes" in prune()  # nothing left


def test_prune_dry_run_and_retention_zero_change_nothing(old_and_new: Any, settings: Any) -> None:
    before = remaining()

    assert "Would delete 7 log rows and 1 refusal counts, and trim 4 kept quotes" in prune("--dry-run")
    settings.QUOTES_LOG_RETENTION_DAYS = 0
    assert "every log row is kept" in prune()

    assert remaining() == before and Refusal.objects.count() == 2
    assert Generation.objects.get(pk=old_and_new["old_rated"].pk).request == REQUEST


def test_prune_works_in_bounded_batches(watts: Persona, settings: Any) -> None:
    settings.QUOTES_LOG_RETENTION_DAYS = 30
    for _ in range(7):
        logged(watts, days_ago=31, status="error")
    young = logged(watts, days_ago=29)

    with CaptureQueriesContext(connection) as queries:
        out = prune("--batch-size", "3")

    deletes = [q for q in queries.captured_queries if q["sql"].startswith('DELETE FROM "quotes_generation"')]
    assert len(deletes) == 3  # 3 + 3 + 1 rows, each batch in its own transaction
    assert remaining() == {young.pk} and "Deleted 7 log rows" in out


@pytest.mark.parametrize(
    ("args", "log_days", "message"),
    [(("--batch-size", "0"), 90, "batch-size"), ((), -1, "must be 0 or more")],
)
def test_prune_refuses_a_bad_batch_size_or_a_negative_retention(
    old_and_new: Any, settings: Any, args: tuple[str, ...], log_days: int, message: str
) -> None:
    """A negative retention would put the cut-off in the future and delete every row."""
    settings.QUOTES_LOG_RETENTION_DAYS = log_days
    before = remaining()

    with pytest.raises(CommandError, match=message):
        prune(*args)

    assert remaining() == before
