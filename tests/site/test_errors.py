"""The error vocabulary: one enum whose values are the wire codes, and one envelope."""

from __future__ import annotations

import json

import pytest

from quotes.ai import sse
from quotes.ai.errors import ErrorCode, QuoteError, envelope, upstream_timeout

pytestmark = pytest.mark.unit


def test_error_code_members_are_the_strings_clients_see():
    # A StrEnum member serializes as its value, so the wire format is unchanged.
    assert json.dumps({"code": ErrorCode.UPSTREAM_TIMEOUT}) == '{"code": "upstream_timeout"}'
    assert upstream_timeout().code == "upstream_timeout"
    assert all(member.value == member.name.lower() for member in ErrorCode)


def test_envelope_is_the_one_json_error_body():
    error = QuoteError(ErrorCode.INVALID_TOPIC, "`topic` must be a string.", 400)
    assert error.as_json() == {"error": {"code": "invalid_topic", "message": "`topic` must be a string."}}
    assert envelope(ErrorCode.INVALID_PERSONA, "Fix it.", fields={"name": ["Required."]}) == {
        "error": {"code": "invalid_persona", "message": "Fix it.", "fields": {"name": ["Required."]}}
    }
    frame = sse.error(ErrorCode.BUSY, "Busy.").decode()
    assert frame.startswith("event: error\n")
    assert json.loads(frame.split("data: ", 1)[1]) == envelope(ErrorCode.BUSY, "Busy.")
