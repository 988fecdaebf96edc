"""Small server-rendered SVG charts for the admin: no JavaScript, no library.

Each chart is an inline `<svg role="img">` with a `<title>` and `<desc>` for screen readers, a
`<title>` on every bar and point (the hover tooltip), and colours by `tone-<name>` classes that
static/admin/css/analytics.css maps onto the admin's light and dark themes. All markup is built
with `format_html`, which escapes every label and value.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from .analytics import STATUSES, BreakdownRow, Bucket, Stats

Number = float | int | Decimal
Formatter = Callable[[float], str]


def _join(parts: Iterable[SafeString]) -> SafeString:
    # Every part comes from format_html or from here: escaped already.
    return mark_safe("".join(parts))


def _f(value: float) -> str:  # a coordinate: short and locale-free
    return f"{value:.1f}"


def nice_ceiling(value: float, *, whole: bool = False) -> tuple[float, float]:
    """The axis maximum and tick step: four or five 1-2-2.5-5 steps hugging `value` (whole steps
    for counts: no 2.5 requests)."""
    if value <= 0:
        return (4.0, 1.0) if whole else (1.0, 0.25)
    best: tuple[float, float] | None = None
    for ticks in (4, 5):
        raw = value / ticks
        magnitude = 10 ** math.floor(math.log10(raw))
        step = next(
            m * magnitude
            for m in (1, 2, 2.5, 5, 10)
            if m * magnitude >= raw and not (whole and (m * magnitude) % 1)
        )
        top = step * math.ceil(value / step - 1e-9)
        if best is None or top < best[0] - 1e-12:
            best = (top, step)
    assert best is not None
    return best


def bucket_label(start: dt.datetime, bucket: Bucket, *, long: bool = False) -> str:
    if bucket == "day":
        return f"{start:%a %b} {start.day}" if long else f"{start:%b} {start.day}"
    if long:
        return f"{start:%b} {start.day} {start:%H:%M}"
    return f"{start:%b} {start.day}" if start.hour == 0 else f"{start:%H:%M}"


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    values: Sequence[Number | None]
    tone: str


@dataclass(frozen=True, slots=True)
class _Frame:
    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int

    @property
    def plot_w(self) -> float:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> float:
        return self.height - self.top - self.bottom

    def y(self, value: float, top: float) -> float:
        return self.top + self.plot_h * (1 - value / top)


def _svg(frame: _Frame, *, title: str, desc: str, body: SafeString, css_class: str) -> SafeString:
    return format_html(
        '<svg class="pq-chart {css_class}" viewBox="0 0 {width} {height}" role="img"'
        ' aria-labelledby="pq-chart-{n}-t pq-chart-{n}-d"'
        ' xmlns="http://www.w3.org/2000/svg" preserveAspectRatio="xMidYMid meet">'
        '<title id="pq-chart-{n}-t">{title}</title><desc id="pq-chart-{n}-d">{desc}</desc>{body}</svg>',
        css_class=css_class,
        width=frame.width,
        height=frame.height,
        n=hashlib.blake2s(f"{title}{desc}".encode(), digest_size=4).hexdigest(),  # unique on a page
        title=title,
        desc=desc,
        body=body,
    )


def _legend(series: Sequence[Series], frame: _Frame) -> SafeString:
    parts, x = [], float(frame.left)
    for s in series:
        parts.append(
            format_html(
                '<g class="tone-{}"><rect x="{}" y="6" width="10" height="10" rx="2" fill="currentColor"/>'
                '<text class="pq-legend" x="{}" y="15">{}</text></g>',
                s.tone,
                _f(x),
                _f(x + 14),
                s.name,
            )
        )
        x += 24 + 6.5 * len(s.name)
    return _join(parts)


def _y_axis(frame: _Frame, top: float, step: float, fmt: Formatter) -> SafeString:
    parts = []
    for i in range(round(top / step) + 1):
        value = i * step
        y = frame.y(value, top)
        parts.append(
            format_html(
                '<line class="pq-grid" x1="{left}" x2="{right}" y1="{y}" y2="{y}"/>'
                '<text class="pq-tick" x="{tick_x}" y="{tick_y}" text-anchor="end">{label}</text>',
                left=frame.left,
                right=frame.width - frame.right,
                y=_f(y),
                tick_x=frame.left - 6,
                tick_y=_f(y + 3.5),
                label=fmt(value),
            )
        )
    return _join(parts)


def _x_axis(frame: _Frame, starts: Sequence[dt.datetime], bucket: Bucket, slot: float) -> SafeString:
    n = len(starts)
    every = max(1, math.ceil(n / 8))
    if bucket == "hour" and n > 8:
        # Round hours (00:00, 06:00, ...), whole days past 72 h (a month of hours: every 4 days).
        steps = (1, 2, 3, 4, 6, 12, 24, 48, 72, 96, 120, 168)
        every = next((h for h in steps if n / h <= 9), 24 * math.ceil(n / 24 / 9))
    bottom = frame.top + frame.plot_h
    parts = [
        format_html(
            '<line class="pq-axis" x1="{}" x2="{}" y1="{y}" y2="{y}"/>',
            frame.left,
            frame.width - frame.right,
            y=bottom,
        )
    ]
    for i, start in enumerate(starts):
        aligned = (start.hour % every == 0) if bucket == "hour" and every <= 24 else (i % every == 0)
        if not aligned:
            continue
        x = frame.left + slot * (i + 0.5)
        parts.append(
            format_html(
                '<line class="pq-axis" x1="{x}" x2="{x}" y1="{bottom}" y2="{tick_end}"/>'
                '<text class="pq-tick" x="{x}" y="{label_y}" text-anchor="middle">{label}</text>',
                x=_f(x),
                bottom=bottom,
                tick_end=bottom + 4,
                label_y=bottom + 17,
                label=bucket_label(start, bucket),
            )
        )
    return _join(parts)


def time_chart(
    *,
    title: str,
    desc: str,
    starts: Sequence[dt.datetime],
    bucket: Bucket,
    series: Sequence[Series],
    kind: Literal["bars", "lines"] = "bars",
    fmt: Formatter = lambda v: f"{v:,.0f}",
    whole: bool = False,
) -> SafeString:
    """Values over time buckets: stacked bars (counts) or lines with points (rates, latencies)."""
    top_pad = 28 if len(series) > 1 else 12
    frame = _Frame(width=480, height=220, left=56, right=10, top=top_pad, bottom=28)
    slot = frame.plot_w / max(len(starts), 1)
    floats = [[None if v is None else float(v) for v in s.values] for s in series]
    if kind == "bars":
        peak = max((sum(v or 0 for v in column) for column in zip(*floats, strict=True)), default=0.0)
    else:
        peak = max((v for values in floats for v in values if v is not None), default=0.0)
    top, step = nice_ceiling(peak, whole=whole)
    legend = _legend(series, frame) if len(series) > 1 else _join([])
    parts = [legend, _y_axis(frame, top, step, fmt), _x_axis(frame, starts, bucket, slot)]

    if kind == "bars":
        bar_w = max(min(slot * 0.72, 28), 1.0)
        for i, start in enumerate(starts):
            base = 0.0
            x = frame.left + slot * i + (slot - bar_w) / 2
            for s, values in zip(series, floats, strict=True):
                value = values[i] or 0.0
                if value <= 0:
                    continue
                y0, y1 = frame.y(base, top), frame.y(base + value, top)
                parts.append(
                    format_html(
                        '<rect class="tone-{}" x="{}" y="{}" width="{}" height="{}" fill="currentColor">'
                        "<title>{} · {}: {}</title></rect>",
                        s.tone,
                        _f(x),
                        _f(y1),
                        _f(bar_w),
                        _f(max(y0 - y1, 0.5)),
                        bucket_label(start, bucket, long=True),
                        s.name,
                        fmt(value),
                    )
                )
                base += value
    else:
        for s, values in zip(series, floats, strict=True):
            points = [
                (i, frame.left + slot * (i + 0.5), frame.y(v, top), v)
                for i, v in enumerate(values)
                if v is not None
            ]
            # A bucket without a value breaks the line rather than bridging the gap.
            path = " ".join(
                f"{'L' if i and values[i - 1] is not None else 'M'}{_f(x)},{_f(y)}" for i, x, y, _ in points
            )
            if path:
                parts.append(
                    format_html(
                        '<path class="tone-{} pq-line" d="{}" fill="none" stroke="currentColor"/>',
                        s.tone,
                        path,
                    )
                )
            radius = 2.5 if len(points) <= 60 else 1.5
            for i, x, y, v in points:
                parts.append(
                    format_html(
                        '<circle class="tone-{}" cx="{}" cy="{}" r="{}" fill="currentColor">'
                        "<title>{} · {}: {}</title></circle>",
                        s.tone,
                        _f(x),
                        _f(y),
                        radius,
                        bucket_label(starts[i], bucket, long=True),
                        s.name,
                        fmt(v),
                    )
                )
    return _svg(frame, title=title, desc=desc, body=_join(parts), css_class=f"pq-chart--{kind}")


def bar_list(
    *,
    title: str,
    desc: str,
    rows: Sequence[tuple[str, Number]],
    tone: str,
    fmt: Formatter = lambda v: f"{v:,.0f}",
) -> SafeString:
    """A horizontal bar per labelled value, largest first as given, the value at the bar's end."""
    label_w, row_height = 170, 26
    frame = _Frame(
        width=480, height=max(len(rows), 1) * row_height + 8, left=label_w, right=70, top=4, bottom=4
    )
    peak = max((float(v) for _, v in rows), default=0.0) or 1.0
    parts = []
    for i, (label, value) in enumerate(rows):
        y = frame.top + i * row_height
        w = max(frame.plot_w * float(value) / peak, 1.5)
        parts.append(
            format_html(
                '<text class="pq-label" x="{label_x}" y="{text_y}" text-anchor="end">{short}</text>'
                '<rect class="tone-{tone}" x="{label_w}" y="{bar_y}" width="{w}" height="{h}" rx="2"'
                ' fill="currentColor"><title>{label}: {value}</title></rect>'
                '<text class="pq-value" x="{value_x}" y="{text_y}">{value}</text>',
                label_x=label_w - 10,
                text_y=_f(y + row_height / 2 + 4),
                short=label if len(label) <= 26 else label[:25] + "…",
                tone=tone,
                label_w=label_w,
                bar_y=_f(y + 4),
                w=_f(w),
                h=row_height - 8,
                label=label,
                value=fmt(float(value)),
                value_x=_f(label_w + w + 6),
            )
        )
    return _svg(frame, title=title, desc=desc, body=_join(parts), css_class="pq-chart--barlist")


def _ms(value: float) -> str:
    return f"{value / 1000:.1f} s" if value >= 10_000 else f"{value:,.0f} ms"


def usd(value: Number) -> str:
    """`$0`, `$1.23`, and under a dollar three significant digits (`$0.50`, `$0.0004`): a quote
    costs hundredths of a cent."""
    value = float(value)
    if not value:
        return "$0"
    if abs(value) >= 1:
        return f"${value:,.2f}"
    whole, fraction = f"{value:.{max(2, 2 - math.floor(math.log10(abs(value))))}f}".split(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


def stats_charts(stats: Stats) -> dict[str, SafeString]:
    starts = [b.start for b in stats.buckets]
    per = "hour" if stats.bucket == "hour" else "day"
    span = (
        f"{bucket_label(starts[0], stats.bucket, long=True)} to {bucket_label(starts[-1], stats.bucket, long=True)}"
        if starts
        else "an empty range"
    )
    status_series = [
        Series(status, [b.by_status[status] for b in stats.buckets], f"status-{status}")
        for status in STATUSES
        if stats.by_status.get(status)
    ] or [Series("requests", [0 for _ in stats.buckets], "status-ok")]
    chart = functools.partial(time_chart, starts=starts, bucket=stats.bucket)
    charts = {
        "requests": chart(
            title=f"Requests per {per}, by status",
            desc=f"Stacked bars, {span}: {stats.requests:,} requests, "
            + ", ".join(f"{s.name} {sum(int(v or 0) for v in s.values):,}" for s in status_series)
            + ".",
            series=status_series,
            whole=True,
        ),
        "tokens": chart(
            title=f"Tokens per {per}",
            desc=f"Stacked bars, {span}: {stats.prompt_tokens:,} prompt and "
            f"{stats.completion_tokens:,} completion tokens.",
            series=[
                Series("prompt", [b.prompt_tokens for b in stats.buckets], "prompt"),
                Series("completion", [b.completion_tokens for b in stats.buckets], "completion"),
            ],
            fmt=_compact,
        ),
        "cost": chart(
            title=f"Estimated cost per {per} (USD)",
            desc=f"Bars, {span}: {usd(stats.cost_usd)} in all; the most in one {per} "
            f"{usd(max(b.cost_usd for b in stats.buckets)) if stats.buckets else 'none'}.",
            series=[Series("estimated cost", [b.cost_usd for b in stats.buckets], "cost")],
            fmt=usd,
        ),
        "ttft": chart(
            title=f"Time to first token per {per}",
            desc=f"Lines, {span}: p50 and p95 per {per}; over the whole range p50 "
            f"{_ms(stats.ttft_p50) if stats.ttft_p50 is not None else 'none'}, p95 "
            f"{_ms(stats.ttft_p95) if stats.ttft_p95 is not None else 'none'}.",
            series=[
                Series("p50", [b.ttft_p50 for b in stats.buckets], "p50"),
                Series("p95", [b.ttft_p95 for b in stats.buckets], "p95"),
            ],
            kind="lines",
            fmt=_ms,
        ),
    }
    if stats.refused:
        charts["refused"] = chart(
            title=f"Refused requests per {per} (429, 503)",
            desc=f"Bars, {span}: {stats.refused:,} refused; "
            + "; ".join(f"{code}: {count:,}" for code, count in stats.refused_by_code)
            + ".",
            series=[Series("refused", [b.refused for b in stats.buckets], "status-error")],
            whole=True,
        )
    if stats.errors_by_code:
        charts["errors"] = bar_list(
            title="Errors by code",
            desc="; ".join(f"{code}: {count:,}" for code, count in stats.errors_by_code) + ".",
            rows=stats.errors_by_code,
            tone="status-error",
        )
    if stats.by_model:
        charts["models"] = bar_list(
            title="Requests by model",
            desc="; ".join(f"{row.label}: {row.requests:,}" for row in stats.by_model) + ".",
            rows=[(row.label, row.requests) for row in stats.by_model],
            tone="bar",
        )
    return charts


def _compact(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:,.0f}"


def pct(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 100:.1f}%" if value < 0.995 or value == 1 else f"{value * 100:.2f}%"


def ms(value: float | None) -> str:
    return "-" if value is None else _ms(value)


def _ms_pair(low: float | None, high: float | None) -> str:
    if low is not None and high is not None and high < 10_000:
        return f"{low:,.0f} / {high:,.0f} ms"
    return f"{ms(low)} / {ms(high)}"


@dataclass(frozen=True, slots=True)
class Tile:
    label: str
    value: str
    note: str = ""
    tone: str = ""


def kpi_tiles(stats: Stats) -> list[Tile]:
    by_status = stats.by_status
    return [
        Tile(
            "Requests",
            f"{stats.requests:,}",
            f"{by_status.get('ok', 0):,} ok · {by_status.get('cancelled', 0):,} cancelled · {stats.refused:,} refused",
        ),
        Tile(
            "Tokens in / out",
            f"{_compact(stats.prompt_tokens)} / {_compact(stats.completion_tokens)}",
            f"{stats.prompt_tokens:,} prompt, {stats.completion_tokens:,} completion",
        ),
        Tile(
            "Estimated cost",
            usd(stats.cost_usd),
            f"{stats.unpriced:,} on unpriced models" if stats.unpriced else "at catalog prices",
        ),
        Tile(
            "Cache hit rate", pct(stats.hit_rate), f"{stats.cache_hits:,} of {stats.cache_lookups:,} lookups"
        ),
        Tile(
            "Error rate",
            pct(stats.error_rate),
            f"{stats.errors:,} failed requests",
            "bad" if (stats.error_rate or 0) >= 0.05 else "",
        ),
        Tile("TTFT p50 / p95", _ms_pair(stats.ttft_p50, stats.ttft_p95), "time to first token"),
    ]


@dataclass(frozen=True, slots=True)
class BreakdownDisplay:
    key: str
    label: str
    requests: str
    share: float
    hit_rate: str
    error_rate: str
    ttft_p50: str
    tokens: str
    cost: str
    thumbs_up: int
    thumbs_down: int
    refused: int


def breakdown_display(rows: Sequence[BreakdownRow], total: int) -> list[BreakdownDisplay]:
    return [
        BreakdownDisplay(
            key=row.key,
            label=row.label,
            requests=f"{row.requests:,}",
            share=round(100 * row.requests / total, 1) if total else 0.0,
            hit_rate=pct(row.hit_rate),
            error_rate=pct(row.error_rate),
            ttft_p50=ms(row.ttft_p50),
            tokens=f"{_compact(row.prompt_tokens)} / {_compact(row.completion_tokens)}",
            # No price at all is not the same as free.
            cost="n/a" if row.unpriced and not row.cost_usd else usd(row.cost_usd),
            thumbs_up=row.thumbs_up,
            thumbs_down=row.thumbs_down,
            refused=row.refused,
        )
        for row in rows
    ]
