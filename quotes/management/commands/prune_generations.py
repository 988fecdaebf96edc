"""`python manage.py prune_generations [--dry-run] [--batch-size N]`, daily: mark lost the rows a dead
process left `running` (quotes.services.generations_mark_lost); delete request-log rows and
refusal counts past QUOTES_LOG_RETENTION_DAYS (0: keep all). Quotes voted on or shared
(a POST; a bot opening the permalink keeps nothing) stay for QUOTES_KEPT_QUOTE_RETENTION_DAYS (0:
for good) with only what their permalink page and the analytics use. Short batches: live log
writes (SQLite's one writer) never wait long.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from quotes.models import Generation, Refusal, Vote
from quotes.services import generations_mark_lost, lost_before

#: Rows per transaction. Below SQLite's oldest limit of 999 parameters in one statement.
DEFAULT_BATCH = 500


def kept_quotes() -> Q:
    """Quotes someone cared about: voted on (even if the votes cancel out), or shared."""
    voted = Exists(Vote.objects.filter(generation=OuterRef("pk")))
    return Q(status=Generation.Status.OK, is_preview=False) & (
        Q(voted) | Q(feedback__isnull=False) | Q(shared_at__isnull=False)
    )


def _in_batches(rows: QuerySet[Generation], batch: int, apply: Any) -> int:
    """`apply` to the rows `rows` selects, `batch` per transaction."""
    done, last = 0, 0
    while True:
        # Onward from the last batch: ends even if a row still matches after `apply`.
        ids = list(rows.filter(pk__gt=last).order_by("pk").values_list("pk", flat=True)[:batch])
        if not ids:
            return done
        with transaction.atomic():
            apply(Generation.objects.filter(pk__in=ids))
        done, last = done + len(ids), ids[-1]


class Command(BaseCommand):
    help = "Delete request-log rows past QUOTES_LOG_RETENTION_DAYS; keep rated and shared quotes longer."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="count what would go; change nothing")
        parser.add_argument(
            "--batch-size",
            type=int,
            default=DEFAULT_BATCH,
            help=f"rows per transaction (default {DEFAULT_BATCH})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch = options["batch_size"]
        if not 1 <= batch <= 10_000:
            raise CommandError("--batch-size must be between 1 and 10000.")
        log_days: int = settings.QUOTES_LOG_RETENTION_DAYS
        kept_days: int = settings.QUOTES_KEPT_QUOTE_RETENTION_DAYS
        if log_days < 0 or kept_days < 0:
            # A negative retention would put the cut-off in the future: every row would go.
            raise CommandError("The retention settings (QUOTES_*_RETENTION_DAYS) must be 0 or more.")
        if options["dry_run"]:
            lost = Generation.objects.filter(
                status=Generation.Status.RUNNING, created_at__lt=lost_before()
            ).count()
            self.stdout.write(f"Would mark {lost:,} rows lost (left running by a process that died).")
        else:
            self.stdout.write(
                f"Marked {generations_mark_lost():,} rows lost (left running by a process that died)."
            )
        if not log_days:
            self.stdout.write("QUOTES_LOG_RETENTION_DAYS is 0: every log row is kept.")
            return
        now = timezone.now()
        log_cutoff = now - dt.timedelta(days=log_days)
        expired = Q(created_at__lt=log_cutoff) & ~kept_quotes()
        if kept_days:
            expired |= Q(created_at__lt=now - dt.timedelta(days=kept_days)) & kept_quotes()
        to_delete = Generation.objects.filter(expired)
        # Kept quotes past the log retention that still hold more than their permalink needs.
        to_trim = Generation.objects.filter(kept_quotes(), created_at__lt=log_cutoff).exclude(
            request={}, upstream_headers={}, topic="", client_hash=""
        )
        if kept_days:
            to_trim = to_trim.filter(created_at__gte=now - dt.timedelta(days=kept_days))
        refusals = Refusal.objects.filter(hour__lt=log_cutoff)

        if options["dry_run"]:
            self.stdout.write(
                f"Would delete {to_delete.count():,} log rows and {refusals.count():,} refusal counts, "
                f"and trim {to_trim.count():,} kept quotes ({_policy(log_days, kept_days)})."
            )
            return
        deleted = _in_batches(to_delete, batch, lambda rows: rows.delete())
        trimmed = _in_batches(
            to_trim,
            batch,
            lambda rows: rows.update(request={}, upstream_headers={}, topic="", client_hash=""),
        )
        refused, _ = refusals.delete()
        self.stdout.write(
            f"Deleted {deleted:,} log rows and {refused:,} refusal counts, "
            f"and trimmed {trimmed:,} kept quotes ({_policy(log_days, kept_days)})."
        )


def _policy(log_days: int, kept_days: int) -> str:
    kept = f"{kept_days} days" if kept_days else "for good"
    return f"log retention {log_days} days, rated and shared quotes {kept}"
