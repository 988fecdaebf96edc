"""Retention of the request log: `manage.py prune_generations` on real rows (SQLite here, and
PostgreSQL under scripts/test-services), and the share that marks a quote to keep (opening its
permalink does not)."""

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

from quotes.models import Generation, Persona, Vote
from tests.deploy.test_deploy import PRODUCTION, _run

pytestmark = [pytest.mark.django_db, pytest.mark.integration, pytest.mark.services]

REQUEST = {"model": "@cf/meta/llama-3.1-8b-instruct", "messages": [{"role": "user", "content": "x" * 500}]}


def logged(persona: Persona, *, days_ago: float, **fields: Any) -> Generation:
    values: dict[str, Any] = {
        "persona": persona,
        "backend": "workers-ai",
        "model": "@cf/meta/llama-3.1-8b-instruct",
        "status": "ok",
        "cache_status": "miss",
        "topic": "rain",
        "text": "A quiet quote.",
        "request": REQUEST,
        "upstream_headers": {"cf-aig-log-id": "abc"},
        "client_hash": "f" * 32,
    }
    values.update(fields)
    row = Generation.objects.create(**values)
    Generation.objects.filter(pk=row.pk).update(created_at=timezone.now() - dt.timedelta(days=days_ago))
    row.refresh_from_db()
    return row


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("prune_generations", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def watts(db: None) -> Persona:
    return Persona.objects.get(slug="alan-watts")


@pytest.fixture
def old_and_new(watts: Persona, client: Client) -> dict[str, Generation]:
    """Rows past the 90-day default and rows within it; one old quote shared (its page's share
    button: the real endpoint), one whose permalink page was only opened, one rated."""
    rows = {
        "old_ok": logged(watts, days_ago=100),
        "old_error": logged(watts, days_ago=95, status="error", error_code="upstream_error", text=""),
        "old_cancelled": logged(watts, days_ago=120, status="cancelled"),
        "old_refused": logged(watts, days_ago=91, status="rate_limited", request={}, request_count=40),
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
    shared = client.post(f"/api/quotes/{rows['old_shared'].public_id}/share")
    assert shared.status_code == 200, shared.content
    for _ in range(3):  # a link preview's bot, a crawler, the visitor
        assert client.get(f"/q/{rows['old_only_opened'].public_id}/").status_code == 200
    for row in rows.values():
        row.refresh_from_db()
    assert rows["old_shared"].shared_at is not None and rows["old_only_opened"].shared_at is None
    return rows


def remaining() -> set[int]:
    return set(Generation.objects.values_list("pk", flat=True))


def test_opening_the_permalink_keeps_nothing_and_a_share_marks_the_quote_once(
    watts: Persona, client: Client
) -> None:
    """Issue 20, point 8: opening /q/<id>/ set shared_at, so every link preview's bot exempted a
    quote from retention. Only the share (a POST, the page's buttons) does now."""
    row = logged(watts, days_ago=3)

    assert client.get(f"/q/{row.public_id}/").status_code == 200
    assert client.head(f"/q/{row.public_id}/").status_code == 200
    row.refresh_from_db()
    assert row.shared_at is None

    assert client.post(f"/api/quotes/{row.public_id}/share").status_code == 200
    row.refresh_from_db()
    first = row.shared_at
    assert client.post(f"/api/quotes/{row.public_id}/share").status_code == 200
    row.refresh_from_db()

    assert first is not None and row.shared_at == first


def test_prune_deletes_old_rows_and_keeps_rated_and_shared_quotes(
    old_and_new: dict[str, Generation], settings: Any, client: Client
) -> None:
    settings.QUOTES_LOG_RETENTION_DAYS = 90
    settings.QUOTES_KEPT_QUOTE_RETENTION_DAYS = 0

    out = prune()

    kept = {name for name, row in old_and_new.items() if row.pk in remaining()}
    assert kept == {"old_rated", "old_shared", "old_votes_cancel_out", "ancient_rated", "new_ok", "new_error"}
    assert "Deleted 7 log rows and trimmed 4 kept quotes" in out
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

    assert "Deleted 0 log rows and trimmed 0 kept quotes" in prune()  # nothing left to do


def test_prune_drops_kept_quotes_after_their_own_retention(
    old_and_new: dict[str, Generation], settings: Any
) -> None:
    settings.QUOTES_LOG_RETENTION_DAYS = 90
    settings.QUOTES_KEPT_QUOTE_RETENTION_DAYS = 365

    prune()

    kept = {name for name, row in old_and_new.items() if row.pk in remaining()}
    assert kept == {"old_rated", "old_shared", "old_votes_cancel_out", "new_ok", "new_error"}


def test_prune_works_in_bounded_batches(watts: Persona, settings: Any) -> None:
    settings.QUOTES_LOG_RETENTION_DAYS = 30
    for _ in range(7):
        logged(watts, days_ago=31, status="error")
    young = logged(watts, days_ago=29)

    with CaptureQueriesContext(connection) as queries:
        out = prune("--batch-size", "3")

    deletes = [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith('DELETE FROM "quotes_generation"')
    ]
    assert len(deletes) == 3  # 3 + 3 + 1 rows, each batch in its own transaction
    assert remaining() == {young.pk}
    assert "Deleted 7 log rows" in out


def test_prune_dry_run_changes_nothing(old_and_new: dict[str, Generation], settings: Any) -> None:
    settings.QUOTES_LOG_RETENTION_DAYS = 90
    before = remaining()

    out = prune("--dry-run")

    assert "Would delete 7 log rows and trim 4 kept quotes" in out
    assert remaining() == before
    assert Generation.objects.get(pk=old_and_new["old_rated"].pk).request == REQUEST


def test_prune_with_retention_zero_keeps_everything(
    old_and_new: dict[str, Generation], settings: Any
) -> None:
    settings.QUOTES_LOG_RETENTION_DAYS = 0
    before = remaining()

    assert "every log row is kept" in prune()
    assert remaining() == before


def test_prune_rejects_a_bad_batch_size(db: None) -> None:
    with pytest.raises(CommandError, match="batch-size"):
        prune("--batch-size", "0")


@pytest.mark.parametrize(
    ("log_days", "kept_days"),
    [("90", "30"), ("0", "365"), ("-1", "0"), ("ninety", "0")],
)
def test_retention_settings_refuse_to_start_when_inconsistent(log_days: str, kept_days: str) -> None:
    result = _run(
        "import django; django.setup()",
        **PRODUCTION,
        QUOTES_LOG_RETENTION_DAYS=log_days,
        QUOTES_KEPT_QUOTE_RETENTION_DAYS=kept_days,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "RETENTION_DAYS" in result.stderr.splitlines()[-1]
