"""Proof under stress (issue 8), through the real ASGI app: a visitor who leaves mid-stream stops
the upstream at once and leaves a `cancelled` row, on both backends; and one table of every
upstream fault with what the visitor sees, what the log row says, and no traceback logged.

The faults' finer points (each code's message, headers, wire variants, secrets) are covered in
tests/backends/test_workers_ai_endpoint.py and tests/stream/test_gateway.py; this file is the summary table.

Timing: the disconnect trials assert only a generous bound (1 s); the max and the p50 go to
artifacts/reliability.json and docs/benchmarks.md (target 100 ms), since timing asserts are not
reliable on a shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from harness.services import free_port
from harness.workers_ai import EXPECTED_ERRORS, FakeWorkersAI, Scenario
from quotes.ai.backends import _backends, reset_backends
from quotes.ai.backends.local import LocalBackend
from quotes.ai.gateway.runs import flights
from quotes.models import Generation, Persona
from tests.asgi import StreamedResponse, parse_sse, post_stream, read_events
from tests.fixtures import upstream_configs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

MODEL = "@cf/meta/llama-3.1-8b-instruct"
FALLBACK = "@cf/meta/llama-3.2-3b-instruct"
ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "reliability.json"
TRIALS = 50
SEED = 8  # issue 8


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
async def _close_backends_on_this_loop() -> AsyncIterator[None]:
    """Close the workers-ai backend's httpx client on the test's loop; keep the embedded model
    loaded (reset_backends would unload it for the next test)."""
    yield
    workers_ai = _backends.pop("workers-ai", None)
    if workers_ai is not None:
        await workers_ai.aclose()
    for flight in list(flights.values()):
        if flight.task is not None:
            flight.task.cancel()
    flights.clear()


def text_of(body: bytes) -> str:
    """The quote in a (possibly cut off) SSE body: complete token events only."""
    text = ""
    complete = body[: body.rfind(b"\n\n") + 2] if b"\n\n" in body else b""
    for event in parse_sse(complete) if complete else []:
        if event["event"] == "message" and event["data"] != "[DONE]":
            text += json.loads(event["data"]).get("response", "")
    return text


async def wait_for_row(public_id: str, timeout_s: float = 5.0) -> Generation:
    deadline = time.monotonic() + timeout_s
    while True:
        row = await Generation.objects.filter(public_id=public_id).afirst()
        if row is not None or time.monotonic() > deadline:
            assert row is not None, f"no log row for {public_id}"
            return row
        await asyncio.sleep(0.01)


@dataclass
class Trials:
    backend: str
    measure: str
    delays_s: list[float] = field(default_factory=list)
    tokens_read: list[int] = field(default_factory=list)
    #: embedded model only: tokens the thread generated after the stop was asked for
    tokens_after_stop: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.delays_s)
        return {
            "backend": self.backend,
            "measure": self.measure,
            "trials": len(ordered),
            "p50_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
            "max_ms": round(ordered[-1] * 1000, 2),
            "tokens_read_min_max": [min(self.tokens_read), max(self.tokens_read)],
            "tokens_after_stop_max": max(self.tokens_after_stop, default=None),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }


def record(trials: Trials) -> None:
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    try:
        results = json.loads(ARTIFACT.read_text())
    except (OSError, ValueError):
        results = {}
    results[f"disconnect_{trials.backend}"] = trials.summary()
    ARTIFACT.write_text(json.dumps(results, indent=2) + "\n")


async def assert_cancelled_row(response: StreamedResponse, received: bytes) -> None:
    row = await wait_for_row(response.headers["x-quote-id"])
    assert row.status == Generation.Status.CANCELLED, (row.status, row.error_code)
    assert row.error_code == "abandoned"  # dropped, nobody resumed (no grace in the tests)
    client_text = text_of(received)
    assert client_text
    assert row.text.startswith(client_text), (client_text, row.text)
    assert row.duration_ms is not None


# -- 1. disconnects --------------------------------------------------------------------------------


async def test_disconnect_trials_workers_ai_close_the_upstream_and_log_cancelled(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, unlimited: Any
) -> None:
    rng = random.Random(SEED)
    trials = Trials("workers-ai", "upstream socket closed (fake's disconnected_at, time.monotonic)")
    fake_workers_ai.default = Scenario(tokens=[f" w{i}" for i in range(400)], token_delay_s=0.005)
    for trial in range(TRIALS):
        tokens = rng.randint(1, 30)
        stream = post_stream({"persona": persona.slug, "topic": f"trial {trial}"})
        received = await read_events(stream, tokens)

        sent_at = time.monotonic()  # the fake stamps with time.monotonic() too
        await stream.disconnect()

        upstream = fake_workers_ai.requests[-1]
        assert await asyncio.to_thread(upstream.client_disconnected.wait, 5), f"trial {trial}"
        assert upstream.disconnected_at is not None
        delay = upstream.disconnected_at - sent_at
        assert delay < 1.0, f"trial {trial}: the upstream was closed {delay:.3f} s after the disconnect"
        assert stream.response is not None
        await assert_cancelled_row(stream.response, received)
        trials.delays_s.append(max(delay, 0.0))
        trials.tokens_read.append(tokens)
    assert len(fake_workers_ai.requests) == TRIALS
    record(trials)


async def test_disconnect_trials_local_model_stop_the_model_thread_and_log_cancelled(
    persona: Persona, local_backend: LocalBackend, unlimited: Any
) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=200, temperature=0.0)
    topic = "the patience of rivers"
    # One full run to learn how long this quote is, so every trial leaves while tokens remain.
    full = post_stream({"persona": persona.slug, "topic": topic, "fresh": True})
    await full.start()
    whole = await full.read_all()
    length = whole.body.count(b"data: {")  # token events (+ usage)
    assert length >= 6, whole.body
    rng = random.Random(SEED)
    trials = Trials("local", "model thread finished (JobStats.finished_at, time.perf_counter)")
    for trial in range(TRIALS):
        tokens = rng.randint(1, max(1, min(10, length // 2)))
        # fresh: no cache hit, so every trial runs the model
        stream = post_stream({"persona": persona.slug, "topic": topic, "fresh": True})
        received = await read_events(stream, tokens)
        job = local_backend.jobs[-1]

        sent_at = time.perf_counter()  # JobStats stamps with time.perf_counter()
        await stream.disconnect()

        deadline = time.monotonic() + 5
        # finished_at is set on the model thread: poll it (there is no event to await)
        while job.finished_at is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        assert job.finished_at is not None, f"trial {trial}: the model thread did not stop"
        assert job.stop_reason == "stopped", (trial, job)
        assert job.generated_at_stop is not None and job.generated_at_stop >= tokens
        # What the app controls: the thread stops at the next token. How long one token takes is
        # up to llama.cpp and the machine (one decode took 1.15 s at load average 5), so the
        # time bound is only a hang detector; the max and p50 are recorded, not asserted.
        assert job.generated_tokens <= job.generated_at_stop + 1, job
        trials.tokens_after_stop.append(job.generated_tokens - job.generated_at_stop)
        delay = job.finished_at - sent_at
        assert delay < 5.0, f"trial {trial}: the model stopped {delay:.3f} s after the disconnect"
        assert stream.response is not None
        await assert_cancelled_row(stream.response, received)
        trials.delays_s.append(max(delay, 0.0))
        trials.tokens_read.append(tokens)
    record(trials)
    # The model is fine afterwards: the next request streams a whole quote.
    after = post_stream({"persona": persona.slug, "topic": topic, "fresh": True})
    await after.start()
    assert (await after.read_all()).body.endswith(b"data: [DONE]\n\n")


# -- 2. every upstream fault, in one table ------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    scenarios: tuple[Scenario, ...] = ()
    gateway: dict[str, Any] = field(default_factory=dict)
    workers_ai: dict[str, Any] = field(default_factory=dict)
    refused: bool = False
    #: what the visitor sees: an HTTP status before the stream (a JSON error), or 200 and then
    #: [DONE] (error_code "") or an `error` event
    status: int = 200
    error_code: str = ""
    row_status: str = Generation.Status.ERROR
    text: str | None = None
    model: str = MODEL


def _before(scenario: Scenario, status: int, code: str) -> Fault:
    return Fault((scenario,), status=status, error_code=code, text="")


FAULTS = [
    pytest.param(Fault(refused=True, status=502, error_code="upstream_unreachable", text=""), id="refused"),
    pytest.param(_before(Scenario.server_error(503), 502, "upstream_unavailable"), id="503-before-stream"),
    pytest.param(
        _before(Scenario.server_error(502, html=True), 502, "upstream_unavailable"),
        id="502-html-before-stream",
    ),
    *(
        pytest.param(_before(Scenario.error(code), status, ours), id=f"envelope-{code}")
        for code, (ours, status) in EXPECTED_ERRORS.items()
    ),
    pytest.param(
        Fault(
            (Scenario.out_of_capacity(), Scenario.out_of_capacity()),
            gateway={"max_attempts": 2, "retry_delay_ms": 10, "fallback_models": [FALLBACK]},
            row_status=Generation.Status.OK,
            text="Stay hungry, stay foolish.",
            model=FALLBACK,
        ),
        id="3040-retried-then-fallback",
    ),
    pytest.param(
        Fault(
            (Scenario(stall_before_s=5),),
            gateway={"ttft_timeout_s": 0.3},
            status=504,
            error_code="upstream_timeout",
            text="",
        ),
        id="stall-before-first-token",
    ),
    pytest.param(
        Fault(
            (Scenario(stall_after_tokens=2, stall_s=5),),
            gateway={"idle_timeout_s": 0.3},
            error_code="idle_timeout",
            text="Stay hungry",
        ),
        id="stall-mid-stream-idle-timeout",
    ),
    pytest.param(
        Fault((Scenario(drop_after_tokens=2),), error_code="upstream_dropped", text="Stay hungry"),
        id="drop-mid-stream",
    ),
    pytest.param(
        Fault((Scenario(malformed_after_tokens=2),), error_code="upstream_malformed", text="Stay hungry"),
        id="malformed-json-event",
    ),
    pytest.param(
        # No line-length cap is documented or enforced: a 1 MiB event is streamed whole.
        Fault(
            (Scenario(tokens=("L" * (1 << 20), " end")),),
            row_status=Generation.Status.OK,
            text="L" * (1 << 20) + " end",
        ),
        id="1MiB-event-line",
    ),
]


@pytest.mark.parametrize("fault", FAULTS)
async def test_fault_summary_client_outcome_log_row_and_no_traceback(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
    fault: Fault,
) -> None:
    workers_ai_settings.QUOTES_GATEWAY = replace(workers_ai_settings.QUOTES_GATEWAY, **fault.gateway)
    overrides = dict(fault.workers_ai)
    if fault.refused:
        overrides["base_url"] = f"http://127.0.0.1:{free_port()}/client/v4"
    if overrides:
        workers_ai_settings.WORKERS_AI, workers_ai_settings.AI_HTTP = upstream_configs(
            fake_workers_ai, **overrides
        )
        await reset_backends()
    fake_workers_ai.script(*fault.scenarios)

    with caplog.at_level(logging.ERROR):
        stream = post_stream({"persona": persona.slug})
        await stream.start()
        response = await stream.read_all()

    assert response.status == fault.status, response.body[:300]
    if fault.status != 200:
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["code"] == fault.error_code and error["message"]
    else:
        assert response.headers["content-type"] == "text/event-stream"
        last = parse_sse(response.body)[-1]
        if fault.error_code:
            assert last["event"] == "error"
            assert json.loads(last["data"])["error"]["code"] == fault.error_code
            assert b"[DONE]" not in response.body
        else:
            assert last["data"] == "[DONE]"
        assert text_of(response.body) == fault.text
    row = await Generation.objects.aget()
    assert (row.status, row.error_code) == (fault.row_status, fault.error_code)
    assert row.model == fault.model
    if fault.text is not None:
        assert row.text == fault.text
    tracebacks = [
        r
        for r in caplog.records
        if r.exc_info and r.name.split(".")[0] in ("quotes", "django") and r.levelno >= logging.ERROR
    ]
    assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks]
