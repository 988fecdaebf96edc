"""The faults, and one run of a fault under load with its checks (issue 21; issue 34, "Faults").

A run: the clients ask for quotes (load.py) for `warm_s`; the fault is injected and lasts
`fault_s` (or as long as injecting it takes: a rolling restart); it is ended and the load goes on
for `after_s`; the clients finish the quotes they are reading. Then the rows settle (rows wait in
a process's memory while the database is down, and are written once it is back), for up to
SETTLE_S, and the checks run, each a list of problems:

- rows: every generation a client saw (X-Quote-Id) has exactly one row in PostgreSQL (by
  public_id), completed, but for the streams a killed process was serving: those rows stay
  `running` (the admin and gateway_stats show them as lost once older than the total deadline),
  and so may rows of its generations no client saw yet (a stream it had ended, row written, may
  be cut on its last bytes: that row is complete); no other row appeared;
- answers: no 500, no HTML error page, no answer that is not the API's (SSE for a stream, JSON
  for anything else), no `internal_error`, no request without a response, no stream cut
  mid-way (but the killed process's);
- silence: no request waited longer than SILENCE_S for its next byte (headers included); with
  the upstream hung, QUOTES_TTFT_TIMEOUT (the whole wait for a first token) plus a margin;
- redis outage: with Redis down, at least 90% of the quotes started during the outage complete;
- logs: no traceback in the daphnes' logs, and no ERROR line but django.request's (its line
  for each 5xx answered, which the answers' check judges).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .layout import Layout
from .load import Load, Quote

#: The longest a request may wait for its next byte, but for a first token (QUOTES_TTFT_TIMEOUT).
SILENCE_S = 5.0
#: The margin over QUOTES_TTFT_TIMEOUT for a request that waits for a hung upstream.
TTFT_MARGIN_S = 2.0
#: How long the rows get to arrive once the load has stopped.
SETTLE_S = 20.0
#: With Redis down, at least this share of the quotes started meanwhile complete.
REDIS_DOWN_COMPLETE = 0.9
RUNNING = "running"


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    inject: Callable[[Layout], object]
    recover: Callable[[Layout], object]
    #: a process dies: its streams are cut, and their rows stay `running`
    kills: bool = False
    #: Redis is down meanwhile: REDIS_DOWN_COMPLETE of the quotes started then must complete
    redis_down: bool = False
    #: the upstream sends no first token: a request may wait QUOTES_TTFT_TIMEOUT for it
    upstream_hangs: bool = False


def _restart_killed(layout: Layout) -> None:
    layout.daphnes[0].start()
    layout.daphnes[0].wait_healthy()


FAULTS: dict[str, Fault] = {
    fault.name: fault
    for fault in (
        Fault("baseline", "no fault (a control)", inject=lambda layout: None, recover=lambda layout: None),
        Fault(
            "postgres-stopped",
            "pg_ctl stop -m fast, then start",
            inject=lambda layout: layout.pg.stop("fast"),
            recover=lambda layout: layout.pg.start(),
        ),
        Fault(
            "database-read-only",
            "ALTER DATABASE SET default_transaction_read_only = on and pg_terminate_backend "
            "(then off, and the sessions ended again)",
            inject=lambda layout: layout.database_read_only(True),
            recover=lambda layout: layout.database_read_only(False),
        ),
        Fault(
            "redis-stopped",
            "redis-server stopped (SIGTERM), then started again, empty, on its port",
            inject=lambda layout: layout.redis.stop(),
            recover=lambda layout: layout.redis.start(),
            redis_down=True,
        ),
        Fault(
            "redis-hung",
            "redis-server paused (SIGSTOP), then resumed (SIGCONT)",
            inject=lambda layout: layout.redis.pause(),
            recover=lambda layout: layout.redis.resume(),
            redis_down=True,
        ),
        Fault(
            "daphne-killed",
            "daphne A killed (SIGKILL), then started again on its port",
            inject=lambda layout: layout.daphnes[0].kill(),
            recover=_restart_killed,
            kills=True,
        ),
        Fault(
            "rolling-restart",
            "deploy/rolling-restart's steps: each process in turn SIGTERM (drain), exit, start, healthy",
            inject=lambda layout: layout.rolling_restart(),
            recover=lambda layout: None,
        ),
        Fault(
            "upstream-hung",
            "the upstream takes each request and sends nothing (before its first token)",
            inject=lambda layout: layout.upstream_hung(True),
            recover=lambda layout: layout.upstream_hung(False),
            upstream_hangs=True,
        ),
    )
}


@dataclass
class Report:
    fault: Fault
    load: Load
    clients: int
    fault_s: float
    #: what the fault's injection returned (the rolling restart's steps)
    injected: object = None
    #: generation rows by public_id: (count, status, error_code)
    rows: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    #: new generation rows no client saw: (public_id, status, error_code)
    unseen: list[tuple[str, str, str]] = field(default_factory=list)
    rows_settled_after_s: float = 0.0
    #: each process's /healthz status, polled during the fault
    health: list[list[int]] = field(default_factory=list)
    log_records: list[dict[str, Any]] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=dict)

    @property
    def quotes(self) -> list[Quote]:
        return self.load.quotes

    def during(self) -> list[Quote]:
        """The quotes started while the fault lasted."""
        start, end = self.load.marks["fault"], self.load.marks["recovered"]
        return [quote for quote in self.quotes if start <= quote.started <= end]

    def cut(self) -> set[str]:
        """The generations whose streams were cut mid-way."""
        return {quote.quote_id for quote in self.quotes if quote.outcome == "cut" and quote.quote_id}

    def failed(self) -> list[str]:
        return [f"{check}: {problem}" for check, problems in self.problems.items() for problem in problems]


def run(
    layout: Layout, fault: Fault, *, clients: int = 30, fault_s: float = 3.0, after_s: float = 3.0
) -> Report:
    """One run of `fault` under the load of `clients` clients, settled and checked. The clients
    start over a quote's length, and the fault comes half a second after the last started."""
    layout.wait_until_healthy()
    first_row = layout.last_row_id()
    log_marks = layout.log_marks()
    ramp_s = layout.settings.tokens / layout.settings.tokens_per_second
    load = Load(layout.url, clients, ramp_s=ramp_s)
    report = Report(fault=fault, load=load, clients=clients, fault_s=fault_s)

    async def poll_health(until: asyncio.Event) -> None:
        while not until.is_set():
            report.health.append(await layout.healthz())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), 0.5)

    async def schedule(load: Load) -> None:
        await asyncio.sleep(ramp_s + 0.5)
        load.mark("fault")
        recovered = asyncio.Event()
        poller = asyncio.create_task(poll_health(recovered))
        try:
            report.injected = await asyncio.to_thread(fault.inject, layout)
            load.mark("injected")
            await asyncio.sleep(load.marks["fault"] + fault_s - time.monotonic())
        finally:
            # Whatever happened, the layout is whole again for the next run.
            await asyncio.to_thread(fault.recover, layout)
            load.mark("recovered")
            recovered.set()
            await poller
        await asyncio.sleep(after_s)

    asyncio.run(load.run(schedule))
    load.mark("stopped")
    _settle_rows(layout, report, first_row)
    report.log_records = layout.log_records_since(log_marks)
    report.problems = check(report, ttft_timeout_s=layout.settings.ttft_timeout_s)
    return report


def _seen_ids(report: Report) -> set[str]:
    return {quote.quote_id for quote in report.quotes if quote.quote_id}


def _read_rows(layout: Layout, report: Report, first_row: int) -> None:
    ids = _seen_ids(report)
    found = layout.sql(
        "SELECT public_id::text, count(*), min(status), min(error_code) FROM quotes_generation "
        "WHERE public_id = ANY(%s::uuid[]) GROUP BY public_id",
        [sorted(ids)],
    )
    report.rows = {public_id: (int(count), status, code) for public_id, count, status, code in found}
    new = layout.sql(
        "SELECT public_id::text, status, error_code FROM quotes_generation WHERE id > %s", [first_row]
    )
    report.unseen = [row for row in new if row[0] not in ids]


def _settled(report: Report) -> bool:
    cut = report.cut() if report.fault.kills else set()
    return _seen_ids(report) <= report.rows.keys() and all(
        status != RUNNING or public_id in cut for public_id, (_, status, _) in report.rows.items()
    )


def _settle_rows(layout: Layout, report: Report, first_row: int) -> None:
    started = time.monotonic()
    _read_rows(layout, report, first_row)
    while not _settled(report) and time.monotonic() - started < SETTLE_S:
        time.sleep(0.25)
        _read_rows(layout, report, first_row)
    report.rows_settled_after_s = time.monotonic() - started


def _sample(quotes: list[Quote], limit: int = 3) -> str:
    return "; ".join(
        f"[{q.client} {q.status} {q.outcome} {q.code} silent {q.silence:.1f} s] {q.detail[:160]!r}"
        for q in quotes[:limit]
    )


def check(report: Report, *, ttft_timeout_s: float) -> dict[str, list[str]]:
    fault, quotes = report.fault, report.quotes
    problems: dict[str, list[str]] = {}

    rows = problems["rows"] = []
    ids = _seen_ids(report)
    missing = sorted(ids - report.rows.keys())
    if missing:
        rows.append(f"{len(missing)} of {len(ids)} generations have no row, e.g. {missing[:3]}")
    doubled = [public_id for public_id, (count, _, _) in report.rows.items() if count != 1]
    if doubled:
        rows.append(f"{len(doubled)} generations have more than one row, e.g. {doubled[:3]}")
    cut = report.cut() if fault.kills else set()
    running = [i for i, (_, status, _) in report.rows.items() if status == RUNNING and i not in cut]
    if running:
        rows.append(f"{len(running)} rows still `running` {SETTLE_S:g} s after the load, e.g. {running[:3]}")
    unseen = [row for row in report.unseen if not (fault.kills and row[1] == RUNNING)]
    if unseen:
        rows.append(f"{len(unseen)} rows of generations no client saw, e.g. {unseen[:3]}")

    answers = problems["answers"] = []
    not_ours = [
        q
        for q in quotes
        if q.outcome in ("answered", "error", "done")
        and not (
            q.content_type.startswith("text/event-stream") if q.status == 200 else q.json_error and q.code
        )
    ]
    if not_ours:
        answers.append(f"{len(not_ours)} answers that are not the API's (HTML?): {_sample(not_ours)}")
    server_errors = [q for q in quotes if q.status == 500 or q.code == "internal_error"]
    if server_errors:
        answers.append(f"{len(server_errors)} internal errors (500): {_sample(server_errors)}")
    failed = [q for q in quotes if q.outcome == "failed"]
    if failed:
        answers.append(f"{len(failed)} requests got no response: {_sample(failed)}")
    cut_quotes = [q for q in quotes if q.outcome == "cut"]
    if cut_quotes and not fault.kills:
        answers.append(f"{len(cut_quotes)} streams cut mid-way: {_sample(cut_quotes)}")

    limit = max(SILENCE_S, ttft_timeout_s + TTFT_MARGIN_S) if fault.upstream_hangs else SILENCE_S
    silent = sorted((q for q in quotes if q.silence > limit), key=lambda q: -q.silence)
    problems["silence"] = (
        [f"{len(silent)} requests silent for more than {limit:g} s: {_sample(silent)}"] if silent else []
    )

    if fault.redis_down:
        during = report.during()
        complete = sum(1 for q in during if q.outcome == "done")
        share = complete / len(during) if during else 0.0
        problems["redis outage"] = (
            []
            if share >= REDIS_DOWN_COMPLETE
            else [
                f"{complete} of {len(during)} quotes started during the outage completed ({share:.0%}): "
                f"{Counter(f'{q.outcome} {q.code}'.strip() for q in during)}"
            ]
        )

    # django.request's lines are its report of the statuses answered: the answers' check judges
    # those (a 500 fails there; a JSON 503 or 504 is meant). Any traceback is a problem.
    errors = [
        record
        for record in report.log_records
        if (record.get("level") in ("ERROR", "CRITICAL") and record.get("logger") != "django.request")
        or record.get("exc_info")
        or "Traceback" in str(record.get("message", ""))
    ]
    problems["logs"] = (
        [
            f"{len(errors)} ERROR lines or tracebacks, e.g. "
            + "; ".join(
                f"[{r.get('process')} {r.get('level')} {r.get('logger')}] {str(r.get('message'))[:200]}"
                for r in errors[:3]
            )
        ]
        if errors
        else []
    )
    return problems


def summary(report: Report) -> dict[str, object]:
    """The figures of one run (bench/faults.py prints them)."""
    quotes, during = report.quotes, report.during()
    outcomes = Counter(f"{q.outcome} {q.status} {q.code}".strip() for q in quotes)
    silences = sorted(q.silence for q in quotes)
    health = Counter(status for statuses in report.health for status in statuses)
    statuses = Counter(status for _, status, _ in report.rows.values())
    return {
        "quotes": len(quotes),
        "started during the fault": len(during),
        "of which complete": sum(1 for q in during if q.outcome == "done"),
        "outcomes": ", ".join(f"{n}x {k}" for k, n in outcomes.most_common()),
        "longest silence p50/p99/max (s)": (
            f"{silences[len(silences) // 2]:.2f} / {silences[int(len(silences) * 0.99)]:.2f} / {silences[-1]:.2f}"
            if silences
            else "-"
        ),
        "generations seen / with one row": f"{len(_seen_ids(report))} / {len(report.rows)}",
        "rows by status": ", ".join(f"{n}x {s}" for s, n in statuses.most_common()) or "-",
        "rows no client saw": len(report.unseen),
        "rows settled after (s)": f"{report.rows_settled_after_s:.1f}",
        "/healthz during the fault": ", ".join(f"{n}x {s}" for s, n in sorted(health.items())) or "-",
        "log lines ERROR / WARNING": (
            f"{sum(1 for r in report.log_records if r.get('level') in ('ERROR', 'CRITICAL'))} / "
            f"{sum(1 for r in report.log_records if r.get('level') == 'WARNING')}"
        ),
    }
