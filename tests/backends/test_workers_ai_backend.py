"""WorkersAIBackend.stream() against the fake Workers AI upstream (harness/workers_ai.py: real HTTP on
127.0.0.1, every byte scripted): the request it sends, directly and through AI Gateway; the wire
format it reads however the body is cut; every error it maps; cancellation; our credentials in
the text (test_workers_ai_endpoint.py follows them to the page, the row and the log)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import pytest
from streaming import Done, Error, Event, Meta, Token, Usage

from harness.workers_ai import EXPECTED_ERRORS, FakeWorkersAI, KeepAliveUpstream, Scenario, render_body
from quotes.backends.base import GenerationRequest, Message
from quotes.backends.workers_ai import ERROR_CODES, WorkersAIBackend
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN, TEST_GATEWAY_TOKEN

pytestmark = pytest.mark.integration

MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
REQUEST = GenerationRequest(
    model=MODEL,
    messages=(Message("system", "You are Ada Lovelace."), Message("user", "Write a quote about engines.")),
    speaker="Ada Lovelace",
    topic="engines",
)
NON_ASCII = ("café", " 日本", " 🎉", "ñ", " naïve", "7", " Ω≈ç√")
RUN_PATH = f"/client/v4/accounts/{TEST_ACCOUNT_ID}/ai/run/{MODEL}"
GATEWAY_PATH = f"/gateway/v1/{TEST_ACCOUNT_ID}/gw-test/workers-ai/{MODEL}"
Make = Callable[..., WorkersAIBackend]
Backend, Fake = WorkersAIBackend, FakeWorkersAI


@pytest.fixture(autouse=True)
def _logging_configured() -> None:
    """Django's set-up (on the app's first import) configures logging, which drops caplog's handler
    from the root logger: have it happen before caplog attaches."""
    import config.asgi  # noqa: F401


@pytest.fixture
def fake(fake_workers_ai: FakeWorkersAI) -> FakeWorkersAI:
    return fake_workers_ai


@pytest.fixture
def backend(workers_ai_backend: WorkersAIBackend) -> WorkersAIBackend:
    return workers_ai_backend


@pytest.fixture
async def make(fake_workers_ai: FakeWorkersAI) -> AsyncIterator[Make]:
    """Backends on the fake with these options, closed on the test's loop."""
    made: list[WorkersAIBackend] = []

    def backend(**overrides: Any) -> WorkersAIBackend:
        options = {"account_id": TEST_ACCOUNT_ID, "api_token": TEST_API_TOKEN, "connect_timeout_s": 2.0}
        options |= {
            "base_url": fake_workers_ai.api_base_url,
            "gateway_base_url": fake_workers_ai.gateway_base_url,
        }
        made.append(WorkersAIBackend(**{**options, **overrides}))
        return made[-1]

    yield backend
    for each in made:
        await each.aclose()


async def collect(backend: WorkersAIBackend, request: GenerationRequest = REQUEST) -> list[Event]:
    async with aclosing(backend.stream(request)) as events:
        return [event async for event in events]


def expected(scenario: Scenario) -> list[Event]:
    """What a scenario's stream decodes to: Meta, a Token per non-empty piece, its usage, Done."""
    pieces = ["L" * scenario.long_line] if scenario.long_line else []
    pieces += [str(token) for token in scenario.tokens]
    usage = [Usage(*scenario.usage)] if scenario.usage else []
    return [Meta(model=MODEL), *(Token(piece) for piece in pieces if piece), *usage, Done()]


def error_of(number: int) -> Error:
    """The Error a documented Workers AI code becomes, as harness/workers_ai.py expects it."""
    code, status = EXPECTED_ERRORS[number]
    return Error(code, ERROR_CODES[number][2], status)


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Token))


def cf_aig(headers: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.startswith("cf-aig-")}


# -- the request ---------------------------------------------------------------------------------------


async def test_streams_meta_tokens_usage_done_from_the_run_url(backend: Backend, fake: Fake) -> None:
    assert await collect(backend) == expected(Scenario())

    [request] = fake.requests
    assert (request.path, request.headers["authorization"]) == (RUN_PATH, f"Bearer {TEST_API_TOKEN}")
    assert request.headers["accept-encoding"] == "identity"  # a compressor may buffer the stream whole
    assert cf_aig(request.headers) == {}
    messages = [{"role": m.role, "content": m.content} for m in REQUEST.messages]
    assert request.json == {"messages": messages, "stream": True, "max_tokens": 256}
    assert (backend.name, backend.model_name(MODEL)) == ("workers-ai", MODEL)


async def test_sends_only_the_gateway_options_that_are_set_and_none_without_a_gateway(
    make: Make, fake: Fake
) -> None:
    """(With every option, from the settings: tests/backends/test_workers_ai_endpoint.py.)"""
    every = {"gateway_token": TEST_GATEWAY_TOKEN, "gateway_skip_cache": True, "gateway_cache_ttl": 60}
    await collect(make(gateway_id="gw-test"))
    await collect(make(gateway_id="gw-test", gateway_cache_ttl=60))
    await collect(make(**every))

    sent = [(r.path, cf_aig(r.headers)) for r in fake.requests]
    assert sent == [(GATEWAY_PATH, {}), (GATEWAY_PATH, {"cf-aig-cache-ttl": "60"}), (RUN_PATH, {})]


async def test_sends_every_sampling_field_that_is_set_and_a_lora_raw(backend: Backend, fake: Fake) -> None:
    sampling: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1234}
    sampling |= {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.3}
    model, messages = "@cf/google/gemma-2b-it-lora", (Message("user", "Un café, s'il vous plaît 日本"),)
    request = GenerationRequest(model, messages, "s", "t", max_tokens=64, lora="ada-adapter", **sampling)

    await collect(backend, request)

    [recorded] = fake.requests
    assert recorded.model == model
    assert recorded.json == {
        "messages": [{"role": "user", "content": "Un café, s'il vous plaît 日本"}],
        "stream": True,
        "max_tokens": 64,
        **sampling,
        "lora": "ada-adapter",
        "raw": True,
    }


@pytest.mark.parametrize("model", ["../../../user/tokens", "@cf/meta/x?y=1", "@cf/a/../../b", "@cf/a b", ""])
async def test_refuses_a_model_id_that_could_leave_the_url_path(
    backend: Backend, fake: Fake, model: str
) -> None:
    events = await collect(backend, GenerationRequest(model, REQUEST.messages, "s", "t"))

    assert [(e.code, e.status) for e in events if isinstance(e, Error)] == [("model_not_found", 400)]
    assert len(events) == 1 and fake.requests == []


async def test_serves_concurrent_streams_and_reopens_its_client_after_aclose(
    backend: Backend, fake: Fake
) -> None:
    fake.default = Scenario(token_delay_s=0.01)

    results = await asyncio.gather(*(collect(backend) for _ in range(10)))
    await backend.aclose()
    results.append(await collect(backend))

    assert all(events == expected(Scenario()) for events in results)
    assert len(fake.requests) == 11


async def test_reuses_its_connection_after_done(make: Make) -> None:
    """After [DONE] the body is read to its end, so the pooled connection serves the next request:
    no new TCP (and, to Cloudflare, TLS) handshake before every first token."""
    upstream = KeepAliveUpstream(Scenario(tokens=["One", " line."]))
    ready = threading.Event()
    threading.Thread(target=lambda: asyncio.run(upstream.serve(ready)), daemon=True).start()
    assert ready.wait(10)
    backend = make(base_url=f"http://127.0.0.1:{upstream.port}/client/v4")

    for _ in range(3):
        assert text_of(await collect(backend)) == "One line."
    assert (upstream.requests, upstream.connections) == (3, 1)


# -- the wire format ---------------------------------------------------------------------------------


async def test_reads_a_body_cut_at_every_single_byte_offset(backend: Backend, fake: Fake) -> None:
    """Mid-line, mid-CRLF, mid-character (é, 日, 🎉 are 2 to 4 bytes): every cut reads the same."""
    length = len(render_body(Scenario(tokens=NON_ASCII, crlf=True), model=MODEL))
    fake.script(*(Scenario(tokens=NON_ASCII, crlf=True, split=[at]) for at in range(1, length)))

    for at in range(1, length):
        assert await collect(backend) == expected(Scenario(tokens=NON_ASCII)), at


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(tokens=NON_ASCII, cr_only=True, split=3, split_delay_s=0.002),
        Scenario(tokens=NON_ASCII, padding=True, comments=True, split="random", seed=4),
        Scenario(tokens=NON_ASCII, usage=(3, 2), usage_with_token=True),
        Scenario(tokens=NON_ASCII, usage=None),
        Scenario(tokens=[42, " is", "", 0]),
        Scenario(tokens=NON_ASCII, openai_style=True, split="random", seed=1),
        Scenario(tokens=["!"], long_line=1_000_000, split=65_536),
        # finish_reason on the last token (before 2026-02-17), or on none; the usage chunk is the default
        Scenario(tokens=NON_ASCII, finish_reason="token"),
        Scenario(tokens=NON_ASCII, openai_style=True, finish_reason="token"),
        Scenario(tokens=NON_ASCII, finish_reason=None),
    ],
    ids=[
        "cr-reads-apart",
        "padding-comments",
        "usage-with-token",
        "no-usage",
        "numbers",
        "openai",
        "1MB-line",
        "finish-on-token",
        "openai-finish-on-token",
        "no-finish-reason",
    ],
)
async def test_reads_each_wire_variant(backend: Backend, fake: Fake, scenario: Scenario) -> None:
    fake.script(scenario)

    assert await collect(backend) == expected(scenario)


async def test_drops_a_leading_bom_and_reads_nothing_after_done(backend: Backend, fake: Fake) -> None:
    fake.script(
        Scenario(raw_body=b"\xef\xbb\xbf" + render_body(Scenario(tokens=NON_ASCII)), split=1),
        Scenario(raw_body=b'data: {"response":"a"}\n\ndata: [DONE]\n\ndata: {"response":"b"}\n\n'),
    )

    assert await collect(backend) == expected(Scenario(tokens=NON_ASCII))
    assert await collect(backend) == [Meta(model=MODEL), Token("a"), Done()]


async def test_hands_on_a_cr_only_event_without_waiting_for_the_next_read(
    backend: Backend, fake: Fake
) -> None:
    fake.script(Scenario(tokens=["a", "b"], cr_only=True, stall_after_tokens=1, stall_s=10))
    async with aclosing(backend.stream(REQUEST)) as events:
        assert isinstance(await anext(events), Meta)
        assert await asyncio.wait_for(anext(events), 2) == Token("a")


# -- errors -------------------------------------------------------------------------------------------

ERRORS = [
    *((Scenario.error(number), *expected) for number, expected in EXPECTED_ERRORS.items()),
    (Scenario.error(3040, status=503), "upstream_capacity", 429),  # the documented code wins
    (Scenario.unauthorized(), "upstream_auth", 502),
    (Scenario.forbidden(), "upstream_auth", 502),
    (Scenario(status=401, raw_body=b""), "upstream_auth", 502),
    (Scenario(status=404, error_code=7003, error_message="No route"), "upstream_rejected", 404),
    (Scenario(status=422, raw_body=b"not json"), "upstream_rejected", 422),
    (Scenario(status=429, raw_body=b"{}"), "upstream_rejected", 429),
    (Scenario.server_error(500), "upstream_unavailable", 502),
    (Scenario.server_error(502, html=True), "upstream_unavailable", 502),
    (Scenario(raw_body=b'{"response":"hi"}', content_type="application/json"), "upstream_malformed", 502),
]


@pytest.mark.parametrize(("scenario", "code", "status"), ERRORS)
async def test_maps_each_upstream_error_to_its_code_in_our_words(
    backend: Backend, fake: Fake, caplog: pytest.LogCaptureFixture, scenario: Scenario, code: str, status: int
) -> None:
    fake.script(scenario)

    meta, error = await collect(backend)

    assert meta == Meta(model=MODEL)
    assert isinstance(error, Error) and (error.code, error.status) == (code, status)
    if scenario.error_code in ERROR_CODES:
        assert error.message == ERROR_CODES[scenario.error_code][2]
    assert error.message[:1].isupper() and "<" not in error.message and "{" not in error.message
    if scenario.error_message:  # what Workers AI said is for the operator's log
        logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "quotes.backends.workers_ai")
        assert f"Workers AI said: HTTP {scenario.status}: {scenario.error_message}" in logged


# -- the fake answers as Cloudflare does before it runs a model -------------------------------------


@pytest.mark.parametrize("model", ["@cf/meta/llama-3.1-8b-instruct", "@cf/nobody/nothing"])
async def test_a_retired_or_unknown_model_is_model_not_found_said_once_per_persona_and_model(
    backend: Backend, fake: Fake, caplog: pytest.LogCaptureFixture, model: str
) -> None:
    fake.script(Scenario())  # never used: Workers AI refuses the model before it runs anything
    request = replace(REQUEST, model=model)
    for _ in range(3):
        assert await collect(backend, request) == [Meta(model=model), error_of(5007)]
    assert fake.pending == 1
    said = [r.getMessage() for r in caplog.records if r.name == "quotes.backends.workers_ai"]
    assert len(said) == 1 and f"No such model {model} or task" in said[0] and "Ada Lovelace" in said[0]
    await collect(backend, replace(request, speaker="Mark Twain"))  # another persona: said again
    assert len([r for r in caplog.records if r.name == "quotes.backends.workers_ai"]) == 2


async def test_a_body_the_models_schema_refuses_is_5006_a_bad_request_of_ours(
    backend: Backend, fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    """Llama 3.1's published schema takes a temperature from 0 to 5."""
    assert await collect(backend, replace(REQUEST, temperature=9.0)) == [Meta(model=MODEL), error_of(5006)]
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "quotes.backends.workers_ai")
    assert "AiError: Bad input: Error:" in said and "temperature" in said
    assert fake.requests[0].scenario is not None and fake.requests[0].scenario.error_code == 5006


async def test_out_of_capacity_carries_cloudflares_retry_after(backend: Backend, fake: Fake) -> None:
    fake.script(Scenario.out_of_capacity(retry_after=7))
    assert await collect(backend) == [Meta(model=MODEL), replace(error_of(3040), retry_after=7)]


async def test_reports_a_refused_connection_and_a_connect_timeout(
    make: Make, closed_port: int, unaccepting_port: int
) -> None:
    [refused] = await collect(make(base_url=f"http://127.0.0.1:{closed_port}/client/v4"))
    [hung] = await collect(make(base_url=f"http://127.0.0.1:{unaccepting_port}/v4", connect_timeout_s=0.2))

    assert isinstance(refused, Error) and (refused.code, refused.status) == ("upstream_unreachable", 502)
    assert isinstance(hung, Error) and (hung.code, hung.status) == ("upstream_timeout", 504)


DEFAULT = expected(Scenario())[1:7]
MID_STREAM = [
    (Scenario(drop_after_tokens=3), DEFAULT[:3], "upstream_dropped"),
    (Scenario(send_done=False), [*DEFAULT, Usage(12, 6)], "upstream_dropped"),
    (Scenario(send_done=False, chunked=False), [*DEFAULT, Usage(12, 6)], "upstream_dropped"),
    (Scenario(malformed_after_tokens=2), DEFAULT[:2], "upstream_malformed"),
    (Scenario(raw_body=b'data: {"response":"a"}\n\ndata: [1, 2]\n\n'), [Token("a")], "upstream_malformed"),
    (
        Scenario(raw_body=b'data: {"response":"a"}\n\ndata: {"errors":[{"code":3040,"message":"C"}]}\n\n'),
        [Token("a")],
        "upstream_capacity",
    ),
]


@pytest.mark.parametrize(("scenario", "before", "code"), MID_STREAM)
async def test_ends_a_stream_that_fails_midway_with_its_error(
    backend: Backend, fake: Fake, scenario: Scenario, before: list[Event], code: str
) -> None:
    fake.script(scenario)

    _, *events, error = await collect(backend)

    assert events == before
    assert isinstance(error, Error) and error.code == code


# -- cancellation -------------------------------------------------------------------------------------


async def disconnected_within(fake: Fake, since: float) -> float:
    [request] = fake.requests
    assert await asyncio.to_thread(request.client_disconnected.wait, 5)
    assert request.disconnected_at is not None
    return request.disconnected_at - since


async def test_closes_the_upstream_connection_when_the_consumer_stops(backend: Backend, fake: Fake) -> None:
    fake.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    async with aclosing(backend.stream(REQUEST)) as events:
        async for event in events:
            if event == Token("tick"):
                break
        closed_at = time.monotonic()

    assert await disconnected_within(fake, closed_at) < 1.0


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(stall_before_headers_s=30),
        Scenario(stall_before_s=30),
        Scenario(stall_after_tokens=2, stall_s=30),
    ],
    ids=["before-headers", "before-the-first-token", "mid-stream"],
)
async def test_closes_the_upstream_connection_when_its_task_is_cancelled(
    backend: Backend, fake: Fake, scenario: Scenario
) -> None:
    """The policy's deadlines end a stalled stream by cancelling its task (the backend keeps none):
    wherever it waits, the cancellation passes through and the connection is closed."""
    fake.script(scenario)
    task = asyncio.create_task(collect(backend))
    await asyncio.to_thread(fake.wait_for_requests, 1)
    await asyncio.sleep(0.05)
    cancelled_at = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert await disconnected_within(fake, cancelled_at) < 1.0


async def test_scrubs_a_credential_cut_across_tokens_and_keeps_mere_look_alikes(
    backend: Backend, fake: Fake
) -> None:
    token = TEST_API_TOKEN
    fake.script(
        Scenario(tokens=["key=", token[:1], token[1:9], token[9:30], token[30:], " end"], usage=None),
        Scenario(tokens=["x", token[:10], " and more", token[:3]], usage=None, send_done=False),
    )

    cut = await collect(backend)
    alike = await collect(backend)

    assert (text_of(cut), cut[-1]) == ("key=[redacted] end", Done())
    assert text_of(alike) == "x" + token[:10] + " and more" + token[:3]  # held back, then sent whole
    assert isinstance(alike[-1], Error) and alike[-1].code == "upstream_dropped"
