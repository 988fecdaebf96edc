"""`python manage.py gateway_stats [--since 24h|7d|30d] [--include-previews] [--json]`: the gateway's
key figures and breakdowns for the terminal, the same numbers as the admin's analytics page."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from quotes.admin.analytics import Stats, gateway_stats, parse_since
from quotes.admin.charts import BreakdownDisplay, breakdown_display, kpi_tiles


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain columns: the first left-aligned, numbers right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(cell).ljust(w) if i == 0 else str(cell).rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]


def thumbs(row: BreakdownDisplay) -> list[str]:
    return [str(row.thumbs_up), str(row.thumbs_down)]


def _section(title: str, headers: list[str], cells: list[list[str]]) -> list[str]:
    return ["", title, *(["  " + row for row in _table(headers, cells)] if cells else ["  none"])]


def stats_report(stats: Stats) -> str:
    since, until = (timezone.localtime(t).strftime("%Y-%m-%d %H:%M %Z") for t in (stats.since, stats.until))
    previews = "included" if stats.include_previews else "left out"
    lines = [f"Gateway stats {since} to {until} (admin previews {previews})", ""]
    tiles = kpi_tiles(stats)
    width = max(len(t.label) for t in tiles)
    for tile in tiles:
        lines.append(f"  {tile.label.ljust(width)}  {tile.value}" + (f"  ({tile.note})" if tile.note else ""))
    for title, counts in (
        ("Errors by code", stats.errors_by_code),
        ("Refused (429, 503) by code", stats.refused_by_code),
    ):
        lines += _section(title, ["code", "requests"], [[code, f"{n:,}"] for code, n in counts])
    headers = ["", "requests", "hit rate", "errors", "ttft p50", "tokens in/out", "cost", "up", "down"]
    for title, rows in (("By persona", stats.by_persona), ("By model", stats.by_model)):
        cells = [
            [r.key, r.requests, r.hit_rate, r.error_rate, r.ttft_p50, r.tokens, r.cost, *thumbs(r)]
            for r in breakdown_display(rows, stats.requests)
        ]
        lines += _section(title, headers, cells)
    return "\n".join(lines)


class Command(BaseCommand):
    help = "Print the gateway's requests, tokens, cost, cache hit rate, errors and TTFT for a recent span."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since", default="24h", help="how far back: 24h, 7d, 30d, or any <n>m/<n>h/<n>d"
        )
        parser.add_argument("--include-previews", action="store_true", help="count the admin's previews too")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        try:
            since = parse_since(options["since"], now=now)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        stats = gateway_stats(since=since, until=now, include_previews=options["include_previews"])
        if options["json"]:
            self.stdout.write(json.dumps(stats.as_dict(), indent=2, ensure_ascii=False))
        else:
            self.stdout.write(stats_report(stats))
