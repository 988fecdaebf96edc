"""Traces (issue 42): with the standard OTLP variable set, each generation is a span of the GenAI
conventions under the request's, with a child per upstream attempt, exported over OTLP/HTTP to a
real receiver process; without it, no provider, no exporter, no span."""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from harness.daphne import start_site, wait_for, workers_ai_env
from harness.otlp import Receiver, tree
from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.models import Persona
from quotes.ops import tracing
from tests.asgi import post_quote

FALLBACK = "@cf/meta/llama-3.2-3b-instruct"
SERVER, CLIENT = 2, 3  # OTLP's SpanKind values
ERROR = 2  # OTLP's Status.STATUS_CODE_ERROR


@pytest.mark.unit
def test_only_the_standard_variables_turn_traces_on() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert not tracing.wanted({**on, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({**on, "OTEL_TRACES_EXPORTER": "none"})


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_without_the_variable_a_quote_sets_up_no_provider_no_exporter_and_no_span(
    fake: FakeWorkersAI, persona: Persona
) -> None:
    fake.script(Scenario(tokens=["Untraced"]))
    response = await post_quote({"persona": "test-watts"})
    assert response.status == 200 and b"Untraced" in response.body
    assert tracing.TRACER is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # the API's no-op
    assert "opentelemetry.sdk.trace" not in sys.modules
    assert "opentelemetry.exporter.otlp.proto.http.trace_exporter" not in sys.modules
    assert tracing.instrument(post_quote) is post_quote  # no request spans either


def by_name(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        out.setdefault(span["name"], []).append(span)
    return out


@pytest.mark.system
def test_a_quote_that_falls_back_is_one_trace_of_request_generation_and_two_attempts(tmp_path: Path) -> None:
    with FakeWorkersAI() as fake, Receiver(tmp_path / "spans.jsonl") as receiver:
        # The first model is out of capacity for longer than the first-token deadline: the next.
        fake.script(
            Scenario.out_of_capacity(retry_after=60),
            Scenario(tokens=["Saved", " again"]),
            Scenario(tokens=["Asked"]),
        )
        env = {
            **workers_ai_env(fake),
            "QUOTES_FALLBACK_MODELS": FALLBACK,
            "QUOTES_TTFT_TIMEOUT": "20",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "quotes-under-test",
        }
        with start_site(tmp_path, **env) as site, httpx.Client(timeout=30) as client:
            response = client.post(
                f"{site.url}/api/quotes/stream", json={"persona": "alan-watts", "topic": "rain"}
            )
            assert response.status_code == 200 and "Saved" in response.text
            [public_id] = [
                str(uuid.UUID(row[0])) for row in site.query("SELECT public_id FROM quotes_generation")
            ]
            # An EventSource's topic rides in the query string: no span carries it.
            query = {"persona": "alan-watts", "topic": "asked-in-private"}
            eventsource = client.get(
                f"{site.url}/api/quotes/stream", params=query, headers={"Accept": "text/event-stream"}
            )
            assert eventsource.status_code == 200 and "Asked" in eventsource.text
            first = fake.requests[0].model
            assert [r.model for r in fake.requests] == [first, FALLBACK, first]

            def generation() -> dict[str, Any] | None:
                found = [
                    s for s in receiver.spans() if s["attributes"].get("quotes.generation.id") == public_id
                ]
                return found[0] if found else None

            wait_for(lambda: generation() is not None, "the generation's span at the receiver")
            span = generation()
            assert span is not None
            wait_for(
                lambda: len([s for s in receiver.spans() if s["trace_id"] == span["trace_id"]]) >= 4,
                "its trace",
            )
            wait_for(
                lambda: any(s["name"] == "GET /api/quotes/stream" for s in receiver.spans()), "the GET's"
            )
    assert "asked-in-private" not in (tmp_path / "spans.jsonl").read_text()
    # The GET came on the POST's kept-alive connection: a trace of its own all the same.
    [get] = [s for s in receiver.spans() if s["name"] == "GET /api/quotes/stream"]
    assert get["parent_span_id"] == "" and get["trace_id"] != span["trace_id"]
    trace_spans = [s for s in receiver.spans() if s["trace_id"] == span["trace_id"]]
    assert span["resource"]["service.name"] == "quotes-under-test"
    assert span["name"] == f"chat {first}"
    attributes = span["attributes"]
    assert {
        k: attributes[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.prompt.name")
    } == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "cloudflare.workers_ai",
        "gen_ai.prompt.name": "alan-watts",
    }
    assert attributes["gen_ai.request.model"] == first
    assert attributes["gen_ai.response.model"] == FALLBACK
    assert attributes["gen_ai.usage.output_tokens"] > 0 and attributes["gen_ai.usage.input_tokens"] > 0
    assert 0 < attributes["gen_ai.response.time_to_first_chunk"] < 20
    assert attributes["quotes.fallback_step"] == 1
    assert "error.type" not in attributes
    assert not {"gen_ai.input.messages", "gen_ai.output.messages"} & set(attributes)  # no content by default
    # Under the request's span (the ASGI middleware's), with the two attempts under it.
    [request] = [s for s in trace_spans if s["span_id"] == span["parent_span_id"]]
    assert request["kind"] == SERVER and request["parent_span_id"] == ""
    attempts = sorted(
        (s for s in trace_spans if s["parent_span_id"] == span["span_id"]), key=lambda s: s["start_ns"]
    )
    assert [(a["name"], a["kind"], a["attributes"]["quotes.attempt"]) for a in attempts] == [
        (f"chat {first}", CLIENT, 1),
        (f"chat {FALLBACK}", CLIENT, 2),
    ]
    assert attempts[0]["attributes"]["error.type"] == "upstream_capacity" and attempts[0]["status"] == ERROR
    assert "error.type" not in attempts[1]["attributes"]
    assert attempts[0]["end_ns"] <= attempts[1]["start_ns"] and attempts[1]["end_ns"] <= span["end_ns"]
    assert f"\n  chat {first}" in tree(trace_spans) and f"\n    chat {FALLBACK}" in tree(trace_spans)


@pytest.mark.system
def test_a_join_a_cache_hit_and_a_stop_are_events_on_their_generations_spans(tmp_path: Path) -> None:
    with FakeWorkersAI() as fake, Receiver(tmp_path / "spans.jsonl") as receiver:
        env = {
            **workers_ai_env(fake),
            "QUOTES_CACHE_TTL": "3600",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        with start_site(tmp_path, **env) as site, httpx.Client(timeout=30) as client:
            url, body = f"{site.url}/api/quotes/stream", {"persona": "alan-watts", "topic": "tides"}
            held = threading.Event()
            fake.script(Scenario(tokens=["Held", " on"], stall_after_tokens=1, hold=held))
            with client.stream("POST", url, json=body) as first:
                with client.stream("POST", url, json=body) as joined:  # the same quote, in flight
                    held.set()
                    joined.read()
                first.read()
            hit = client.post(url, json=body)  # the same quote again: from the cache
            stopping = threading.Event()
            fake.script(Scenario(tokens=["Stop", " me"], stall_after_tokens=1, hold=stopping))
            with client.stream("POST", url, json={**body, "topic": "stops"}) as stopped:
                answer = client.post(f"{site.url}/api/quotes/{stopped.headers['x-quote-id']}/stop")
                assert answer.json()["stopped"] is True
                stopped.read()
            stopping.set()
            ids = {
                "first": first.headers["x-quote-id"],
                "joined": joined.headers["x-quote-id"],
                "hit": hit.headers["x-quote-id"],
                "stopped": stopped.headers["x-quote-id"],
            }
            assert len(set(ids.values())) == 4 and len(fake.requests) == 2

            def events() -> dict[str, list[str]]:
                found = {s["attributes"].get("quotes.generation.id"): s for s in receiver.spans()}
                return {
                    name: [e["name"] for e in found[i]["events"]] for name, i in ids.items() if i in found
                }

            wait_for(lambda: len(events()) == 4, "the four generations' spans")
    assert events() == {
        "first": [],
        "joined": ["stream.joined"],
        "hit": ["cache.hit"],
        "stopped": ["stream.stopped"],
    }
