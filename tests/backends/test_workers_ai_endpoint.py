"""POST /api/quotes/stream on AI_BACKEND=workers-ai, through the real ASGI app, against the fake
Workers AI upstream (a real HTTP server on 127.0.0.1): every header, every error code, every fault.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
from django.forms.models import model_to_dict

from harness.workers_ai import ERROR_CODES as FAKE_ERROR_CODES
from harness.workers_ai import EXPECTED_ERRORS, FakeWorkersAI, Scenario, render_body
from quotes.ai.backends import reset_backends
from quotes.ai.backends.workers_ai import ERROR_CODES as BACKEND_ERROR_CODES
from quotes.conf import CloudflareGatewayRetries, CloudflareGatewaySettings, OpenAICompatSettings
from quotes.models import Generation, Persona
from tests.asgi import AsgiStream, StreamedResponse, parse_sse, request, without_ids
from tests.fixtures import (
    TEST_ACCOUNT_ID,
    TEST_API_TOKEN,
    TEST_GATEWAY_TOKEN,
    gateway_config,
    upstream_configs,
)
from tests.limits import configure
from tests.llama_server import LlamaServer

pytestmark = pytest.mark.django_db(transaction=True)

STREAM_URL = "/api/quotes/stream"
MODEL = "@cf/meta/llama-3.1-8b-instruct"
MODEL_URL = "https://developers.cloudflare.com/workers-ai/models/llama-3.1-8b-instruct/"
RUN_PATH = f"/client/v4/accounts/{TEST_ACCOUNT_ID}/ai/run/{MODEL}"
GATEWAY_PATH = f"/gateway/v1/{TEST_ACCOUNT_ID}/gw-test/workers-ai/{MODEL}"

DEFAULT_TOKENS = ("Stay", " hungry", ",", " stay", " foolish", ".")
DEFAULT_TEXT = "Stay hungry, stay foolish."
NON_ASCII = ("café", " 日本", " 🎉", "ñ", " naïve", 7, " Ω≈ç√")
NON_ASCII_TEXT = "café 日本 🎉ñ naïve7 Ω≈ç√"
#: OpenAI-style chunks carry text only (`delta.content` is a string)
NON_ASCII_STR = tuple(str(token) for token in NON_ASCII)

SYSTEM_PROMPT = "You are Alan Watts"
USER_PROMPT = (
    "Write 1 inspiring quote that is less than 50 words about hard honest work as if you were Alan Watts"
)

SECRETS = (TEST_API_TOKEN, TEST_GATEWAY_TOKEN)


# -- helpers ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
async def _close_backends_on_this_loop() -> AsyncIterator[None]:
    """The backend's httpx client belongs to the test's loop: close it there."""
    yield
    await reset_backends()


async def use_gateway(settings: Any, fake: FakeWorkersAI, **options: Any) -> None:
    settings.AI_GATEWAY = gateway_config(fake, **options)
    await reset_backends()


async def use_workers_ai(settings: Any, fake: FakeWorkersAI, **overrides: Any) -> None:
    settings.WORKERS_AI, settings.AI_HTTP = upstream_configs(fake, **overrides)
    await reset_backends()


def wire(response: StreamedResponse) -> bytes:
    """The body as Workers AI would send it: ours adds only an `id: <generation id>.<key>:<n>` line to
    each event (numbers rising), which SSE clients that do not resume ignore."""
    generation_id = response.headers["x-generation-id"]
    blocks = response.body.decode().split("\n\n")[:-1]
    numbers = [int(block.split("\n", 1)[0].rpartition(":")[2]) for block in blocks]
    assert all(block.startswith(f"id: {generation_id}.") for block in blocks)
    assert numbers == sorted(set(numbers)), numbers
    return without_ids(response.body)


def full_gateway(fake: FakeWorkersAI, **overrides: Any) -> CloudflareGatewaySettings:
    options: dict[str, Any] = {
        "id": "gw-test",
        "token": TEST_GATEWAY_TOKEN,
        "skip_cache": True,
        "cache_ttl": 3600,
        "cache_key": "persona-watts-work",
        "metadata": {"persona": "watts", "version": 3, "beta": True},
        "collect_log": False,
        "request_timeout_ms": 5000,
        "retries": CloudflareGatewayRetries(max_attempts=3, retry_delay_ms=500, backoff="exponential"),
        **overrides,
    }
    return gateway_config(fake, **options)


async def post_quote(body: dict[str, Any] | None = None) -> StreamedResponse:
    return await request("POST", STREAM_URL, json_body=body or {"persona": "test-watts"})


def post_stream(body: dict[str, Any] | None = None) -> AsgiStream:
    return AsgiStream(
        "POST",
        STREAM_URL,
        body=json.dumps(body or {"persona": "test-watts"}).encode(),
        headers={"content-type": "application/json"},
    )


def token_event(text: str) -> bytes:
    return (
        b"data: "
        + json.dumps({"response": text}, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def usage_event(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return b'data: {"response":"","usage":' + json.dumps(usage, separators=(",", ":")).encode() + b"}\n\n"


def expected_wire(tokens: Sequence[str | int], usage: tuple[int, int] | None = (12, 6)) -> bytes:
    body = b"".join(token_event(str(token)) for token in tokens if str(token))
    if usage is not None:
        body += usage_event(*usage)
    return body + b"data: [DONE]\n\n"


def cf_aig(headers: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.startswith("cf-aig-")}


async def the_row() -> Generation:
    return await Generation.objects.select_related("persona").aget()


async def wait_for_row(timeout_s: float = 5.0) -> Generation:
    """The log row of a request whose handler may still be saving it (after a disconnect)."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = await Generation.objects.afirst()
        if row is not None or time.monotonic() > deadline:
            assert row is not None, "no Generation row was written"
            return row
        await asyncio.sleep(0.02)


def assert_json_error(response: StreamedResponse, status: int, code: str) -> str:
    assert response.status == status, response.body
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"code", "message"}
    assert payload["error"]["code"] == code
    message = payload["error"]["message"]
    assert isinstance(message, str) and message.strip()
    return message


async def assert_error_row(code: str, message: str | None = None, text: str = "") -> Generation:
    row = await the_row()
    assert row.status == Generation.Status.ERROR
    assert row.error_code == code
    if message is not None:
        assert row.error_message == message
    assert row.text == text
    assert row.backend == "workers-ai"
    assert row.model == MODEL
    return row


# -- the happy path ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("route", ["direct", "gateway"])
async def test_workers_ai_endpoint_streams_a_quote_end_to_end(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, route: str
) -> None:
    if route == "gateway":
        await use_gateway(workers_ai_settings, fake_workers_ai, id="gw-test")
    aig = {"cf-aig-cache-status": "MISS", "cf-aig-step": "0", "cf-aig-log-id": f"log-{route}"}
    fake_workers_ai.script(Scenario(headers=aig))

    response = await post_quote()

    assert response.status == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in response.headers
    assert response.headers["x-quote-model"] == MODEL
    assert response.headers["x-quote-model-url"] == MODEL_URL
    assert cf_aig(response.headers) == aig
    assert wire(response) == expected_wire(DEFAULT_TOKENS)

    row = await the_row()
    assert row.status == Generation.Status.OK
    assert (row.backend, row.model, row.text) == ("workers-ai", MODEL, DEFAULT_TEXT)
    assert (row.prompt_tokens, row.completion_tokens) == (12, 6)
    assert (row.error_code, row.error_message) == ("", "")
    assert row.upstream_headers == aig
    assert row.persona_id == persona.pk
    assert row.topic == "hard honest work"
    assert row.ttft_ms is not None and row.duration_ms is not None and row.ttft_ms <= row.duration_ms

    [upstream] = fake_workers_ai.requests
    assert upstream.method == "POST"
    assert upstream.path == (GATEWAY_PATH if route == "gateway" else RUN_PATH)
    assert upstream.route == ("gateway" if route == "gateway" else "run")
    assert (upstream.account, upstream.model) == (TEST_ACCOUNT_ID, MODEL)
    assert upstream.headers["authorization"] == f"Bearer {TEST_API_TOKEN}"
    assert upstream.headers["content-type"] == "application/json"
    assert cf_aig(upstream.headers) == {}
    assert upstream.json == {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT},
        ],
        "stream": True,
        "max_tokens": 16,
        "temperature": 0.0,
    }


@pytest.mark.integration
async def test_workers_ai_endpoint_sends_the_conversation_turns_and_the_topic(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=48, temperature=1.25)
    turns = [
        {"role": "assistant", "content": "Work is play, seen from far enough away."},
        {"role": "user", "content": "Shorter, and about tea."},
    ]

    response = await post_quote({"persona": persona.slug, "topic": "  the   sea ", "messages": turns})

    assert response.status == 200
    assert parse_sse(response.body)[-1]["data"] == "[DONE]"
    [upstream] = fake_workers_ai.requests
    assert upstream.json == {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT.replace("hard honest work", "the sea")},
            *turns,
        ],
        "stream": True,
        "max_tokens": 48,
        "temperature": 1.25,
    }
    row = await the_row()
    assert row.topic == "the sea"
    assert row.request["messages"][2:] == turns


@pytest.mark.integration
async def test_workers_ai_endpoint_get_for_eventsource_streams_the_same_quote(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    response = await request(
        "GET", STREAM_URL, query="persona=test-watts&topic=silence", headers={"sec-fetch-dest": "empty"}
    )

    assert response.status == 200
    assert wire(response) == expected_wire(DEFAULT_TOKENS)
    assert (
        fake_workers_ai.requests[0]
        .json["messages"][1]["content"]
        .endswith("about silence as if you were Alan Watts")
    )


# -- the gateway's request headers ----------------------------------------------------------------------

GATEWAY_OPTIONS = [
    pytest.param({"skip_cache": True}, {"cf-aig-skip-cache": "true"}, id="skip_cache"),
    pytest.param({"cache_ttl": 3600}, {"cf-aig-cache-ttl": "3600"}, id="cache_ttl"),
    pytest.param({"cache_key": "watts-work"}, {"cf-aig-cache-key": "watts-work"}, id="cache_key"),
    pytest.param(
        {"metadata": {"persona": "watts", "version": 3, "beta": True}},
        {"cf-aig-metadata": '{"persona":"watts","version":3,"beta":true}'},
        id="metadata",
    ),
    pytest.param({"collect_log": False}, {"cf-aig-collect-log": "false"}, id="collect_log-false"),
    pytest.param({"collect_log": True}, {"cf-aig-collect-log": "true"}, id="collect_log-true"),
    pytest.param({"request_timeout_ms": 5000}, {"cf-aig-request-timeout": "5000"}, id="request_timeout_ms"),
    pytest.param(
        {"retries": CloudflareGatewayRetries(max_attempts=3)},
        {"cf-aig-max-attempts": "3"},
        id="retries-max_attempts",
    ),
    pytest.param(
        {"retries": CloudflareGatewayRetries(retry_delay_ms=500)},
        {"cf-aig-retry-delay": "500"},
        id="retries-retry_delay_ms",
    ),
    pytest.param(
        {"retries": CloudflareGatewayRetries(backoff="exponential")},
        {"cf-aig-backoff": "exponential"},
        id="retries-backoff",
    ),
    pytest.param(
        {"token": TEST_GATEWAY_TOKEN}, {"cf-aig-authorization": f"Bearer {TEST_GATEWAY_TOKEN}"}, id="token"
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("options", "expected"), GATEWAY_OPTIONS)
async def test_workers_ai_endpoint_sends_each_gateway_option_as_its_header(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    options: dict[str, Any],
    expected: dict[str, str],
) -> None:
    await use_gateway(workers_ai_settings, fake_workers_ai, id="gw-test", **options)

    response = await post_quote()

    assert response.status == 200
    [upstream] = fake_workers_ai.requests
    assert upstream.path == GATEWAY_PATH
    assert cf_aig(upstream.headers) == expected
    assert upstream.headers["authorization"] == f"Bearer {TEST_API_TOKEN}"


@pytest.mark.integration
async def test_workers_ai_endpoint_sends_every_gateway_header_at_once(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    workers_ai_settings.AI_GATEWAY = full_gateway(fake_workers_ai)
    await reset_backends()

    response = await post_quote()

    assert response.status == 200
    [upstream] = fake_workers_ai.requests
    assert upstream.path == GATEWAY_PATH
    assert cf_aig(upstream.headers) == {
        "cf-aig-skip-cache": "true",
        "cf-aig-cache-ttl": "3600",
        "cf-aig-cache-key": "persona-watts-work",
        "cf-aig-metadata": '{"persona":"watts","version":3,"beta":true}',
        "cf-aig-collect-log": "false",
        "cf-aig-request-timeout": "5000",
        "cf-aig-max-attempts": "3",
        "cf-aig-retry-delay": "500",
        "cf-aig-backoff": "exponential",
        "cf-aig-authorization": f"Bearer {TEST_GATEWAY_TOKEN}",
    }
    assert upstream.headers["authorization"] == f"Bearer {TEST_API_TOKEN}"


@pytest.mark.integration
async def test_workers_ai_endpoint_sends_no_gateway_header_without_a_gateway(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    # Every option set, but no gateway id: Workers AI is called directly, with none of them.
    workers_ai_settings.AI_GATEWAY = full_gateway(fake_workers_ai, id="")
    await reset_backends()

    response = await post_quote()

    assert response.status == 200
    [upstream] = fake_workers_ai.requests
    assert upstream.path == RUN_PATH
    assert cf_aig(upstream.headers) == {}
    assert TEST_GATEWAY_TOKEN not in json.dumps(upstream.headers)


# -- the gateway's response headers ----------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "aig",
    [
        {"cf-aig-cache-status": "HIT", "cf-aig-step": "0", "cf-aig-log-id": "01J0LOGHIT"},
        {"cf-aig-cache-status": "MISS", "cf-aig-step": "1", "cf-aig-log-id": "01J0LOGFALLBACK"},
        {"cf-aig-log-id": "01J0ONLYLOG"},
    ],
    ids=["hit", "miss-fallback", "log-id-only"],
)
async def test_workers_ai_endpoint_passes_gateway_response_headers_on(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, aig: dict[str, str]
) -> None:
    await use_gateway(workers_ai_settings, fake_workers_ai, id="gw-test")
    # Other upstream headers (cf-ray, x-*) are not ours to pass on.
    fake_workers_ai.script(Scenario(headers={**aig, "x-upstream-internal": "nope"}))

    response = await post_quote()

    assert response.status == 200
    # The client sees the upstream's headers with the app's own fallback step (the primary
    # model answered: 0) and cache status (a miss of ours, unless Cloudflare's cache hit).
    expected = {**aig, "cf-aig-step": "0"}
    if aig.get("cf-aig-cache-status") != "HIT":
        expected["cf-aig-cache-status"] = "MISS"
    assert cf_aig(response.headers) == expected
    assert "x-upstream-internal" not in response.headers
    assert "cf-ray" not in response.headers
    row = await the_row()
    assert row.upstream_headers == aig  # the log keeps the upstream's own, untouched
    assert (row.fallback_step, row.cache_status) == (0, "miss")


# -- wire variants --------------------------------------------------------------------------------------


def _mid_character_cuts() -> list[int]:
    """Offsets inside the multi-byte characters of the NON_ASCII body (é, 日, 🎉)."""
    body = render_body(Scenario(tokens=NON_ASCII), model=MODEL)
    return [
        body.index("é".encode()) + 1,
        body.index("日".encode()) + 1,
        body.index("日".encode()) + 2,
        body.index("🎉".encode()) + 3,
    ]


WIRE_VARIANTS = [
    pytest.param(Scenario(tokens=NON_ASCII, split=1), id="one-byte-reads"),
    pytest.param(Scenario(tokens=NON_ASCII, split=_mid_character_cuts()), id="mid-utf8-cuts"),
    pytest.param(Scenario(tokens=NON_ASCII, split=3, split_delay_s=0.002), id="3-byte-reads-apart"),
    *(
        pytest.param(Scenario(tokens=NON_ASCII, split="random", seed=seed), id=f"random-split-{seed}")
        for seed in range(4)
    ),
    pytest.param(Scenario(tokens=NON_ASCII, crlf=True), id="crlf"),
    pytest.param(Scenario(tokens=NON_ASCII, cr_only=True), id="cr"),
    pytest.param(Scenario(tokens=NON_ASCII, padding=True, seed=1), id="p-padding"),
    pytest.param(Scenario(tokens=NON_ASCII, comments=True), id="comments"),
    pytest.param(
        Scenario(tokens=NON_ASCII, crlf=True, padding=True, comments=True, split="random", seed=9),
        id="crlf-padding-comments-random-split",
    ),
    pytest.param(
        Scenario(tokens=NON_ASCII, cr_only=True, padding=True, comments=True, split="random", seed=5),
        id="cr-padding-comments-random-split",
    ),
    pytest.param(Scenario(tokens=NON_ASCII, usage_with_token=True), id="usage-on-the-last-token"),
    pytest.param(Scenario(tokens=(42, " is", " the", " answer")), id="numeric-response"),
    pytest.param(Scenario(tokens=NON_ASCII_STR, openai_style=True), id="openai-style-chunks"),
    pytest.param(
        Scenario(tokens=NON_ASCII_STR, openai_style=True, split="random", seed=2, crlf=True),
        id="openai-style-random-split",
    ),
    pytest.param(Scenario(tokens=("Ok", "", " then")), id="empty-token-skipped"),
    pytest.param(Scenario(tokens=("L" * 70_000, " end")), id="70k-line"),
]


@pytest.mark.integration
@pytest.mark.parametrize("scenario", WIRE_VARIANTS)
async def test_workers_ai_endpoint_reads_every_wire_variant(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, scenario: Scenario
) -> None:
    fake_workers_ai.script(scenario)

    response = await post_quote()

    assert response.status == 200
    assert wire(response) == expected_wire(scenario.tokens, (12, 6))
    row = await the_row()
    assert row.status == Generation.Status.OK
    assert row.text == "".join(str(token) for token in scenario.tokens)
    assert (row.prompt_tokens, row.completion_tokens) == (12, 6)


@pytest.mark.integration
@pytest.mark.parametrize("openai_style", [False, True], ids=["workers-ai", "openai-style"])
async def test_workers_ai_endpoint_streams_without_usage_when_upstream_sends_none(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, openai_style: bool
) -> None:
    fake_workers_ai.script(Scenario(tokens=NON_ASCII_STR, usage=None, openai_style=openai_style))

    response = await post_quote()

    assert response.status == 200
    assert wire(response) == expected_wire(NON_ASCII, usage=None)
    assert not any("usage" in event["data"] for event in parse_sse(response.body))
    row = await the_row()
    assert row.status == Generation.Status.OK
    assert row.text == NON_ASCII_TEXT
    assert row.prompt_tokens is None
    assert row.completion_tokens is None


@pytest.mark.integration
async def test_workers_ai_endpoint_first_token_leaves_before_the_upstream_finishes(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = ("One", " two", " three", " four")
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.15))
    stream = post_stream()
    await stream.start()

    first, more = await stream.next_chunk()

    assert without_ids(first) == token_event("One")
    assert more
    [upstream] = fake_workers_ai.requests
    assert not upstream.finished.is_set()  # the upstream is still writing
    response = await stream.read_all()
    assert wire(response) == expected_wire(tokens)
    assert response.chunk_times[-1] - response.chunk_times[0] > 0.3


# -- errors before the first token ---------------------------------------------------------------------


@pytest.mark.integration
def test_workers_ai_endpoint_error_table_covers_every_documented_code() -> None:
    assert set(EXPECTED_ERRORS) == set(BACKEND_ERROR_CODES) == set(FAKE_ERROR_CODES)


@pytest.mark.integration
@pytest.mark.parametrize("route", ["direct", "gateway"])
@pytest.mark.parametrize(("upstream_code", "expected"), EXPECTED_ERRORS.items(), ids=str)
async def test_workers_ai_endpoint_maps_each_documented_error_code(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    upstream_code: int,
    expected: tuple[str, int],
    route: str,
) -> None:
    if route == "gateway":
        await use_gateway(workers_ai_settings, fake_workers_ai, id="gw-test")
    code, status = expected
    _, upstream_message = FAKE_ERROR_CODES[upstream_code]
    fake_workers_ai.script(Scenario.error(upstream_code, headers={"cf-aig-log-id": "log-err"}))

    response = await post_quote()

    message = assert_json_error(response, status, code)
    # Our words only (issue 20): what Workers AI said is for the operator's log.
    assert message == BACKEND_ERROR_CODES[upstream_code][2]
    assert f"said: {upstream_message}" not in message
    assert "content-encoding" not in response.headers
    row = await assert_error_row(code, message)
    assert row.upstream_headers == {"cf-aig-log-id": "log-err"}
    assert (row.prompt_tokens, row.completion_tokens) == (None, None)


@pytest.mark.integration
async def test_workers_ai_endpoint_error_before_the_stream_keeps_the_gateway_headers(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    """The gateway's log id is what an operator needs to look a failed request up, and the
    visitor's client is told which model failed, as on a successful answer."""
    await use_gateway(workers_ai_settings, fake_workers_ai, id="gw-test")
    aig = {"cf-aig-cache-status": "MISS", "cf-aig-step": "0", "cf-aig-log-id": "01J0LOG3040"}
    fake_workers_ai.script(Scenario.error(3040, headers=aig))

    response = await post_quote()

    assert_json_error(response, 429, "upstream_capacity")
    assert (await the_row()).upstream_headers == aig
    assert cf_aig(response.headers) == aig
    assert response.headers["x-quote-model"] == MODEL


GENERIC_ERRORS = [
    pytest.param(Scenario.unauthorized(), 502, "upstream_auth", id="401-auth"),
    pytest.param(Scenario.forbidden(), 502, "upstream_auth", id="403-auth"),
    pytest.param(Scenario(status=401), 502, "upstream_auth", id="401-no-envelope"),
    pytest.param(Scenario.server_error(500), 502, "upstream_unavailable", id="500"),
    pytest.param(Scenario.server_error(502, html=True), 502, "upstream_unavailable", id="502-html"),
    pytest.param(Scenario.server_error(503), 502, "upstream_unavailable", id="503"),
    pytest.param(Scenario(status=429), 429, "upstream_rejected", id="429-gateway-rate-limit"),
    pytest.param(
        Scenario(status=422, error_code=9999, error_message="nope"),
        422,
        "upstream_rejected",
        id="422-unknown",
    ),
    pytest.param(Scenario(raw_body=b"data: {not json\n\n"), 502, "upstream_malformed", id="malformed-json"),
    pytest.param(Scenario(raw_body=b"data: [1, 2]\n\n"), 502, "upstream_malformed", id="json-not-an-object"),
    pytest.param(
        Scenario(raw_body=b'{"result":{"response":"hi"},"success":true}', content_type="application/json"),
        502,
        "upstream_malformed",
        id="json-not-sse",
    ),
    pytest.param(
        Scenario(raw_body=b"<html>hello</html>", content_type="text/html"),
        502,
        "upstream_malformed",
        id="html-not-sse",
    ),
    pytest.param(
        Scenario(tokens=(), usage=None, send_done=False), 502, "upstream_dropped", id="empty-stream"
    ),
    pytest.param(
        Scenario(tokens=("a",), drop_after_tokens=0, raw_body=b""), 502, "upstream_dropped", id="no-body"
    ),
    pytest.param(
        Scenario(
            raw_body=b'data: {"success":false,"errors":[{"code":3040,"message":"Capacity exceeded"}],"result":null}\n\n'
        ),
        429,
        "upstream_capacity",
        id="error-envelope-as-first-event",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("scenario", "status", "code"), GENERIC_ERRORS)
async def test_workers_ai_endpoint_maps_other_upstream_failures(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    scenario: Scenario,
    status: int,
    code: str,
) -> None:
    fake_workers_ai.script(scenario)

    response = await post_quote()

    message = assert_json_error(response, status, code)
    await assert_error_row(code, message)


@pytest.mark.integration
async def test_workers_ai_endpoint_wrong_token_is_an_auth_error_not_the_visitors_fault(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.expected_token = "cfut_the-right-one"

    response = await post_quote()

    message = assert_json_error(response, 502, "upstream_auth")
    assert "not your fault" in message
    await assert_error_row("upstream_auth", message)


@pytest.mark.integration
async def test_workers_ai_endpoint_refused_connection_is_unreachable(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, closed_port: int
) -> None:
    await use_workers_ai(
        workers_ai_settings, fake_workers_ai, base_url=f"http://127.0.0.1:{closed_port}/client/v4"
    )

    response = await post_quote()

    message = assert_json_error(response, 502, "upstream_unreachable")
    row = await assert_error_row("upstream_unreachable", message)
    assert row.upstream_headers == {}
    assert fake_workers_ai.requests == []


@pytest.mark.integration
async def test_workers_ai_endpoint_connect_timeout_is_504(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, unaccepting_port: int
) -> None:
    await use_workers_ai(
        workers_ai_settings,
        fake_workers_ai,
        base_url=f"http://127.0.0.1:{unaccepting_port}/client/v4",
        connect_timeout_s=0.2,
    )
    started = time.monotonic()

    response = await post_quote()

    message = assert_json_error(response, 504, "upstream_timeout")
    await assert_error_row("upstream_timeout", message)
    assert time.monotonic() - started < 5


@pytest.mark.integration
@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(Scenario(stall_before_headers_s=10), id="no-headers"),
        pytest.param(Scenario(stall_before_s=10), id="headers-then-silence"),
    ],
)
async def test_workers_ai_endpoint_stall_before_the_first_token_is_504(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, scenario: Scenario
) -> None:
    """The backend keeps no deadline: the policy's first-token one covers the headers too."""
    configure(workers_ai_settings, ttft_timeout_s=0.3)
    fake_workers_ai.script(scenario)
    started = time.monotonic()

    response = await post_quote()

    message = assert_json_error(response, 504, "upstream_timeout")
    await assert_error_row("upstream_timeout", message)
    assert time.monotonic() - started < 1.5  # the 0.3 s first-token timeout, not the fixture's 4 s


@pytest.mark.integration
@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(Scenario(stall_before_s=10), id="silence"),
        # Every read succeeds (comments only, the tokens are empty) and no event is ever produced.
        pytest.param(Scenario(tokens=[""] * 200, comments=True, token_delay_s=0.02), id="keep-alives"),
    ],
)
async def test_workers_ai_endpoint_total_deadline_before_the_first_token_is_504(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, scenario: Scenario
) -> None:
    # The first token may take 5 s, but the whole generation only 0.5 s: the deadline fires first.
    configure(workers_ai_settings, ttft_timeout_s=5, total_timeout_s=0.5)
    fake_workers_ai.script(scenario)
    started = time.monotonic()

    response = await post_quote()

    message = assert_json_error(response, 504, "deadline_exceeded")
    await assert_error_row("deadline_exceeded", message)
    assert time.monotonic() - started < 3


# -- faults after the first token ---------------------------------------------------------------------

MID_STREAM_FAULTS = [
    pytest.param(Scenario(drop_after_tokens=2), {}, "upstream_dropped", id="drop"),
    pytest.param(
        Scenario(stall_after_tokens=2, stall_s=10), {"idle_timeout_s": 0.3}, "idle_timeout", id="stall"
    ),
    pytest.param(
        Scenario(tokens=DEFAULT_TOKENS * 50, token_delay_s=0.05),
        {"idle_timeout_s": 5, "total_timeout_s": 0.5},
        "deadline_exceeded",
        id="total-deadline",
    ),
    pytest.param(Scenario(malformed_after_tokens=2), {}, "upstream_malformed", id="malformed-event"),
    pytest.param(
        Scenario(tokens=DEFAULT_TOKENS[:2], usage=None, send_done=False), {}, "upstream_dropped", id="no-done"
    ),
    pytest.param(
        Scenario(
            raw_body=(
                b'data: {"response":"Stay"}\n\ndata: {"response":" hungry"}\n\n'
                b'data: {"success":false,"errors":[{"code":3040,"message":"Capacity exceeded"}],"result":null}\n\n'
            )
        ),
        {},
        "upstream_capacity",
        id="error-envelope",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("scenario", "timeouts", "code"), MID_STREAM_FAULTS)
async def test_workers_ai_endpoint_fault_after_the_first_token_ends_with_an_error_event(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    scenario: Scenario,
    timeouts: dict[str, float],
    code: str,
) -> None:
    configure(workers_ai_settings, **timeouts)
    fake_workers_ai.script(scenario)

    response = await post_quote()

    assert response.status == 200  # sent with the first token, before the fault
    assert response.headers["content-type"] == "text/event-stream"
    events = parse_sse(response.body)
    *tokens, error = events
    assert len(tokens) >= 2
    assert [json.loads(t["data"]) for t in tokens[:2]] == [{"response": "Stay"}, {"response": " hungry"}]
    assert all(t["event"] == "message" for t in tokens)
    assert error["event"] == "error"
    payload = json.loads(error["data"])
    assert set(payload) == {"error"}
    assert payload["error"]["code"] == code
    assert payload["error"]["message"]
    assert b"[DONE]" not in response.body
    text = "".join(json.loads(t["data"])["response"] for t in tokens)
    await assert_error_row(code, payload["error"]["message"], text=text)


# -- the visitor goes away --------------------------------------------------------------------------


@pytest.mark.integration
async def test_workers_ai_endpoint_client_disconnect_closes_the_upstream_and_logs_cancelled(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(Scenario(tokens=["tick"] * 500, token_delay_s=0.02))
    stream = post_stream()
    await stream.start()
    first, more = await stream.next_chunk()
    second, _ = await stream.next_chunk()
    assert (without_ids(first), without_ids(second)) == (token_event("tick"), token_event("tick"))
    assert more

    disconnected_at = time.monotonic()
    await stream.disconnect()

    [upstream] = fake_workers_ai.requests
    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)
    assert upstream.disconnected_at is not None
    assert upstream.disconnected_at - disconnected_at < 1.0
    row = await wait_for_row()
    assert row.status == Generation.Status.CANCELLED
    assert row.text.startswith("ticktick")
    assert row.text == "tick" * (len(row.text) // 4)
    assert len(row.text) < 4 * 500
    assert row.error_code == "abandoned"  # dropped, nobody resumed (no grace in the tests)
    assert row.duration_ms is not None


@pytest.mark.integration
async def test_workers_ai_endpoint_client_disconnect_before_the_first_token_closes_the_upstream(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    # The view waits for the first token before it answers: a visitor who leaves during that
    # wait must stop the upstream request too.
    fake_workers_ai.script(Scenario(stall_before_s=30))
    stream = post_stream()
    await stream.communicator.send_input({"type": "http.request", "body": stream.body, "more_body": False})
    [upstream] = await asyncio.to_thread(fake_workers_ai.wait_for_requests, 1)
    await asyncio.sleep(0.1)

    disconnected_at = time.monotonic()
    await stream.disconnect()

    assert await asyncio.to_thread(upstream.client_disconnected.wait, 5)
    assert upstream.disconnected_at is not None
    assert upstream.disconnected_at - disconnected_at < 1.0
    row = await wait_for_row()
    assert row.status == Generation.Status.CANCELLED
    assert row.text == ""


@pytest.mark.integration
async def test_workers_ai_endpoint_finishing_normally_is_not_a_disconnect(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI
) -> None:
    await post_quote()

    [upstream] = fake_workers_ai.requests
    assert await asyncio.to_thread(upstream.finished.wait, 5)
    assert not upstream.client_disconnected.is_set()


# -- secrets -------------------------------------------------------------------------------------


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, where
        assert secret[:16] not in text, where
        assert secret[-16:] not in text, where


async def assert_nothing_leaked(response: StreamedResponse, caplog: pytest.LogCaptureFixture) -> None:
    assert_no_secret(response.body.decode(), "response body")
    assert_no_secret(json.dumps(response.headers), "response headers")
    async for row in Generation.objects.all():
        assert_no_secret(json.dumps(model_to_dict(row), default=str), "Generation row")
    assert_no_secret(caplog.text, "log")
    for record in caplog.records:
        assert_no_secret(record.getMessage(), "log record")


SECRET_SCENARIOS = [
    pytest.param(Scenario.unauthorized(message=f"Invalid API token {TEST_API_TOKEN}"), id="token-in-401"),
    pytest.param(
        Scenario.error(3040, f"capacity for {TEST_API_TOKEN} / Bearer {TEST_GATEWAY_TOKEN}"),
        id="tokens-in-3040",
    ),
    pytest.param(
        Scenario(status=400, error_code=9999, error_message=f"bad header: Bearer {TEST_GATEWAY_TOKEN}"),
        id="gateway-token-in-400",
    ),
    pytest.param(Scenario(status=500, raw_body=f"<html>{TEST_API_TOKEN}</html>".encode()), id="token-in-500"),
    pytest.param(
        Scenario(headers={"cf-aig-log-id": TEST_API_TOKEN, "cf-aig-step": f"Bearer {TEST_GATEWAY_TOKEN}"}),
        id="tokens-in-response-headers",
    ),
    pytest.param(
        Scenario(
            raw_body=(
                b'data: {"response":"Stay"}\n\ndata: {"success":false,"errors":[{"code":3040,"message":"for '
                + TEST_API_TOKEN.encode()
                + b'"}]}\n\n'
            )
        ),
        id="token-in-mid-stream-envelope",
    ),
    pytest.param(
        Scenario(tokens=("key=", TEST_API_TOKEN[:7], TEST_API_TOKEN[7:30], TEST_API_TOKEN[30:], " ok")),
        id="token-cut-across-tokens",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize("scenario", SECRET_SCENARIOS)
async def test_workers_ai_endpoint_never_leaks_a_token(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
    scenario: Scenario,
) -> None:
    caplog.set_level(logging.DEBUG, logger="quotes")
    workers_ai_settings.AI_GATEWAY = full_gateway(fake_workers_ai)
    await reset_backends()
    fake_workers_ai.script(scenario)

    response = await post_quote()

    assert fake_workers_ai.requests[0].headers["authorization"] == f"Bearer {TEST_API_TOKEN}"
    await assert_nothing_leaked(response, caplog)


@pytest.mark.integration
@pytest.mark.parametrize("route", ["direct", "gateway"])
async def test_workers_ai_endpoint_scrubs_tokens_an_upstream_echoes_back(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
    route: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="quotes")
    if route == "gateway":
        workers_ai_settings.AI_GATEWAY = full_gateway(fake_workers_ai)
        await reset_backends()
    fake_workers_ai.script(Scenario(echo_headers=True, split="random", seed=11))

    response = await post_quote()

    assert response.status == 200
    events = parse_sse(response.body)
    assert events[-1]["data"] == "[DONE]"
    text = "".join(json.loads(e["data"])["response"] for e in events[:-1])
    assert "authorization: Bearer [redacted]\n" in text
    if route == "gateway":
        assert "cf-aig-authorization: Bearer [redacted]\n" in text
        assert "cf-aig-cache-key: persona-watts-work\n" in text
    await assert_nothing_leaked(response, caplog)
    row = await the_row()
    assert row.status == Generation.Status.OK
    assert row.text == text


# -- the OpenAI-compatible backend through the same endpoint ----------------------------------------


@pytest.mark.system
async def test_openai_backend_endpoint_streams_a_quote_from_llama_cpp(
    persona: Persona, settings: Any, llama_server: LlamaServer
) -> None:
    settings.AI_BACKEND = "openai"
    settings.OPENAI_COMPAT = OpenAICompatSettings(
        base_url=llama_server.base_url, api_key=llama_server.api_key
    )
    settings.AI_HTTP = replace(settings.AI_HTTP, connect_timeout_s=2.0)
    await reset_backends()

    response = await post_quote()

    assert response.status == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-quote-model"]
    events = parse_sse(response.body)
    assert events[-1] == {"event": "message", "data": "[DONE]"}
    payloads = [json.loads(e["data"]) for e in events[:-1]]
    assert all(e["event"] == "message" for e in events)
    tokens = [p for p in payloads if "usage" not in p]
    assert tokens, "at least one token"
    for payload in tokens:
        assert set(payload) == {"response"} and isinstance(payload["response"], str)
    for payload in payloads[len(tokens) :]:  # usage, if the server sends it, comes last
        assert payload["response"] == ""
    text = "".join(p["response"] for p in tokens)
    assert text.strip()
    row = await the_row()
    assert row.backend == "openai"
    assert row.status == Generation.Status.OK
    assert row.text == text


@pytest.mark.integration
async def test_workers_ai_endpoint_reuses_the_upstream_connection(
    persona: Persona, workers_ai_settings: Any
) -> None:
    """After [DONE] the body is read to its end, so the pooled connection serves the next
    request: no new TCP (and, to Cloudflare, TLS) handshake before every first token."""
    import asyncio as _asyncio
    import threading

    from harness.workers_ai import KeepAliveUpstream

    upstream = KeepAliveUpstream(Scenario(tokens=["One", " line."]))
    ready = threading.Event()
    threading.Thread(target=lambda: _asyncio.run(upstream.serve(ready)), daemon=True).start()
    assert ready.wait(10)
    workers_ai_settings.WORKERS_AI = replace(
        workers_ai_settings.WORKERS_AI, base_url=f"http://127.0.0.1:{upstream.port}/client/v4"
    )
    workers_ai_settings.QUOTES_GATEWAY = replace(workers_ai_settings.QUOTES_GATEWAY, cache_ttl=0)
    await reset_backends()

    for _ in range(3):
        response = await request("POST", "/api/quotes/stream", json_body={"persona": persona.slug})
        assert response.body.endswith(b"data: [DONE]\n\n")

    assert (upstream.requests, upstream.connections) == (3, 1)
    await reset_backends()
