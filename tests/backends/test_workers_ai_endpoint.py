"""The stream API on the cloud backends, through the real ASGI app, against the fake Workers AI
(harness/workers_ai.py, a real HTTP server on 127.0.0.1): workers-ai through AI Gateway set up by
the settings, and openai on the fake's OpenAI-compatible route.

What a visitor gets: Workers AI's own wire format, the gateway's headers, a fixed message per kind
of failure with its stable code. What the operator gets: what the upstream said, redacted. Neither
ever gets our credentials. The error bodies hold what real upstreams have sent back: a database
password and an internal address in a 500, an organisation id and a billing state in a 429, an
internal URL in a 502's HTML page.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from django.forms.models import model_to_dict

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.backends import reset_backends
from quotes.backends.workers_ai import ERROR_CODES
from quotes.models import Generation, Persona
from tests.asgi import StreamedResponse, parse_sse, post_quote, request, without_ids
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN, TEST_GATEWAY_TOKEN, saved

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
LOGGERS = {"workers-ai": "quotes.backends.workers_ai", "openai": "quotes.backends.openai_compat"}


@pytest.fixture(autouse=True)
def _logging_configured() -> None:
    """Django's set-up (on the app's first import) configures logging, which drops caplog's handler
    from the root logger: have it happen before caplog attaches."""
    import config.asgi  # noqa: F401


async def on(settings: Any, fake: FakeWorkersAI, backend: str) -> None:
    """`backend` against the fake with our secret-looking credentials: workers-ai through AI
    Gateway (every option set), openai on Workers AI's OpenAI-compatible route."""
    settings.AI_BACKEND = backend
    settings.AI_GATEWAY_ID, settings.AI_GATEWAY_TOKEN = "gw-test", TEST_GATEWAY_TOKEN
    settings.AI_GATEWAY_SKIP_CACHE, settings.AI_GATEWAY_CACHE_TTL = True, 600
    settings.OPENAI_BASE_URL = fake.openai_base_url(TEST_ACCOUNT_ID)
    settings.OPENAI_API_KEY = TEST_API_TOKEN
    await reset_backends()


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona, workers_ai_settings: Any) -> FakeWorkersAI:
    await on(workers_ai_settings, fake, "workers-ai")
    await saved(persona, model=MODEL)
    return fake


@pytest.fixture(params=["workers-ai", "openai"])
async def backend(request: pytest.FixtureRequest, fake: FakeWorkersAI, workers_ai_settings: Any) -> str:
    await on(workers_ai_settings, fake, request.param)
    return str(request.param)


def cf_aig(headers: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.startswith("cf-aig-")}


def json_error(response: StreamedResponse, status: int, code: str) -> str:
    assert (response.status, response.headers["content-type"]) == (status, "application/json"), response.body
    error = response.json()["error"]
    assert set(error) == {"code", "message"} and error["code"] == code and error["message"].strip()
    return str(error["message"])


def visitor_error(response: StreamedResponse) -> dict[str, Any]:
    """The error a visitor's client reads: the JSON envelope, or the stream's `error` event."""
    if response.headers.get("content-type") == "application/json":
        return dict(response.json()["error"])
    [event] = [e for e in parse_sse(response.body) if e["event"] == "error"]
    return dict(json.loads(event["data"])["error"])


def logged(caplog: pytest.LogCaptureFixture, backend: str) -> str:
    lines = [
        r.getMessage() for r in caplog.records if r.name == LOGGERS[backend] and r.levelno >= logging.WARNING
    ]
    assert lines, caplog.text
    return "\n".join(lines)


# -- a quote -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "aig",
    [
        {"cf-aig-cache-status": "MISS", "cf-aig-step": "1", "cf-aig-log-id": "01JLOG"},
        {"cf-aig-cache-status": "HIT"},
    ],
    ids=["miss", "gateway-cache-hit"],
)
async def test_a_quote_reaches_the_visitor_in_workers_ai_format_through_the_gateway(
    fake: FakeWorkersAI, aig: dict[str, str]
) -> None:
    tokens = ("café", " 日本", " 🎉", "ñ", " naïve", "7", " Ω≈ç√")
    # CRLF, padding, comments, reads cut mid-character: the visitor gets Workers AI's plain format.
    headers = {**aig, "x-internal": "no"}
    fake.script(
        Scenario(
            tokens=tokens, crlf=True, padding=True, comments=True, split="random", seed=9, headers=headers
        )
    )

    response = await post_quote({"persona": "test-watts", "topic": "engines"})

    assert (response.status, response.headers["content-type"]) == (200, "text/event-stream")
    assert (response.headers["cache-control"], response.headers["x-accel-buffering"]) == ("no-cache", "no")
    assert "content-encoding" not in response.headers and "x-internal" not in response.headers
    assert response.headers["x-quote-model"] == MODEL
    assert (
        response.headers["x-quote-model-url"]
        == "https://developers.cloudflare.com/workers-ai/models/llama-3.1-8b-instruct-fp8/"
    )
    # The upstream's headers with the app's own fallback step (the primary model: 0) and cache
    # status (skip-cache bypasses our answer cache too), unless Cloudflare's cache hit.
    ours = "HIT" if aig["cf-aig-cache-status"] == "HIT" else "BYPASS"
    assert cf_aig(response.headers) == {**aig, "cf-aig-step": "0", "cf-aig-cache-status": ours}
    usage = {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}
    events = [*({"response": token} for token in tokens), {"response": "", "usage": usage}]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False, separators=(',', ':'))}\n\n" for e in events)
    assert without_ids(response.body).decode() == body + "data: [DONE]\n\n"

    row = await Generation.objects.aget()
    assert (row.status, row.backend, row.model, row.text) == ("ok", "workers-ai", MODEL, "".join(tokens))
    assert (row.prompt_tokens, row.completion_tokens, row.upstream_headers) == (12, 6, aig)
    [upstream] = fake.requests
    assert upstream.path == f"/gateway/v1/{TEST_ACCOUNT_ID}/gw-test/workers-ai/{MODEL}"
    assert upstream.headers["authorization"] == f"Bearer {TEST_API_TOKEN}"
    gateway = {"cf-aig-skip-cache": "true", "cf-aig-cache-ttl": "600"}
    assert cf_aig(upstream.headers) == {"cf-aig-authorization": f"Bearer {TEST_GATEWAY_TOKEN}", **gateway}
    prompt = "Write 1 inspiring quote that is less than 50 words about engines as if you were Alan Watts"
    messages = [{"role": "system", "content": "You are Alan Watts"}, {"role": "user", "content": prompt}]
    assert upstream.json == {"messages": messages, "stream": True, "max_tokens": 16, "temperature": 0.0}


async def test_a_documented_error_has_its_status_our_words_and_the_gateway_headers(
    fake: FakeWorkersAI,
) -> None:
    """The gateway's log id is what an operator needs to look a failed request up; the visitor is
    told which model failed, and why, in our words."""
    aig = {"cf-aig-log-id": "01JLOG3040", "cf-aig-request-id": "req-1"}
    fake.script(Scenario.error(3040, headers=aig))

    response = await post_quote()

    assert json_error(response, 429, "upstream_capacity") == ERROR_CODES[3040][2]
    assert cf_aig(response.headers) == {**aig, "cf-aig-step": "0", "cf-aig-cache-status": "BYPASS"}
    assert response.headers["x-quote-model"] == MODEL
    row = await Generation.objects.aget()
    assert (row.error_code, row.upstream_headers) == ("upstream_capacity", aig)
    assert row.error_message == ERROR_CODES[3040][2]


# -- what the upstream said ------------------------------------------------------------------------

#: status, what the upstream said, what of it the log keeps, what no log has, what no visitor has
#: either, and the visitor's code
LEAKY = {
    "500-database": (
        500,
        "pool to 10.9.8.7:5432 failed, DATABASE_PASSWORD=hunter2",
        "pool to",
        ("10.9.8.7", "5432", "hunter2"),
        ("pool to",),
        "upstream_unavailable",
    ),
    "429-org-and-billing": (
        429,
        "Rate limit reached for org-Q1w2E3r4T5y6U7i8O9p0aSdF on tokens per min. "
        "Billing: account past_due (card ending 4242), see https://billing.internal.example/acct/77",
        "Rate limit reached",
        ("org-Q1w2E3r4T5y6U7i8O9p0aSdF", "billing.internal.example"),
        ("past_due", "4242"),
        "upstream_rejected",
    ),
    "502-internal-host": (
        502,
        "<html><body>502: upstream inference-7.cluster.local:8080 (http://172.16.4.20:8080/v1) did not answer",
        "did not answer",
        ("inference-7.cluster.local", "172.16.4.20", "8080"),
        ("did not answer",),
        "upstream_unavailable",
    ),
}


def error_body(backend: str, message: str) -> bytes:
    """The error body each kind of upstream sends: Cloudflare's v4 envelope, or OpenAI's."""
    if backend == "workers-ai":
        return json.dumps({"success": False, "errors": [{"code": 9999, "message": message}]}).encode()
    return json.dumps({"error": {"message": message, "type": "server_error"}}).encode()


@pytest.mark.parametrize("case", list(LEAKY))
async def test_upstream_error_text_reaches_the_log_not_the_visitor(
    backend: str, fake: FakeWorkersAI, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    status, said, kept, secret, private, code = LEAKY[case]
    html = said.startswith("<html>")
    body = said.encode() if html else error_body(backend, said)
    scenario = Scenario(status=status, raw_body=body, content_type="text/html" if html else None)
    fake.script(scenario, scenario)

    api = await post_quote()
    browser = {"accept": "text/event-stream", "sec-fetch-site": "same-origin"}
    eventsource = await request(
        "GET", "/api/quotes/stream", query="persona=test-watts&topic=rain", headers=browser
    )

    assert fake.requests[0].route == ("gateway" if backend == "workers-ai" else "openai")
    assert api.status == (status if code == "upstream_rejected" else 502)
    assert visitor_error(api)["code"] == visitor_error(eventsource)["code"] == code
    rows = [row async for row in Generation.objects.all()]
    assert [row.error_code for row in rows] == [code, code]
    seen = (
        api.body.decode(),
        eventsource.body.decode(),
        json.dumps(api.headers),
        *(r.error_message for r in rows),
    )
    assert not [word for word in (*secret, *private) for text in seen if word in text]
    log = logged(caplog, backend)
    assert kept in log  # the operator still learns what went wrong
    assert not [word for word in (*secret, TEST_API_TOKEN) if word in log], log


async def test_an_error_mid_stream_reaches_the_log_not_the_visitor(
    backend: str, fake: FakeWorkersAI, caplog: pytest.LogCaptureFixture
) -> None:
    said = "pool to 10.9.8.7:5432 failed, DATABASE_PASSWORD=hunter2"
    if backend == "workers-ai":
        body = b'data: {"response":"Be water"}\n\ndata: ' + error_body(backend, said) + b"\n\n"
    else:
        chunk = {"choices": [{"index": 0, "delta": {"content": "Be water"}}], "model": "m"}
        body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps({'error': {'message': said}})}\n\n".encode()
    fake.script(Scenario(raw_body=body))

    response = await post_quote()

    assert response.status == 200  # the first token had gone out: the error is an event
    assert visitor_error(response)["code"] == "upstream_unavailable"
    assert "10.9.8.7" not in response.body.decode() and "hunter2" not in response.body.decode()
    log = logged(caplog, backend)
    assert "pool to" in log and "hunter2" not in log and "10.9.8.7" not in log


# -- our credentials --------------------------------------------------------------------------------

TOKEN, GATEWAY = TEST_API_TOKEN.encode(), TEST_GATEWAY_TOKEN.encode()


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario.unauthorized(message=f"Invalid API token {TEST_API_TOKEN}"),
        Scenario.error(3040, f"capacity for {TEST_API_TOKEN} / Bearer {TEST_GATEWAY_TOKEN}"),
        Scenario(status=500, raw_body=b"<html>" + TOKEN + b"</html>"),
        Scenario(headers={"cf-aig-log-id": TEST_API_TOKEN, "cf-aig-step": f"Bearer {TEST_GATEWAY_TOKEN}"}),
        Scenario(
            raw_body=b'data: {"response":"Stay"}\n\ndata: {"errors":[{"code":3040,"message":"'
            + TOKEN
            + b'"}]}\n\n'
        ),
        Scenario(tokens=("key=", TEST_API_TOKEN[:7], TEST_API_TOKEN[7:30], TEST_API_TOKEN[30:], " ok")),
        Scenario(echo_headers=True, split="random", seed=11),
    ],
    ids=["in-401", "in-3040", "in-500", "in-response-headers", "mid-stream", "cut-across-tokens", "echoed"],
)
async def test_no_credential_reaches_a_response_a_row_or_the_log(
    backend: str, fake: FakeWorkersAI, caplog: pytest.LogCaptureFixture, scenario: Scenario
) -> None:
    caplog.set_level(logging.DEBUG, logger="quotes")
    fake.script(scenario)

    response = await post_quote()

    assert fake.requests[0].headers["authorization"] == f"Bearer {TEST_API_TOKEN}"
    rows = [json.dumps(model_to_dict(row), default=str) async for row in Generation.objects.all()]
    for text in (response.body.decode(), json.dumps(response.headers), *rows, caplog.text):
        for secret in (TEST_API_TOKEN, TEST_GATEWAY_TOKEN):
            assert secret not in text and secret[:16] not in text and secret[-16:] not in text, text
    if scenario.echo_headers:
        text = "".join(json.loads(e["data"])["response"] for e in parse_sse(response.body)[:-1])
        assert "authorization: Bearer [redacted]\n" in text
        assert backend == "openai" or "cf-aig-authorization: Bearer [redacted]\n" in text
