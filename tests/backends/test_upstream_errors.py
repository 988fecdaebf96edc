"""What an upstream says when it fails stays with the operator (issue 20): through the stream
API, against the fake Workers AI (harness/workers_ai.py, a real HTTP server on 127.0.0.1) on both of its
routes, each backend answers the visitor a fixed message per kind of failure, with the stable
error code, and writes what the upstream said to the log, redacted.

The error bodies hold what real upstreams have sent back: a database password and an internal
address in a 500, a third-party key in a 422, an organisation id and a billing state in a 429,
an internal URL in a 502's HTML page.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.conf import OpenAICompatSettings
from quotes.models import Generation, Persona
from tests.asgi import StreamedResponse, parse_sse, post_quote, request
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture(autouse=True)
def _logging_configured() -> None:
    """The app's first import configures logging, which drops the handlers on the root logger,
    caplog's among them: do it before caplog attaches."""
    import config.asgi  # noqa: F401


@pytest.fixture(autouse=True)
async def _close_backends_on_this_loop() -> AsyncIterator[None]:
    yield
    await reset_backends()


def envelope(message: str, **fields: Any) -> bytes:
    """OpenAI's error body, which Workers AI's OpenAI route and most compatible servers send."""
    return json.dumps({"error": {"message": message, "type": "server_error", **fields}}).encode()


def cloudflare(message: str, code: int = 9999) -> bytes:
    return json.dumps(
        {"success": False, "errors": [{"code": code, "message": message}], "result": None}
    ).encode()


#: status, the upstream's message, what of it reaches no visitor, what of it reaches no log either
#: (secrets, addresses, hosts), and what the operator's log keeps of it
LEAKY = {
    "500-database": (
        500,
        "pool to 10.9.8.7:5432 failed, DATABASE_PASSWORD=hunter2",
        ("pool to", "10.9.8.7", "5432", "hunter2"),
        ("10.9.8.7", "5432", "hunter2"),
        "pool to",
    ),
    "422-third-party-key": (
        422,
        "Invalid value for 'tools': key sk-proj-4fJ9xQ2mL8vR3tK7wZ1nB6yH0cD5eA is not allowed",
        ("sk-proj-4fJ9xQ2mL8vR3tK7wZ1nB6yH0cD5eA", "tools", "not allowed"),
        ("sk-proj-4fJ9xQ2mL8vR3tK7wZ1nB6yH0cD5eA",),
        "is not allowed",
    ),
    "429-org-and-billing": (
        429,
        "Rate limit reached for org-Q1w2E3r4T5y6U7i8O9p0aSdF on tokens per min. "
        "Billing: account past_due (card ending 4242), see https://billing.internal.example/acct/77",
        ("org-Q1w2E3r4T5y6U7i8O9p0aSdF", "past_due", "4242", "billing.internal.example"),
        ("org-Q1w2E3r4T5y6U7i8O9p0aSdF", "billing.internal.example"),
        "Rate limit reached",
    ),
    "502-internal-host": (
        502,
        "<html><body>502: upstream inference-7.cluster.local:8080 (http://172.16.4.20:8080/v1) "
        "did not answer</body></html>",
        ("inference-7.cluster.local", "172.16.4.20", "8080", "did not answer"),
        ("inference-7.cluster.local", "172.16.4.20", "8080"),
        "did not answer",
    ),
}


def leaky_scenario(case: str, *, cloudflare_envelope: bool = False) -> Scenario:
    status, message, *_ = LEAKY[case]
    if message.startswith("<html>"):
        return Scenario(status=status, raw_body=message.encode(), content_type="text/html")
    body = cloudflare(message) if cloudflare_envelope else envelope(message)
    return Scenario(status=status, raw_body=body)


def assert_told_nothing(text: str, case: str) -> None:
    for secret in LEAKY[case][2]:
        assert secret not in text, (secret, text)


def assert_logged_redacted(caplog: pytest.LogCaptureFixture, logger: str, case: str) -> None:
    lines = [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]
    assert lines, [r.getMessage() for r in caplog.records]
    text = "\n".join(lines)
    assert LEAKY[case][4] in text, text  # the operator still learns what went wrong
    for secret in LEAKY[case][3]:
        assert secret not in text, (secret, text)
    assert TEST_API_TOKEN not in text


async def eventsource(persona: Persona) -> StreamedResponse:
    return await request(
        "GET",
        "/api/quotes/stream",
        query=f"persona={persona.slug}&topic=rain",
        headers={"accept": "text/event-stream", "sec-fetch-site": "same-origin"},
    )


def visitor_error(response: StreamedResponse) -> dict[str, Any]:
    """The error a visitor's client reads: the JSON envelope, or the stream's `error` event."""
    if response.headers.get("content-type") == "application/json":
        return dict(response.json()["error"])
    [event] = [e for e in parse_sse(response.body) if e["event"] == "error"]
    return dict(json.loads(event["data"])["error"])


# -- AI_BACKEND=openai ----------------------------------------------------------------------------


@pytest.fixture
async def openai_settings(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> Any:
    """The openai backend on Workers AI's OpenAI-compatible route of the fake."""
    workers_ai_settings.AI_BACKEND = "openai"
    workers_ai_settings.OPENAI_COMPAT = OpenAICompatSettings(
        base_url=fake_workers_ai.openai_base_url(TEST_ACCOUNT_ID), api_key=TEST_API_TOKEN
    )
    await reset_backends()
    return workers_ai_settings


OPENAI_CODES = {
    "500-database": ("upstream_unavailable", 502),
    "422-third-party-key": ("upstream_rejected", 422),
    "429-org-and-billing": ("upstream_rejected", 429),
    "502-internal-host": ("upstream_unavailable", 502),
}


@pytest.mark.parametrize("case", list(LEAKY))
@pytest.mark.parametrize("client", ["api", "eventsource"])
async def test_openai_upstream_error_text_reaches_the_log_not_the_visitor(
    persona: Persona,
    openai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
    case: str,
    client: str,
) -> None:
    fake_workers_ai.script(leaky_scenario(case))

    response = await (post_quote({"persona": persona.slug}) if client == "api" else eventsource(persona))

    [upstream] = fake_workers_ai.requests
    assert upstream.route == "openai"
    code, status = OPENAI_CODES[case]
    error = visitor_error(response)
    assert error["code"] == code
    if client == "api":
        assert response.status == status
    assert_told_nothing(response.body.decode(), case)
    assert_told_nothing(json.dumps(response.headers), case)
    row = await Generation.objects.aget()
    assert row.error_code == code
    assert_told_nothing(row.error_message, case)  # the staff's log page shows it
    assert_logged_redacted(caplog, "quotes.ai.backends.openai_compat", case)


async def test_openai_error_event_mid_stream_reaches_the_log_not_the_visitor(
    persona: Persona, openai_settings: Any, fake_workers_ai: FakeWorkersAI, caplog: pytest.LogCaptureFixture
) -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "Be water"}}], "model": "m"}
    failure = {"error": {"message": "pool to 10.9.8.7:5432 failed, DATABASE_PASSWORD=hunter2"}}
    body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(failure)}\n\n".encode()
    fake_workers_ai.script(Scenario(raw_body=body))

    response = await post_quote({"persona": persona.slug})

    assert response.status == 200  # the first token had gone out: the error is an event
    assert visitor_error(response)["code"] == "upstream_unavailable"
    assert_told_nothing(response.body.decode(), "500-database")
    assert_logged_redacted(caplog, "quotes.ai.backends.openai_compat", "500-database")


# -- AI_BACKEND=workers-ai ------------------------------------------------------------------------

WORKERS_AI_CODES = {
    "500-database": ("upstream_unavailable", 502),
    "422-third-party-key": ("upstream_rejected", 422),
    "429-org-and-billing": ("upstream_rejected", 429),
    "502-internal-host": ("upstream_unavailable", 502),
}


@pytest.mark.parametrize("case", list(LEAKY))
@pytest.mark.parametrize("client", ["api", "eventsource"])
async def test_workers_ai_upstream_error_text_reaches_the_log_not_the_visitor(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
    case: str,
    client: str,
) -> None:
    fake_workers_ai.script(leaky_scenario(case, cloudflare_envelope=True))

    response = await (post_quote({"persona": persona.slug}) if client == "api" else eventsource(persona))

    code, status = WORKERS_AI_CODES[case]
    error = visitor_error(response)
    assert error["code"] == code
    if client == "api":
        assert response.status == status
    assert_told_nothing(response.body.decode(), case)
    row = await Generation.objects.aget()
    assert_told_nothing(row.error_message, case)
    assert_logged_redacted(caplog, "quotes.ai.backends.workers_ai", case)


@pytest.mark.parametrize("upstream_code", [3040, 3036, 5007, 3006])
async def test_workers_ai_documented_error_keeps_its_code_and_tells_the_visitor_our_words_only(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
    upstream_code: int,
) -> None:
    """A documented code still maps to its own error; what Workers AI added goes to the log."""
    from harness.workers_ai import EXPECTED_ERRORS

    said = "capacity for org-Q1w2E3r4T5y6U7i8O9p0aSdF at 10.9.8.7:5432, DATABASE_PASSWORD=hunter2"
    fake_workers_ai.script(Scenario.error(upstream_code, said))

    response = await post_quote({"persona": persona.slug})

    code, status = EXPECTED_ERRORS[upstream_code]
    assert (response.status, response.json()["error"]["code"]) == (status, code)
    assert_told_nothing(response.body.decode(), "500-database")
    assert "org-Q1w2E3r4T5y6U7i8O9p0aSdF" not in response.body.decode()
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "quotes.ai.backends.workers_ai")
    assert "capacity for" in logged
    for secret in ("hunter2", "10.9.8.7", "org-Q1w2E3r4T5y6U7i8O9p0aSdF"):
        assert secret not in logged, logged


async def test_workers_ai_error_envelope_mid_stream_reaches_the_log_not_the_visitor(
    persona: Persona,
    workers_ai_settings: Any,
    fake_workers_ai: FakeWorkersAI,
    caplog: pytest.LogCaptureFixture,
) -> None:
    said = "pool to 10.9.8.7:5432 failed, DATABASE_PASSWORD=hunter2"
    body = b'data: {"response":"Be water"}\n\ndata: ' + cloudflare(said) + b"\n\n"
    fake_workers_ai.script(Scenario(raw_body=body))

    response = await post_quote({"persona": persona.slug})

    assert response.status == 200
    assert visitor_error(response)["code"] == "upstream_unavailable"
    assert_told_nothing(response.body.decode(), "500-database")
    assert_logged_redacted(caplog, "quotes.ai.backends.workers_ai", "500-database")


# -- the redaction itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("said", "kept", "gone"),
    [
        ('{"api_key": "abc def", "password":"x"}', ('"api_key": ', '"password":'), ("abc def", '"x"')),
        ("Authorization: Bearer eyJhbGciOi.x.y", ("Authorization: ",), ("eyJhbGciOi",)),
        ("connect to [fe80::1%eth0]:8080 and 2001:db8::1 refused", ("connect to",), ("fe80", "2001:db8")),
        ("db-primary.prod.internal and localhost:6379 refused", ("refused",), ("db-primary", "localhost")),
        ("mail admin@acme.io for access", ("mail", "for access"), ("admin@acme.io",)),
        ("request 3f2a9c1e-77b0-4c1d-9e2f-0a1b2c3d4e5f failed", ("request", "failed"), ("3f2a9c1e",)),
        # What says what went wrong stays: model names, times, counts.
        (
            "model @cf/mistral/mistral-7b-instruct-v0.1 overloaded at 10:30:00",
            ("mistral-7b-instruct-v0.1", "10:30:00"),
            (),
        ),
        ("context window exceeded: 3000 tokens > 2048", ("3000 tokens > 2048",), ()),
    ],
)
def test_upstream_text_takes_out_what_is_private_and_keeps_what_went_wrong(
    said: str, kept: tuple[str, ...], gone: tuple[str, ...]
) -> None:
    from quotes.ai.errors import upstream_text

    text = upstream_text(said)

    assert all(part in text for part in kept), text
    assert not any(part in text for part in gone), text


def test_upstream_text_is_bounded_and_on_one_line() -> None:
    from quotes.ai.errors import UPSTREAM_TEXT_LIMIT, upstream_text

    text = upstream_text("<p>line one\nline two\r\n</p>" + "x " * 10_000)

    assert text.startswith("line one line two") and "\n" not in text and "<p>" not in text
    assert len(text) <= UPSTREAM_TEXT_LIMIT
