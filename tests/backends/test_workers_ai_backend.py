"""WorkersAIBackend.stream() against the fake upstream: real HTTP on 127.0.0.1, real bytes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario, render_body
from quotes.ai.backends import get_backend, reset_backends
from quotes.ai.backends.workers_ai import WorkersAIBackend
from quotes.ai.events import Done, Error, Event, GenerationRequest, Message, Meta, Token, Usage
from quotes.conf import CloudflareGatewayRetries, CloudflareGatewaySettings
from tests.fixtures import (
    TEST_ACCOUNT_ID,
    TEST_API_TOKEN,
    TEST_GATEWAY_TOKEN,
    gateway_config,
    upstream_configs,
)

pytestmark = pytest.mark.integration

MODEL = "@cf/meta/llama-3.1-8b-instruct"
REQUEST = GenerationRequest(
    model=MODEL,
    messages=(
        Message("system", "You are Ada Lovelace. Answer with one short quote."),
        Message("user", "Write a quote about engines."),
    ),
    speaker="Ada Lovelace",
    topic="engines",
)
DEFAULT_TOKENS = [Token("Stay"), Token(" hungry"), Token(","), Token(" stay"), Token(" foolish"), Token(".")]
NON_ASCII = ("café", " 日本", " 🎉", "ñ", " naïve", 7, " Ω≈ç√")
NON_ASCII_TEXT = "café 日本 🎉ñ naïve7 Ω≈ç√"


async def collect(backend: WorkersAIBackend, request: GenerationRequest = REQUEST) -> list[Event]:
    return [event async for event in backend.stream(request)]


def text_of(events: list[Event]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


def last_error(events: list[Event]) -> Error:
    assert isinstance(events[-1], Error), events
    return events[-1]


@asynccontextmanager
async def make_backend(
    fake: FakeWorkersAI, *, gateway: CloudflareGatewaySettings | None = None, **overrides: Any
) -> AsyncIterator[WorkersAIBackend]:
    workers_ai, http = upstream_configs(fake, **overrides)
    backend = WorkersAIBackend(workers_ai=workers_ai, gateway=gateway or gateway_config(fake), http=http)
    try:
        yield backend
    finally:
        await backend.aclose()


def full_gateway(fake: FakeWorkersAI) -> CloudflareGatewaySettings:
    return gateway_config(
        fake,
        id="gw-test",
        token=TEST_GATEWAY_TOKEN,
        skip_cache=True,
        cache_ttl=3600,
        cache_key="persona-ada-engines",
        metadata={"persona": "ada", "version": 3, "beta": True},
        collect_log=False,
        request_timeout_ms=5000,
        retries=CloudflareGatewayRetries(max_attempts=3, retry_delay_ms=500, backoff="exponential"),
    )


# -- the happy path -------------------------------------------------------------------------------


async def test_backend_streams_meta_tokens_usage_done(workers_ai_backend, fake_workers_ai):
    events = await collect(workers_ai_backend)

    assert events == [Meta(model=MODEL, headers={}), *DEFAULT_TOKENS, Usage(12, 6), Done()]


async def test_backend_name_and_model_name(workers_ai_backend):
    assert workers_ai_backend.name == "workers-ai"
    assert workers_ai_backend.model_name(MODEL) == MODEL


async def test_backend_registry_builds_it_from_settings(workers_ai_settings, fake_workers_ai):
    backend = get_backend()
    try:
        events = [event async for event in backend.stream(REQUEST)]
    finally:
        await reset_backends()

    assert isinstance(backend, WorkersAIBackend)
    assert events[-1] == Done()
    assert fake_workers_ai.requests[0].headers["authorization"] == f"Bearer {TEST_API_TOKEN}"


async def test_backend_meta_keeps_only_cf_aig_response_headers(workers_ai_backend, fake_workers_ai):
    headers = {
        "cf-aig-cache-status": "HIT",
        "cf-aig-step": "1",
        "cf-aig-log-id": "01JLOGID",
        "cf-aig-request-id": "req-42",
        "x-unrelated": "no",
    }
    fake_workers_ai.script(Scenario(headers=headers))

    events = await collect(workers_ai_backend)

    assert events[0] == Meta(
        model=MODEL,
        headers={
            "cf-aig-cache-status": "HIT",
            "cf-aig-step": "1",
            "cf-aig-log-id": "01JLOGID",
            "cf-aig-request-id": "req-42",
        },
    )


async def test_backend_reuses_then_reopens_its_client(workers_ai_backend, fake_workers_ai):
    first = await collect(workers_ai_backend)
    second = await collect(workers_ai_backend)
    await workers_ai_backend.aclose()
    third = await collect(workers_ai_backend)

    assert first == second == third
    assert len(fake_workers_ai.requests) == 3


async def test_backend_serves_concurrent_streams(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.default = Scenario(token_delay_s=0.01)

    results = await asyncio.gather(*(collect(workers_ai_backend) for _ in range(20)))

    assert all(events[1:] == [*DEFAULT_TOKENS, Usage(12, 6), Done()] for events in results)
    assert len(fake_workers_ai.requests) == 20


# -- the request: URL, headers, body --------------------------------------------------------------


async def test_backend_posts_to_the_run_url_without_gateway(workers_ai_backend, fake_workers_ai):
    await collect(workers_ai_backend)

    [request] = fake_workers_ai.requests
    assert request.method == "POST"
    assert request.path == f"/client/v4/accounts/{TEST_ACCOUNT_ID}/ai/run/{MODEL}"
    assert (request.route, request.account, request.model) == ("run", TEST_ACCOUNT_ID, MODEL)
    assert request.headers["authorization"] == f"Bearer {TEST_API_TOKEN}"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["accept-encoding"] == "identity"
    assert not [name for name in request.headers if name.startswith("cf-aig-")]


async def test_backend_posts_to_the_gateway_url_with_every_cf_aig_header(fake_workers_ai):
    async with make_backend(fake_workers_ai, gateway=full_gateway(fake_workers_ai)) as backend:
        events = await collect(backend)

    assert events[-1] == Done()
    [request] = fake_workers_ai.requests
    assert request.path == f"/gateway/v1/{TEST_ACCOUNT_ID}/gw-test/workers-ai/{MODEL}"
    assert (request.route, request.account, request.gateway, request.model) == (
        "gateway",
        TEST_ACCOUNT_ID,
        "gw-test",
        MODEL,
    )
    headers = request.headers
    assert headers["authorization"] == f"Bearer {TEST_API_TOKEN}"
    assert headers["cf-aig-authorization"] == f"Bearer {TEST_GATEWAY_TOKEN}"
    assert headers["cf-aig-skip-cache"] == "true"
    assert headers["cf-aig-cache-ttl"] == "3600"
    assert headers["cf-aig-cache-key"] == "persona-ada-engines"
    assert json.loads(headers["cf-aig-metadata"]) == {"persona": "ada", "version": 3, "beta": True}
    assert headers["cf-aig-collect-log"] == "false"
    assert headers["cf-aig-request-timeout"] == "5000"
    assert headers["cf-aig-max-attempts"] == "3"
    assert headers["cf-aig-retry-delay"] == "500"
    assert headers["cf-aig-backoff"] == "exponential"


async def test_backend_sends_only_the_gateway_options_that_are_set(fake_workers_ai):
    gateway = gateway_config(fake_workers_ai, id="gw-test", collect_log=True)
    async with make_backend(fake_workers_ai, gateway=gateway) as backend:
        await collect(backend)

    [request] = fake_workers_ai.requests
    assert request.route == "gateway"
    assert {name: value for name, value in request.headers.items() if name.startswith("cf-aig-")} == {
        "cf-aig-collect-log": "true"
    }


async def test_backend_ignores_gateway_options_without_a_gateway_id(fake_workers_ai):
    gateway = replace(full_gateway(fake_workers_ai), id="")
    async with make_backend(fake_workers_ai, gateway=gateway) as backend:
        await collect(backend)

    [request] = fake_workers_ai.requests
    assert request.route == "run"
    assert not [name for name in request.headers if name.startswith("cf-aig-")]


async def test_backend_body_has_messages_stream_and_max_tokens_only_by_default(
    workers_ai_backend, fake_workers_ai
):
    await collect(workers_ai_backend)

    assert fake_workers_ai.requests[0].json == {
        "messages": [
            {"role": "system", "content": "You are Ada Lovelace. Answer with one short quote."},
            {"role": "user", "content": "Write a quote about engines."},
        ],
        "stream": True,
        "max_tokens": 256,
    }


async def test_backend_body_has_every_sampling_field_that_is_set(workers_ai_backend, fake_workers_ai):
    request = GenerationRequest(
        model=MODEL,
        messages=(Message("user", "Un café, s'il vous plaît 日本"),),
        speaker="s",
        topic="t",
        max_tokens=64,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=1234,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.3,
    )

    await collect(workers_ai_backend, request)

    assert fake_workers_ai.requests[0].json == {
        "messages": [{"role": "user", "content": "Un café, s'il vous plaît 日本"}],
        "stream": True,
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1234,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.2,
        "presence_penalty": 0.3,
    }


async def test_backend_body_has_lora_and_raw_when_a_lora_is_asked(workers_ai_backend, fake_workers_ai):
    model = "@cf/google/gemma-2b-it-lora"
    request = GenerationRequest(
        model=model, messages=REQUEST.messages, speaker="s", topic="t", lora="ada-adapter"
    )

    await collect(workers_ai_backend, request)

    [recorded] = fake_workers_ai.requests
    assert recorded.model == model
    assert recorded.json["lora"] == "ada-adapter"
    assert recorded.json["raw"] is True


@pytest.mark.parametrize(
    "model", ["../../../user/tokens", "@cf/meta/x?y=1", "@cf/a/../../b", "@cf/a b", "", "a//b"]
)
async def test_backend_refuses_a_model_id_that_could_leave_the_url_path(
    workers_ai_backend, fake_workers_ai, model
):
    request = GenerationRequest(model=model, messages=REQUEST.messages, speaker="s", topic="t")

    events = await collect(workers_ai_backend, request)

    assert [(e.code, e.status) for e in events if isinstance(e, Error)] == [("model_not_found", 400)]
    assert len(events) == 1
    assert fake_workers_ai.requests == []


# -- the wire format --------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 64, "random", [1, 2, 3, 9, 10, 11, 40]])
async def test_backend_reassembles_split_reads(workers_ai_backend, fake_workers_ai, split):
    fake_workers_ai.script(Scenario(tokens=NON_ASCII, split=split, seed=7))

    events = await collect(workers_ai_backend)

    assert text_of(events) == NON_ASCII_TEXT
    assert events[1:] == [Token(str(t)) for t in NON_ASCII] + [Usage(12, 6), Done()]


async def test_backend_reassembles_a_body_cut_at_every_single_byte_offset(
    workers_ai_backend, fake_workers_ai
):
    scenario = Scenario(tokens=NON_ASCII, crlf=True)
    body = render_body(scenario, model=MODEL)
    expected = [Meta(model=MODEL, headers={}), *(Token(str(t)) for t in NON_ASCII), Usage(12, 6), Done()]
    fake_workers_ai.script(
        *(Scenario(tokens=NON_ASCII, crlf=True, split=[offset]) for offset in range(1, len(body)))
    )

    for offset in range(1, len(body)):
        assert await collect(workers_ai_backend) == expected, f"cut at byte {offset}"


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ending", ["lf", "crlf", "cr_only"])
async def test_backend_reads_random_splits_with_any_line_ending_padding_and_comments(
    workers_ai_backend, fake_workers_ai, seed, ending
):
    options = {"crlf": ending == "crlf", "cr_only": ending == "cr_only"}
    fake_workers_ai.script(
        Scenario(
            tokens=NON_ASCII, split="random", seed=seed, padding=True, comments=bool(seed % 2), **options
        )
    )

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token(str(t)) for t in NON_ASCII] + [Usage(12, 6), Done()]


@pytest.mark.parametrize("split", [None, 1, 2, "random"])
async def test_backend_drops_a_leading_bom_and_keeps_the_first_token(
    workers_ai_backend, fake_workers_ai, split
):
    body = b"\xef\xbb\xbf" + render_body(Scenario(tokens=NON_ASCII), model=MODEL)
    fake_workers_ai.script(Scenario(raw_body=body, split=split, seed=19))

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token(str(t)) for t in NON_ASCII] + [Usage(12, 6), Done()]


async def test_backend_hands_on_a_cr_only_event_without_waiting_for_the_next_read(
    workers_ai_backend, fake_workers_ai
):
    # The second token comes only after a long stall: the first must be out before it.
    fake_workers_ai.script(Scenario(tokens=["a", "b"], cr_only=True, stall_after_tokens=1, stall_s=10))
    async with aclosing(workers_ai_backend.stream(REQUEST)) as events:
        assert isinstance(await anext(events), Meta)
        assert await asyncio.wait_for(anext(events), 2) == Token("a")


@pytest.mark.parametrize(
    "options",
    [{"crlf": True}, {"cr_only": True}, {"padding": True}, {"comments": True}, {"split_delay_s": 0.002}],
)
async def test_backend_reads_each_wire_variant(workers_ai_backend, fake_workers_ai, options):
    split = 3 if "split_delay_s" in options else None
    fake_workers_ai.script(Scenario(tokens=NON_ASCII, split=split, **options))

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token(str(t)) for t in NON_ASCII] + [Usage(12, 6), Done()]


async def test_backend_streams_without_usage_when_upstream_sends_none(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(usage=None))

    events = await collect(workers_ai_backend)

    assert events[1:] == [*DEFAULT_TOKENS, Done()]


async def test_backend_reads_usage_that_arrives_with_a_token(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(tokens=["a", "b"], usage=(3, 2), usage_with_token=True))

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token("a"), Token("b"), Usage(3, 2), Done()]


async def test_backend_turns_a_number_response_into_text(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(tokens=[42, " is", " the answer", 0]))

    events = await collect(workers_ai_backend)

    assert events[1:5] == [Token("42"), Token(" is"), Token(" the answer"), Token("0")]


async def test_backend_reads_openai_style_chunks(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(
        Scenario(tokens=NON_ASCII[:3], openai_style=True, usage=(9, 3), split="random", seed=1)
    )

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token("café"), Token(" 日本"), Token(" 🎉"), Usage(9, 3), Done()]


async def test_backend_skips_empty_tokens(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(tokens=["", "a", "", "b", ""], usage=None))

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token("a"), Token("b"), Done()]


async def test_backend_delivers_an_over_long_line_whole(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(tokens=["!"], long_line=1_000_000, split=65_536))

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token("L" * 1_000_000), Token("!"), Usage(12, 6), Done()]


async def test_backend_ignores_anything_after_done(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(
        Scenario(raw_body=b'data: {"response":"a"}\n\ndata: [DONE]\n\ndata: {"response":"b"}\n\n')
    )

    events = await collect(workers_ai_backend)

    assert events[1:] == [Token("a"), Done()]


# -- errors before the stream --------------------------------------------------------------------------

ERROR_TABLE = [
    (Scenario.model_not_found(), "model_not_found", 400),
    (Scenario.invalid_model_id(), "model_not_found", 400),
    (Scenario.incomplete_request(), "upstream_bad_request", 400),
    (Scenario.lora_not_supported(), "lora_not_supported", 400),
    (Scenario.terms_not_accepted(), "upstream_forbidden", 403),
    (Scenario.private_model(), "upstream_forbidden", 403),
    (Scenario.error(3041), "upstream_forbidden", 403),
    (Scenario.account_blocked(), "upstream_forbidden", 403),
    (Scenario.request_too_large(), "request_too_large", 413),
    (Scenario.upstream_timeout(), "upstream_timeout", 408),
    (Scenario.request_aborted(), "upstream_timeout", 408),
    (Scenario.quota_exceeded(), "upstream_quota_exceeded", 429),
    (Scenario.out_of_capacity(), "upstream_capacity", 429),
    (Scenario.unauthorized(), "upstream_auth", 502),
    (Scenario.forbidden(), "upstream_auth", 502),
    (Scenario(status=401, raw_body=b""), "upstream_auth", 502),
    (Scenario(status=404, error_code=7003, error_message="No route for that URI"), "upstream_rejected", 404),
    (Scenario(status=422, raw_body=b"not json at all"), "upstream_rejected", 422),
    (Scenario(status=429, raw_body=b"{}"), "upstream_rejected", 429),
    (Scenario.server_error(500), "upstream_unavailable", 502),
    (Scenario.server_error(502, html=True), "upstream_unavailable", 502),
    (Scenario.server_error(503, html=True), "upstream_unavailable", 502),
    (Scenario.server_error(503), "upstream_unavailable", 502),
    (Scenario(status=504, raw_body=b"upstream timed out"), "upstream_unavailable", 502),
    # a documented code wins over the status it arrives with
    (Scenario.error(3040, status=503), "upstream_capacity", 429),
]


@pytest.mark.parametrize(("scenario", "code", "status"), ERROR_TABLE)
async def test_backend_maps_upstream_errors_to_stable_codes(
    workers_ai_backend, fake_workers_ai, scenario, code, status
):
    fake_workers_ai.script(scenario)

    events = await collect(workers_ai_backend)

    assert events[0] == Meta(model=MODEL, headers={})
    error = last_error(events)
    assert (error.code, error.status) == (code, status)
    assert len(events) == 2
    assert error.message[:1].isupper()
    assert "<" not in error.message and "{" not in error.message


async def test_backend_error_message_is_ours_and_the_upstream_message_is_logged(
    workers_ai_backend, fake_workers_ai, caplog
):
    fake_workers_ai.script(Scenario.error(5007, "No such model @cf/nope/nope or task"))

    error = last_error(await collect(workers_ai_backend))

    assert error.message == "That model does not exist on Workers AI."
    [logged] = [r.getMessage() for r in caplog.records if r.name == "quotes.ai.backends.workers_ai"]
    assert "Workers AI said: HTTP 400: No such model @cf/nope/nope or task" in logged


async def test_backend_keeps_meta_headers_on_an_error(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario.error(3040, headers={"cf-aig-log-id": "log-7", "cf-aig-step": "0"}))

    events = await collect(workers_ai_backend)

    assert events[0] == Meta(model=MODEL, headers={"cf-aig-log-id": "log-7", "cf-aig-step": "0"})


async def test_backend_rejects_a_200_that_is_not_an_event_stream(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(
        Scenario(raw_body=b'{"result":{"response":"hi"},"success":true}', content_type="application/json")
    )

    error = last_error(await collect(workers_ai_backend))

    assert (error.code, error.status) == ("upstream_malformed", 502)


async def test_backend_reports_a_refused_connection_as_unreachable(fake_workers_ai, closed_port):
    async with make_backend(fake_workers_ai, base_url=f"http://127.0.0.1:{closed_port}/client/v4") as backend:
        events = await collect(backend)

    assert events == [last_error(events)]
    assert (events[0].code, events[0].status) == ("upstream_unreachable", 502)


async def test_backend_reports_a_connect_timeout_as_a_timeout(fake_workers_ai, unaccepting_port):
    base_url = f"http://127.0.0.1:{unaccepting_port}/client/v4"
    async with make_backend(fake_workers_ai, base_url=base_url, connect_timeout_s=0.2) as backend:
        events = await collect(backend)

    assert events == [last_error(events)]
    assert (events[0].code, events[0].status) == ("upstream_timeout", 504)


# -- errors inside the stream ---------------------------------------------------------------------------


async def test_backend_reports_a_dropped_connection(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(drop_after_tokens=3))

    events = await collect(workers_ai_backend)

    assert events[1:4] == DEFAULT_TOKENS[:3]
    assert (last_error(events).code, last_error(events).status) == ("upstream_dropped", 502)
    assert len(events) == 5


@pytest.mark.parametrize("chunked", [True, False])
async def test_backend_reports_a_stream_that_ends_without_done_as_dropped(
    workers_ai_backend, fake_workers_ai, chunked
):
    fake_workers_ai.script(Scenario(send_done=False, chunked=chunked))

    events = await collect(workers_ai_backend)

    assert events[1:-1] == [*DEFAULT_TOKENS, Usage(12, 6)]
    assert last_error(events).code == "upstream_dropped"


async def test_backend_reports_a_malformed_event(workers_ai_backend, fake_workers_ai):
    fake_workers_ai.script(Scenario(malformed_after_tokens=2))

    events = await collect(workers_ai_backend)

    assert events[1:3] == DEFAULT_TOKENS[:2]
    assert (last_error(events).code, last_error(events).status) == ("upstream_malformed", 502)
    assert len(events) == 4


@pytest.mark.parametrize("data", [b"[1, 2]", b'"text"', b"42", b"null"])
async def test_backend_reports_json_that_is_not_an_object_as_malformed(
    workers_ai_backend, fake_workers_ai, data
):
    fake_workers_ai.script(Scenario(raw_body=b"data: " + data + b"\n\ndata: [DONE]\n\n"))

    events = await collect(workers_ai_backend)

    assert last_error(events).code == "upstream_malformed"


async def test_backend_maps_an_error_envelope_inside_the_stream(workers_ai_backend, fake_workers_ai):
    envelope = (
        b'{"success":false,"errors":[{"code":3040,"message":"Capacity temporarily exceeded"}],"result":null}'
    )
    fake_workers_ai.script(Scenario(raw_body=b'data: {"response":"a"}\n\ndata: ' + envelope + b"\n\n"))

    events = await collect(workers_ai_backend)

    assert events[1] == Token("a")
    assert last_error(events).code == "upstream_capacity"


# -- cancellation -----------------------------------------------------------------------------------------


async def wait_for_disconnect(fake: FakeWorkersAI) -> float:
    [request] = fake.requests
    assert await asyncio.to_thread(request.client_disconnected.wait, 5)
    assert request.disconnected_at is not None
    return request.disconnected_at


async def test_backend_closes_the_upstream_connection_when_the_consumer_stops(
    workers_ai_backend, fake_workers_ai
):
    fake_workers_ai.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    stream = workers_ai_backend.stream(REQUEST)
    tokens = 0
    async for event in stream:
        tokens += isinstance(event, Token)
        if tokens == 2:
            break
    closed_at = time.monotonic()
    await stream.aclose()

    disconnected_at = await wait_for_disconnect(fake_workers_ai)
    assert disconnected_at - closed_at < 1.0


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(Scenario(stall_before_headers_s=30), id="before-headers"),
        pytest.param(Scenario(stall_before_s=30), id="before-the-first-token"),
        pytest.param(Scenario(stall_after_tokens=2, stall_s=30), id="mid-stream"),
    ],
)
async def test_backend_closes_the_upstream_connection_when_its_task_is_cancelled(
    workers_ai_backend, fake_workers_ai, scenario
):
    """The policy's deadlines end a stalled stream by cancelling its task (the backend keeps
    none): wherever it waits, the cancellation passes through and the connection is closed."""
    fake_workers_ai.script(scenario)
    task = asyncio.create_task(collect(workers_ai_backend))
    await asyncio.to_thread(fake_workers_ai.wait_for_requests, 1)
    await asyncio.sleep(0.05)
    cancelled_at = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    disconnected_at = await wait_for_disconnect(fake_workers_ai)
    assert disconnected_at - cancelled_at < 1.0


async def test_backend_finishing_normally_is_not_a_disconnect(workers_ai_backend, fake_workers_ai):
    await collect(workers_ai_backend)

    [request] = fake_workers_ai.requests
    assert await asyncio.to_thread(request.finished.wait, 5)
    assert not request.client_disconnected.is_set()


# -- secrets never leak ---------------------------------------------------------------------------------

SECRETS = (TEST_API_TOKEN, TEST_GATEWAY_TOKEN)


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text
        assert secret[:16] not in text


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario.unauthorized(message=f"Invalid API token {TEST_API_TOKEN}"),
        Scenario(
            status=400, error_code=9999, error_message=f"bad: Bearer {TEST_GATEWAY_TOKEN}, {TEST_API_TOKEN}"
        ),
        Scenario.error(3040, f"capacity for {TEST_API_TOKEN} / {TEST_GATEWAY_TOKEN}"),
        Scenario(status=500, raw_body=f"<html>{TEST_API_TOKEN}</html>".encode()),
        Scenario(headers={"cf-aig-log-id": TEST_API_TOKEN, "cf-aig-step": f"Bearer {TEST_GATEWAY_TOKEN}"}),
    ],
)
async def test_backend_never_puts_a_token_in_an_error_or_a_log_line(fake_workers_ai, caplog, scenario):
    fake_workers_ai.script(scenario)
    # Our logger at every level; third parties at the project's level (httpcore's DEBUG trace
    # prints raw response headers, whatever they hold, and must stay off in production).
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="quotes")
    async with make_backend(fake_workers_ai, gateway=full_gateway(fake_workers_ai)) as backend:
        events = await collect(backend)

    assert_no_secret(repr(events))
    assert_no_secret(caplog.text)


async def test_backend_scrubs_tokens_echoed_into_the_stream(fake_workers_ai):
    fake_workers_ai.script(Scenario(echo_headers=True, split="random", seed=3))
    async with make_backend(fake_workers_ai, gateway=full_gateway(fake_workers_ai)) as backend:
        events = await collect(backend)

    text = text_of(events)
    assert_no_secret(text)
    assert "\nauthorization: Bearer [redacted]\n" in text
    assert "cf-aig-authorization: Bearer [redacted]\n" in text
    assert "cf-aig-cache-key: persona-ada-engines\n" in text
    assert events[-1] == Done()


async def test_backend_scrubs_a_token_cut_across_several_tokens(workers_ai_backend, fake_workers_ai):
    pieces = [
        "key=",
        TEST_API_TOKEN[:1],
        TEST_API_TOKEN[1:9],
        TEST_API_TOKEN[9:30],
        TEST_API_TOKEN[30:],
        " end",
        " c",
    ]
    fake_workers_ai.script(Scenario(tokens=pieces, usage=None))

    events = await collect(workers_ai_backend)

    assert text_of(events) == "key=[redacted] end c"
    assert events[-1] == Done()


async def test_backend_keeps_text_that_only_starts_like_a_token(workers_ai_backend, fake_workers_ai):
    pieces = ["x", TEST_API_TOKEN[:10], " and more", TEST_API_TOKEN[:3]]
    fake_workers_ai.script(Scenario(tokens=pieces, usage=None, send_done=False))

    events = await collect(workers_ai_backend)

    assert text_of(events) == "x" + TEST_API_TOKEN[:10] + " and more" + TEST_API_TOKEN[:3]
    assert last_error(events).code == "upstream_dropped"
