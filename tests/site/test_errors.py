"""The error vocabulary (quotes.errors): one enum whose values are the wire codes, one envelope, the
visitor's error for an upstream's status, and an upstream's words made fit for the operator's log."""

from __future__ import annotations

import json

import pytest
from streaming import Error, sse

from quotes.errors import (
    UPSTREAM_TEXT_LIMIT,
    ErrorCode,
    QuoteError,
    envelope,
    upstream_status_error,
    upstream_text,
    upstream_timeout,
)

pytestmark = pytest.mark.unit


def test_error_code_members_are_the_strings_clients_see() -> None:
    # A StrEnum member serializes as its value, so the wire format is unchanged.
    assert json.dumps({"code": ErrorCode.UPSTREAM_TIMEOUT}) == '{"code": "upstream_timeout"}'
    assert upstream_timeout().code == "upstream_timeout"
    assert all(member.value == member.name.lower() for member in ErrorCode)


def test_envelope_is_the_one_json_error_body() -> None:
    error = QuoteError(ErrorCode.INVALID_TOPIC, "`topic` must be a string.", 400)
    assert error.as_event() == Error("invalid_topic", "`topic` must be a string.", 400)
    assert envelope(ErrorCode.INVALID_PERSONA, "Fix it.", fields={"name": ["Required."]}) == {
        "error": {"code": "invalid_persona", "message": "Fix it.", "fields": {"name": ["Required."]}}
    }
    frame = sse.named("error", envelope(ErrorCode.BUSY, "Busy.")).decode()
    assert frame.startswith("event: error\n")
    assert json.loads(frame.split("data: ", 1)[1]) == {"error": {"code": "busy", "message": "Busy."}}


def test_an_upstreams_status_alone_says_what_the_visitor_is_told() -> None:
    told = {status: upstream_status_error(status) for status in (401, 403, 404, 429, 500, 503, 302)}
    assert {status: (error.code, error.status) for status, error in told.items()} == {
        401: ("upstream_auth", 502),
        403: ("upstream_auth", 502),
        404: ("upstream_rejected", 404),
        429: ("upstream_rejected", 429),
        500: ("upstream_unavailable", 502),
        503: ("upstream_unavailable", 502),
        302: ("upstream_malformed", 502),
    }


@pytest.mark.parametrize(
    ("said", "logged"),
    [
        (
            "pool to 10.9.8.7:5432 failed, DATABASE_PASSWORD=hunter2",
            "pool to [address] failed, DATABASE_PASSWORD=[redacted]",
        ),
        ('{"api_key": "abc def", "password":"x"}', '{"api_key": [redacted], "password":[redacted]}'),
        ("Authorization: Bearer eyJhbGciOi.x.y", "Authorization: [redacted] [redacted]"),
        (
            "key sk-proj-4fJ9xQ2mL8vR3tK7wZ1nB6yH0cD5eA for org-Q1w2E3r4T5y6U7i8O9p0aSdF",
            "key [redacted] for [redacted]",
        ),
        (
            "connect to [fe80::1%eth0]:8080 and 2001:db8::1 refused",
            "connect to [address] and [address] refused",
        ),
        ("db-primary.prod.internal and localhost:6379 refused", "[host] and [address] refused"),
        ("see https://billing.internal.example/acct/77 or mail admin@acme.io", "see [url] or mail [email]"),
        ("request 3f2a9c1e-77b0-4c1d-9e2f-0a1b2c3d4e5f failed", "request [redacted] failed"),
        # What says what went wrong stays: model names, times, counts.
        ("model @cf/mistral/mistral-7b-instruct-v0.1 overloaded at 10:30:00", None),
        ("context window exceeded: 3000 tokens > 2048", None),
    ],
)
def test_upstream_text_takes_out_what_is_private_and_keeps_what_went_wrong(
    said: str, logged: str | None
) -> None:
    assert upstream_text(said) == (logged or said)


def test_upstream_text_takes_out_our_own_secrets_and_is_bounded_on_one_line() -> None:
    assert upstream_text("token cfut_ABC rejected", secrets=("cfut_ABC",)) == "token [redacted] rejected"
    text = upstream_text("<p>line one\nline two\r\n</p>" + "x " * 10_000)
    assert text.startswith("line one line two") and "\n" not in text and "<p>" not in text
    assert len(text) <= UPSTREAM_TEXT_LIMIT
