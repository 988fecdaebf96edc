"""Prometheus metrics at `GET /metrics`, each process its own: counted once per stream from its
row, never per token, or read when scraped. The endpoint exists only when QUOTES_METRICS_TOKEN or
QUOTES_METRICS_ALLOW is set, and answers only requests that pass both.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from .. import state
from ..admission import LAG_LIMIT_S, Admission, Lag
from ..backends import loaded_backends
from ..backends.local import LocalBackend
from ..spend import spent_today

if TYPE_CHECKING:
    from ..models import Generation

disable_created_metrics()

REQUESTS = Counter(
    "quotes_requests",
    "Generations by outcome (ok, error, cancelled) and error code: one per log row.",
    ["transport", "backend", "model", "outcome", "code"],
)
REFUSED = Counter(
    "quotes_refused",
    "Stream requests refused before any generation (429 rate limits, 503 capacity, drain, budget).",
    ["transport", "code"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "quotes_time_to_first_token_seconds",
    "From the generation's start to its first token.",
    ["backend", "model", "cache"],
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0),
)
DURATION = Histogram(
    "quotes_stream_duration_seconds",
    "Whole generations, by outcome.",
    ["backend", "outcome"],
    buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0),
)
TOKENS = Counter(
    "quotes_tokens",
    "Tokens read (prompt) and written (completion); cached answers not.",
    ["backend", "model", "kind"],
)
COST = Counter(
    "quotes_cost_usd", "Estimated cost in US dollars (the catalog's prices).", ["backend", "model"]
)
CACHE_LOOKUPS = Counter("quotes_cache_lookups", "Answer-cache lookups, by result (hit or miss).", ["result"])
FALLBACKS = Counter("quotes_fallbacks", "Generations answered by a fallback model.", ["backend", "model"])
LOST_ROWS = Counter("quotes_log_rows_lost", "Log rows the database never got (logged instead). Must stay 0.")
ROWS_WAITING = Gauge("quotes_log_rows_waiting", "Log rows waiting for the database (it is down, or slow).")
SPENT = Gauge(
    "quotes_spend_today_usd",
    "Today's spend on paid models (UTC), as the ceiling counts it (NaN: no ceiling).",
)
CEILING = Gauge("quotes_spend_ceiling_usd", "The site's daily spend ceiling (NaN: none).")


def enabled() -> bool:
    return bool(settings.QUOTES_METRICS_ENABLED)


def stream_finished(row: Generation, transport: str) -> None:
    if not enabled():
        return
    backend, model, outcome = row.backend, row.model, row.status
    REQUESTS.labels(transport, backend, model, outcome, row.error_code).inc()
    if row.ttft_ms is not None:
        TIME_TO_FIRST_TOKEN.labels(backend, model, row.cache_status).observe(row.ttft_ms / 1000)
    if row.duration_ms is not None:
        DURATION.labels(backend, outcome).observe(row.duration_ms / 1000)
    if row.cache_status != "hit":
        if row.prompt_tokens:
            TOKENS.labels(backend, model, "prompt").inc(row.prompt_tokens)
        if row.completion_tokens:
            TOKENS.labels(backend, model, "completion").inc(row.completion_tokens)
    if row.cost_usd:
        COST.labels(backend, model).inc(float(row.cost_usd))
    if row.fallback_step:
        FALLBACKS.labels(backend, model).inc()


def stream_refused(transport: str, code: str) -> None:
    if enabled():
        REFUSED.labels(transport, code).inc()


def cache_lookup(*, hit: bool) -> None:
    if enabled():
        CACHE_LOOKUPS.labels("hit" if hit else "miss").inc()


def row_lost() -> None:
    if enabled():
        LOST_ROWS.inc()


class ProcessCollector(Collector):
    """Read when scraped: this process's open streams, its event loop's lag (what admission
    reads), and the embedded model's slots."""

    NAMES = (
        "quotes_open_streams",
        "quotes_event_loop_lag_seconds",
        *(f"quotes_local_model_{n}" for n in ("slots", "slots_in_use", "queue_length")),
    )

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, name) for name in self.NAMES]

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "quotes_open_streams", "Open streams in this process.", value=state.of(Admission).open
        )
        yield GaugeMetricFamily(
            "quotes_event_loop_lag_seconds",
            f"How late this process's event loop runs, smoothed: past {LAG_LIMIT_S} s it takes no new stream.",
            value=state.of(Lag).seconds(),
        )
        for backend in loaded_backends():
            if isinstance(backend, LocalBackend):
                for name, documentation, value in (
                    ("slots", "Embedded-model slots.", backend.slots),
                    ("slots_in_use", "Slots generating now.", backend.slots_in_use),
                    ("queue_length", "Requests waiting for a slot.", backend.waiting),
                ):
                    yield GaugeMetricFamily(f"quotes_local_model_{name}", documentation, value=value)


def _allowed(request: HttpRequest) -> bool:
    token: str = settings.QUOTES_METRICS_TOKEN
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return False
    if settings.QUOTES_METRICS_ALLOW:
        try:
            address = ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "")
        except ValueError:
            return False
        return any(address in network for network in settings.QUOTES_METRICS_ALLOW)
    return True


@require_safe
async def metrics_view(request: HttpRequest) -> HttpResponse:
    if not enabled() or not (settings.QUOTES_METRICS_TOKEN or settings.QUOTES_METRICS_ALLOW):
        raise Http404("No such page.")
    if not _allowed(request):
        return HttpResponse("Forbidden.\n", status=403, content_type="text/plain; charset=utf-8")
    ceiling = settings.QUOTES_DAILY_SPEND_LIMIT_USD  # spend is counted only under a ceiling
    SPENT.set(float("nan") if ceiling is None else float(await spent_today()))
    CEILING.set(float("nan") if ceiling is None else float(ceiling))
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(REGISTRY), content_type=content_type, headers={"Cache-Control": "no-store"})


REGISTRY.register(ProcessCollector())
