"""Prometheus metrics for the people who run the site, served at `GET /metrics`.

Every metric is defined here, and the rest of the code records through the small functions below
(`stream_opened`, `stream_finished`, `cache_lookup`, ...), one call at each place where the thing
happens. The cost on the stream path is a few counter increments *per stream*: a stream's
outcome, tokens, cost, time to first token and duration are all read from its log row, once,
when the row is written. Nothing is recorded per token. The embedded model's slots and queue are
read from the model when Prometheus scrapes, not updated as they change.

Each process serves its own metrics (see docs/deployment.md, "Metrics"): daphne processes are
started one by one by systemd, not forked from a master, so prometheus-client's multiprocess
mode (a shared directory of per-pid files, cleaned up by a master's child-exit hook) does not fit.

Why prometheus-client itself and not django-prometheus: django-prometheus's middleware is a
`MiddlewareMixin` with sync hooks, which under ASGI costs thread hops on every request (the hops
quotes/middleware.py removed), its HTTP metrics see a streamed response end when its headers go
out, not when the stream does, and what the operators need here (streams, tokens, cost, cache,
the model's slots) is domain state no middleware can see.

`QUOTES_METRICS_ENABLED=false` turns recording and the endpoint off. The endpoint is closed by
default: it answers only when `QUOTES_METRICS_TOKEN` (a bearer token) or `QUOTES_METRICS_ALLOW`
(client addresses) is set, and then only to requests that pass every check that is set.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .models import Generation

# The `_created` series would double every counter and histogram for a timestamp nobody charts.
disable_created_metrics()

#: Time to first token: a cached answer starts in milliseconds, a cold model in seconds.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
#: A whole stream: up to AI_TOTAL_TIMEOUT (120 s by default).
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)

OPEN_STREAMS = Gauge(
    "quotes_open_streams",
    "Streams open now, from the gateway's admission to the log row, by transport.",
    ["transport"],
)
REQUESTS = Counter(
    "quotes_requests",
    "Generation requests by outcome (ok, error, cancelled, rate_limited, busy) and error code, "
    "as logged: one per log row.",
    ["transport", "backend", "model", "outcome", "code"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "quotes_time_to_first_token_seconds",
    "From the gateway's admission to the first token, for streams that got one.",
    ["backend", "model", "cache"],
    buckets=TTFT_BUCKETS,
)
DURATION = Histogram(
    "quotes_stream_duration_seconds",
    "Whole streams, from the gateway's admission to the log row, by outcome.",
    ["backend", "outcome"],
    buckets=DURATION_BUCKETS,
)
TOKENS = Counter(
    "quotes_tokens",
    "Tokens the model read (prompt) and wrote (completion), as it reported them. Cached and "
    "shared answers are not counted: no model worked for them.",
    ["backend", "model", "kind"],
)
COST = Counter(
    "quotes_cost_usd",
    "Estimated cost in US dollars, from the catalog's prices (cached and shared answers cost 0).",
    ["backend", "model"],
)
CACHE_LOOKUPS = Counter(
    "quotes_cache_lookups",
    "Lookups in the answer cache, by result (hit or miss).",
    ["result"],
)
COALESCED = Counter(
    "quotes_coalesced_listeners",
    "Requests that joined a generation already in flight instead of calling the model.",
)
RETRIES = Counter(
    "quotes_retries",
    "Further attempts at the same model, before the first token.",
    ["backend", "model"],
)
FALLBACKS = Counter(
    "quotes_fallbacks",
    "Fallback steps: moves to the next model after the previous one failed, before the first "
    "token; `model` is the model fallen back to.",
    ["backend", "model"],
)
LOG_QUEUE = Gauge(
    "quotes_log_writer_queue_depth",
    "Log rows waiting to be written (their insert not yet done, retries included).",
)
LOST_ROWS = Counter(
    "quotes_log_rows_lost",
    "Log rows whose insert finally failed. Must stay 0.",
)
LOG_OUTBOX = Gauge(
    "quotes_log_outbox_depth",
    "Log rows in this process's outbox: the database could not take them (down or read-only), "
    "so they wait on disk and are written when it can. Above 0 for long: the writes are failing.",
)


def enabled() -> bool:
    return bool(settings.QUOTES_METRICS_ENABLED)


# --- what the gateway and the transports record ---------------------------------------------------


def stream_opened(transport: str) -> None:
    """A stream entered the gateway. Paired with `stream_finished` when its log row is written."""
    if enabled():
        OPEN_STREAMS.labels(transport).inc()


def stream_finished(row: Generation, *, transport: str) -> None:
    """A stream ended, whatever the outcome: record it from its log row (before the insert, so a
    row that cannot be written is still counted here, and once more in quotes_log_rows_lost)."""
    if not enabled():
        return
    OPEN_STREAMS.labels(transport).dec()
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


def stream_refused(*, transport: str, backend: str, model: str, code: str) -> None:
    """A stream turned away by the rate or concurrency limit. Refusals are logged as one counted
    row per client and window (quotes/ai/refusals.py), not a row each: record each one here."""
    if not enabled():
        return
    OPEN_STREAMS.labels(transport).dec()
    REQUESTS.labels(transport, backend, model, "rate_limited", code).inc()


def cache_lookup(*, hit: bool) -> None:
    if enabled():
        CACHE_LOOKUPS.labels("hit" if hit else "miss").inc()


def coalesced_listener() -> None:
    if enabled():
        COALESCED.inc()


def attempt_started(*, backend: str, model: str, step: int, attempt: int) -> None:
    """Each attempt at a model: attempt > 0 is a retry, step > 0 at attempt 0 a fallback step."""
    if not enabled():
        return
    if attempt:
        RETRIES.labels(backend, model).inc()
    elif step:
        FALLBACKS.labels(backend, model).inc()


def log_row_queued() -> bool:
    """A log row is waiting to be written; returns whether it was counted (pass it on)."""
    if enabled():
        LOG_QUEUE.inc()
        return True
    return False


def log_row_done(*, counted: bool, lost: bool) -> None:
    """The row's write is over: written, or `lost` (its insert finally failed)."""
    if counted:
        LOG_QUEUE.dec()
        if lost:
            LOST_ROWS.inc()


def log_rows_lost(count: int) -> None:
    """Rows from the outbox that could not be written for good (or read back)."""
    if count and enabled():
        LOST_ROWS.inc(count)


def log_outbox_depth(rows: int) -> None:
    """The outbox holds `rows` now."""
    if enabled():
        LOG_OUTBOX.set(rows)


@contextmanager
def log_row_write() -> Iterator[None]:
    """Around one row's insert, retries included: the queue depth, and the row lost on failure."""
    counted = log_row_queued()
    try:
        yield
    except BaseException:
        log_row_done(counted=counted, lost=True)
        raise
    log_row_done(counted=counted, lost=False)


# --- read at scrape time ------------------------------------------------------------------------


class LocalModelCollector(Collector):
    """The embedded model's slots, read when Prometheus scrapes: nothing on the stream path.
    Present only in a process whose embedded model has been set up."""

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        from .ai.backends import loaded_backends
        from .ai.backends.local import LocalBackend

        slots, in_use, waiting = self._families()
        for backend in loaded_backends():
            if isinstance(backend, LocalBackend):
                slots.add_metric([], backend.slots)
                in_use.add_metric([], backend.slots_in_use)
                waiting.add_metric([], backend.waiting)
                return slots, in_use, waiting
        return ()

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("quotes_local_model_slots", "Visitors the embedded model serves at once."),
            GaugeMetricFamily("quotes_local_model_slots_in_use", "Embedded-model slots generating now."),
            GaugeMetricFamily(
                "quotes_local_model_queue_length", "Requests waiting for a free embedded-model slot."
            ),
        )


REGISTRY.register(LocalModelCollector())


class AdmissionCollector(Collector):
    """What this process's admission goes by (quotes.ai.gateway.capacity), read when Prometheus
    scrapes: the open-stream limit, the streams it counts against it, and the event loop's lag
    that the limit follows."""

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        from .ai.gateway import capacity

        limit, open_now, lag = self._families()
        limit.add_metric([], capacity.current_limit(settings.QUOTES_GATEWAY))
        open_now.add_metric([], capacity.open_streams.count)
        lag.add_metric([], capacity.gradient.lag_s)
        return limit, open_now, lag

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "quotes_admission_limit",
                "Streams this process admits at once now: the adaptive limit that follows the event "
                "loop's lag, within QUOTES_MAX_OPEN_STREAMS if set (+Inf: no limit).",
            ),
            GaugeMetricFamily(
                "quotes_admission_open_streams",
                "Streams open in this process, as admission counts them against its limit.",
            ),
            GaugeMetricFamily(
                "quotes_event_loop_lag_seconds",
                "How late this process's event loop runs a timer: the 90th percentile of the last "
                "2 s of samples (one every 100 ms), the signal the admission limit follows.",
            ),
        )


REGISTRY.register(AdmissionCollector())


# --- the endpoint -------------------------------------------------------------------------------


def _allowed(request: HttpRequest) -> bool:
    """Every configured check must pass: the bearer token, the client address, or both."""
    token: str = settings.QUOTES_METRICS_TOKEN
    allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = settings.QUOTES_METRICS_ALLOW
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return False
    if allow:
        try:
            address = ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "")
        except ValueError:
            return False
        if not any(address in network for network in allow):
            return False
    return True


@require_safe
async def metrics_view(request: HttpRequest) -> HttpResponse:
    """This process's metrics in Prometheus's text format (or OpenMetrics, if asked for).

    Off, or with neither a token nor an allow-list set, it does not exist (404, like any unknown
    URL); a request that fails a configured check gets 403."""
    if not enabled() or not (settings.QUOTES_METRICS_TOKEN or settings.QUOTES_METRICS_ALLOW):
        raise Http404("No such page.")
    if not _allowed(request):
        return HttpResponse("Forbidden.\n", status=403, content_type="text/plain; charset=utf-8")
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(REGISTRY), content_type=content_type, headers={"Cache-Control": "no-store"})
