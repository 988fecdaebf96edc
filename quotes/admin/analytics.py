"""The read queries: a persona's version history, and what the request log says about a time
range (the admin's analytics, the CSV, `manage.py gateway_stats`). The database counts all but
percentiles (SQLite has none): the range's times to first token are ranked in Python.

- *Requests*: rows in `[since, until)`, previews left out unless asked for. A `running` row older
  than the total deadline belongs to a process that died: it counts as *lost*, and as an error.
- *Refused*: answered 429 or 503 before any generation, counted in `Refusal`, never as rows.
- *Cache hit rate*: hits / (hits + misses); a bypass is no lookup.
- *Errors*: status `error`, and lost rows (a cancel is the visitor leaving), by `error_code`.
- *Cost*: from the catalog's prices; rows on models with no published price count as `unpriced`.
- *Percentiles* interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, Literal

from django.db.models import Case, CharField, Count, F, Q, QuerySet, Sum, Value, When
from django.db.models.functions import TruncDay, TruncHour
from django.utils import timezone

from ..backends.base import GENERATION_FIELDS
from ..backends.catalog import get_model
from ..errors import ErrorCode
from ..models import Experiment, Generation, Persona, PersonaVersion, Refusal, Vote
from ..services import lost_before

Bucket = Literal["hour", "day"]

LOST = "lost"
STATUSES: tuple[str, ...] = (*Generation.Status.values, LOST)
FAILED_STATUSES = (Generation.Status.ERROR, LOST)


def with_state(rows: QuerySet[Generation]) -> QuerySet[Generation]:
    """`state`: a row's status, or `lost` for a row a dead process left: marked so (the prune job,
    a server's start), or still `running` past the longest a generation lives."""
    lost = [
        When(error_code=ErrorCode.LOST, then=Value(LOST)),
        When(status=Generation.Status.RUNNING, created_at__lt=lost_before(), then=Value(LOST)),
    ]
    return rows.annotate(state=Case(*lost, default=F("status"), output_field=CharField()))


#: The admin's and the command's named ranges.
PRESET_RANGES: dict[str, dt.timedelta] = {
    "24h": dt.timedelta(hours=24),
    "7d": dt.timedelta(days=7),
    "30d": dt.timedelta(days=30),
}

#: The longest custom range the admin page accepts.
MAX_RANGE = dt.timedelta(days=366)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, sorted ascending; None for no values."""
    if not values:
        return None
    rank = (len(values) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return values[low] + (values[high] - values[low]) * (rank - low)


class _Rates:
    __slots__ = ()
    cache_hits: int
    cache_lookups: int
    errors: int
    requests: int

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.cache_lookups if self.cache_lookups else None

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None


@dataclass(frozen=True, slots=True)
class TimeBucket:
    start: dt.datetime
    requests: int
    by_status: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    ttft_p50: float | None
    ttft_p95: float | None
    refused: int = 0


@dataclass(frozen=True, slots=True)
class BreakdownRow(_Rates):
    """One persona's or one model's share of the range."""

    key: str
    label: str
    requests: int
    errors: int
    cache_hits: int
    cache_lookups: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    #: Requests with tokens on a model without a published price: not in `cost_usd`.
    unpriced: int
    thumbs_up: int
    thumbs_down: int
    ttft_p50: float | None
    refused: int = 0


@dataclass(frozen=True, slots=True)
class Stats(_Rates):
    since: dt.datetime
    until: dt.datetime
    bucket: Bucket
    include_previews: bool
    requests: int
    by_status: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    unpriced: int
    cache_hits: int
    cache_lookups: int
    errors: int
    errors_by_code: list[tuple[str, int]]
    ttft_p50: float | None
    ttft_p95: float | None
    refused: int = 0
    refused_by_code: list[tuple[str, int]] = field(default_factory=list)
    buckets: list[TimeBucket] = field(default_factory=list)
    by_persona: list[BreakdownRow] = field(default_factory=list)
    by_model: list[BreakdownRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: datetimes in ISO 8601, money (a Decimal) as its exact text."""
        plain = json.dumps(
            asdict(self), default=lambda v: v.isoformat() if isinstance(v, dt.datetime) else str(v)
        )
        data: dict[str, Any] = json.loads(plain)
        data["errors_by_code"] = [{"code": code, "count": count} for code, count in self.errors_by_code]
        data["refused_by_code"] = [{"code": code, "count": count} for code, count in self.refused_by_code]
        data["hit_rate"] = self.hit_rate
        data["error_rate"] = self.error_rate
        for name in ("by_persona", "by_model"):
            for row, obj in zip(data[name], getattr(self, name), strict=True):
                row["hit_rate"] = obj.hit_rate
                row["error_rate"] = obj.error_rate
        return data


def _bucket_starts(since: dt.datetime, until: dt.datetime, bucket: Bucket) -> list[dt.datetime]:
    """Every bucket's start in the range, in the current time zone, so empty ones show as 0."""
    tz = timezone.get_current_timezone()
    start = since.astimezone(tz).replace(minute=0, second=0, microsecond=0)
    if bucket == "day":
        start = start.replace(hour=0)
    step = dt.timedelta(hours=1) if bucket == "hour" else dt.timedelta(days=1)
    starts = []
    while start < until:
        starts.append(start)
        # Add in UTC, then convert back: a DST change must not skip or repeat a bucket.
        start = (start.astimezone(dt.UTC) + step).astimezone(tz)
        if bucket == "day":
            start = start.replace(hour=0)
    return starts


def _requests(**conditions: Any) -> Count:
    return Count("id", filter=Q(**conditions) if conditions else None)


def _totals() -> dict[str, Any]:
    return {
        "requests": _requests(),
        "errors": _requests(state__in=FAILED_STATUSES),
        "cache_hits": _requests(cache_status=Generation.CacheStatus.HIT),
        "cache_lookups": _requests(
            cache_status__in=[Generation.CacheStatus.HIT, Generation.CacheStatus.MISS]
        ),
        # Named apart from the fields they sum: an aggregate may not shadow a field.
        "prompt_sum": Sum("prompt_tokens", default=0),
        "completion_sum": Sum("completion_tokens", default=0),
        "cost_sum": Sum("cost_usd", default=Decimal(0)),
        "unpriced": _requests(cost_usd__isnull=True, completion_tokens__isnull=False),
        "thumbs_up": _requests(feedback=1),
        "thumbs_down": _requests(feedback=-1),
    }


def _breakdown(
    rows: Iterable[dict[str, Any]],
    *,
    key: str,
    label: Any,
    ttft: dict[Any, list[float]],
    refused: dict[Any, int],
) -> list[BreakdownRow]:
    result = [
        BreakdownRow(
            key=str(row[key]),
            label=label(row),
            requests=row["requests"],
            errors=row["errors"],
            cache_hits=row["cache_hits"],
            cache_lookups=row["cache_lookups"],
            prompt_tokens=row["prompt_sum"],
            completion_tokens=row["completion_sum"],
            cost_usd=Decimal(row["cost_sum"]),
            unpriced=row["unpriced"],
            thumbs_up=row["thumbs_up"],
            thumbs_down=row["thumbs_down"],
            ttft_p50=percentile(sorted(ttft.get(row[key], [])), 50),
            refused=refused.get(row[key], 0),
        )
        for row in rows
    ]
    return sorted(result, key=lambda r: (-r.requests, r.label))


def gateway_stats(
    *, since: dt.datetime, until: dt.datetime, bucket: Bucket | None = None, include_previews: bool = False
) -> Stats:
    """Requests, tokens, cost, cache, errors and time to first token in `[since, until)`; by hour
    up to two days, else by day."""
    bucket = bucket or ("hour" if until - since <= dt.timedelta(days=2) else "day")
    rows = with_state(Generation.objects.filter(created_at__gte=since, created_at__lt=until))
    if not include_previews:
        rows = rows.filter(is_preview=False)
    trunc = TruncHour if bucket == "hour" else TruncDay
    tz = timezone.get_current_timezone()

    totals = rows.aggregate(**_totals())
    by_status = {status: 0 for status in STATUSES}
    # `state` is an annotation (with_state), which the type checker does not know as a field.
    for row in rows.values("state").annotate(n=_requests()).order_by():  # type: ignore[misc]
        by_status[row["state"]] = row["n"]
    errors_by_code = [
        (row["error_code"] or row["state"], row["n"])
        for row in rows.filter(state__in=FAILED_STATUSES)  # type: ignore[misc]
        .values("error_code", "state")
        .annotate(n=_requests())
        .order_by("-n", "error_code")
    ]
    refusals = Refusal.objects.filter(hour__gte=since, hour__lt=until)
    refused_by_code = [
        (row["code"], row["n"])
        for row in refusals.values("code").annotate(n=Sum("count")).order_by("-n", "code")
    ]
    refused_personas = list(
        refusals.values("persona__slug", "persona__name").annotate(n=Sum("count")).order_by()
    )
    refused_by_persona = {row["persona__slug"]: row["n"] for row in refused_personas}
    refused_by_bucket = {
        row["bucket"]: row["n"]
        for row in refusals.annotate(bucket=trunc("hour", tzinfo=tz))
        .values("bucket")
        .annotate(n=Sum("count"))
        .order_by()
    }

    samples = (
        rows.filter(ttft_ms__isnull=False)
        .annotate(bucket=trunc("created_at", tzinfo=tz))
        .values_list("bucket", "persona__slug", "model", "ttft_ms")
        .order_by()
    )
    all_ttft: list[float] = []
    ttft_by_bucket: dict[dt.datetime, list[float]] = defaultdict(list)
    ttft_by_persona: dict[str, list[float]] = defaultdict(list)
    ttft_by_model: dict[str, list[float]] = defaultdict(list)
    for start, slug, model, ttft in samples.iterator(chunk_size=5000):
        if ttft is None:  # filtered out above; this tells the type checker
            continue
        all_ttft.append(ttft)
        ttft_by_bucket[start].append(ttft)
        ttft_by_persona[slug].append(ttft)
        ttft_by_model[model].append(ttft)
    all_ttft.sort()

    per_bucket: dict[dt.datetime, dict[str, Any]] = {
        row["bucket"]: row
        for row in rows.annotate(bucket=trunc("created_at", tzinfo=tz))
        .values("bucket")
        .annotate(
            requests=_requests(),
            prompt_sum=Sum("prompt_tokens", default=0),
            completion_sum=Sum("completion_tokens", default=0),
            cost_sum=Sum("cost_usd", default=Decimal(0)),
            **{f"s_{status}": _requests(state=status) for status in STATUSES},
        )
        .order_by("bucket")
    }
    buckets = []
    for start in _bucket_starts(since, until, bucket):
        row = per_bucket.get(start, {})
        values = sorted(ttft_by_bucket.get(start, []))
        buckets.append(
            TimeBucket(
                start=start,
                requests=row.get("requests", 0),
                by_status={status: row.get(f"s_{status}", 0) for status in STATUSES},
                prompt_tokens=row.get("prompt_sum", 0),
                completion_tokens=row.get("completion_sum", 0),
                cost_usd=Decimal(row.get("cost_sum", 0)),
                ttft_p50=percentile(values, 50),
                ttft_p95=percentile(values, 95),
                refused=refused_by_bucket.get(start, 0),
            )
        )

    persona_rows = list(rows.values("persona__slug", "persona__name").annotate(**_totals()).order_by())
    # A persona whose every request was refused has no row in the range, but its refusals count.
    logged = {row["persona__slug"] for row in persona_rows}
    zero = dict.fromkeys(_totals(), 0)
    persona_rows += [
        {**zero, "persona__slug": row["persona__slug"], "persona__name": row["persona__name"]}
        for row in refused_personas
        if row["persona__slug"] not in logged
    ]
    by_persona = _breakdown(
        persona_rows,
        key="persona__slug",
        label=lambda row: row["persona__name"],
        ttft=ttft_by_persona,
        refused=refused_by_persona,
    )
    by_model = _breakdown(
        rows.values("model").annotate(**_totals()).order_by(),
        key="model",
        label=lambda row: getattr(get_model(row["model"]), "name", row["model"]),
        ttft=ttft_by_model,
        refused={},
    )

    return Stats(
        since=since,
        until=until,
        bucket=bucket,
        include_previews=include_previews,
        requests=totals["requests"],
        by_status=by_status,
        prompt_tokens=totals["prompt_sum"],
        completion_tokens=totals["completion_sum"],
        cost_usd=Decimal(totals["cost_sum"]),
        unpriced=totals["unpriced"],
        cache_hits=totals["cache_hits"],
        cache_lookups=totals["cache_lookups"],
        errors=totals["errors"],
        errors_by_code=errors_by_code,
        ttft_p50=percentile(all_ttft, 50),
        ttft_p95=percentile(all_ttft, 95),
        refused=sum(count for _, count in refused_by_code),
        refused_by_code=refused_by_code,
        buckets=buckets,
        by_persona=by_persona,
        by_model=by_model,
    )


def parse_since(value: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """`24h`, `7d`, `90m`-style spans back from now. Raises ValueError on anything else."""
    value = value.strip().lower()
    units = {"m": "minutes", "h": "hours", "d": "days"}
    number, unit = value[:-1], value[-1:]
    if unit not in units or not number.isdigit() or int(number) <= 0:
        raise ValueError(f"{value!r} is not a span such as 24h, 7d or 30d.")
    try:
        return (now or timezone.now()) - dt.timedelta(**{units[unit]: int(number)})
    except OverflowError:  # past what a timedelta holds, or before year 1
        raise ValueError(f"{value!r} reaches back further than the calendar does.") from None


def spend_today() -> Decimal:
    """What today's (UTC) generations on paid models cost, as their rows estimate it."""
    midnight = timezone.now().astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = Generation.objects.filter(created_at__gte=midnight)
    return Decimal(rows.aggregate(total=Sum("cost_usd", default=Decimal(0)))["total"])


@dataclass(frozen=True, slots=True)
class DiffLine:
    kind: Literal["add", "remove", "same"]
    text: str

    @property
    def sign(self) -> str:
        return {"add": "+", "remove": "-", "same": " "}[self.kind]


@dataclass(slots=True)
class FieldDiff:
    name: str
    lines: list[DiffLine] = field(default_factory=list)


def _display(value: object) -> str:
    if value is None:
        return "(not set)"
    if value == "":
        return "(empty)"
    if isinstance(value, list):
        return ", ".join(str(item) for item in value) if value else "(none)"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _text_lines(value: object) -> list[str]:
    return _display(value).splitlines() or [""]


def config_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> list[FieldDiff]:
    """The fields that differ between two version configs, line by line (every field when
    there is no older version). Plain text: the template escapes it."""
    names = [n for n in GENERATION_FIELDS if n in new or (old and n in old)]
    names += sorted(set(new) - set(names))
    diffs = []
    for name in names:
        after = new.get(name)
        if old is None:
            diffs.append(FieldDiff(name, [DiffLine("add", line) for line in _text_lines(after)]))
            continue
        before = old.get(name)
        if before == after:
            continue
        a, b = _text_lines(before), _text_lines(after)
        lines: list[DiffLine] = []
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if tag == "equal":
                lines += [DiffLine("same", line) for line in a[i1:i2]]
                continue
            lines += [DiffLine("remove", line) for line in a[i1:i2]]
            lines += [DiffLine("add", line) for line in b[j1:j2]]
        diffs.append(FieldDiff(name, lines))
    return diffs


@dataclass(slots=True)
class VersionEntry:
    version: PersonaVersion
    diffs: list[FieldDiff]
    is_current: bool


def version_history(persona: Persona) -> list[VersionEntry]:
    """The persona's versions, newest first, each with its diff against the one before."""
    versions = list(persona.versions.select_related("created_by").order_by("-number"))
    current = persona.generation_config()
    entries = []
    for index, version in enumerate(versions):
        older = versions[index + 1] if index + 1 < len(versions) else None
        entries.append(
            VersionEntry(
                version=version,
                diffs=config_diff(older.config if older else None, version.config),
                is_current=not version.is_draft and version.config == current,
            )
        )
    return entries


# -- experiments ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Arm:
    """What one arm of an experiment served, and what its readers thought of it."""

    name: str
    #: the draft's; the live arm's is whatever version is live as each quote is asked
    version: PersonaVersion | None
    share: int
    quotes: int
    errors: int
    up: int
    down: int
    ttft_p50_ms: float | None
    mean_tokens: float | None
    cost_usd: Decimal

    @property
    def up_share(self) -> float | None:
        votes = self.up + self.down
        return self.up / votes if votes else None

    @property
    def up_interval(self) -> tuple[float, float] | None:
        """The 95% Wilson score interval of the share of votes that are up."""
        return wilson(self.up, self.up + self.down)

    @property
    def error_rate(self) -> float | None:
        total = self.quotes + self.errors
        return self.errors / total if total else None


def wilson(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float] | None:
    if not trials:
        return None
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(slots=True)
class ExperimentReport:
    experiment: Experiment
    arms: list[Arm]


def experiment_report(experiment: Experiment) -> ExperimentReport:
    """The experiment's two arms side by side: the live version's readers and the draft's."""
    rows = Generation.objects.filter(experiment=experiment, is_preview=False)
    votes = Vote.objects.filter(generation__experiment=experiment).values("generation__arm", "value")
    tally: dict[tuple[str, int], int] = defaultdict(int)
    for vote in votes.annotate(n=Count("id")):
        tally[(vote["generation__arm"], vote["value"])] += vote["n"]
    arms = []
    for name, share in ((Experiment.LIVE, 100 - experiment.share), (Experiment.DRAFT, experiment.share)):
        mine = rows.filter(arm=name)
        totals = mine.aggregate(
            quotes=Count("id", filter=Q(status=Generation.Status.OK)),
            errors=Count("id", filter=Q(status=Generation.Status.ERROR)),
            cost=Sum("cost_usd"),
        )
        ok = mine.filter(status=Generation.Status.OK)
        ttfts = sorted(t for t in ok.values_list("ttft_ms", flat=True) if t is not None)
        tokens = [t for t in ok.values_list("completion_tokens", flat=True) if t is not None]
        arms.append(
            Arm(
                name=name,
                version=experiment.draft if name == Experiment.DRAFT else None,
                share=share,
                quotes=totals["quotes"],
                errors=totals["errors"],
                up=tally[(name, 1)],
                down=tally[(name, -1)],
                ttft_p50_ms=percentile(ttfts, 50),
                mean_tokens=sum(tokens) / len(tokens) if tokens else None,
                cost_usd=totals["cost"] or Decimal(0),
            )
        )
    return ExperimentReport(experiment, arms)


def experiments_in(stats: Stats | None) -> QuerySet[Experiment]:
    """The experiments running now, and those that ended in the range shown."""
    running = Q(ended_at__isnull=True)
    shown = running | Q(ended_at__gte=stats.since, ended_at__lt=stats.until) if stats else running
    return Experiment.objects.filter(shown).select_related("persona", "draft")
