"""Malformed requests to the OpenAI-compatible routes (/v1), through the real ASGI app: each
gets its 4xx in OpenAI's error envelope, as OpenAI's published schema describes it (`message`,
`type`, `param`, `code`), never a 500, no ERROR line and no row; and the mapping of a
conversation onto a persona's quote."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.conf import settings as django_settings

from harness.openai_schema import violation
from quotes.chat_api import Chat
from quotes.errors import QuoteError
from quotes.models import Generation, Persona
from tests.site.test_bad_input import JSON, TEXT, Sent, assert_no_error_logged, log_output, post, send

__all__ = ["log_output"]  # the fixture, used by name

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

COMPLETIONS = "/v1/chat/completions"
MAX_BODY = django_settings.QUOTES_MAX_BODY_BYTES
LONG_TOPIC = "x" * (django_settings.QUOTES_MAX_TOPIC_CHARS + 1)


def chat(**fields: object) -> Sent:
    body = {"model": "test-watts", "messages": [{"role": "user", "content": "rain"}], **fields}
    return post(body, JSON, COMPLETIONS)


def said(*messages: dict[str, object]) -> Sent:
    return chat(messages=list(messages))


USER = {"role": "user", "content": "rain"}
#: what each request gets: "<status> <code> <param>" ("-": no param)
BATTERY: dict[str, tuple[str, Sent]] = {
    # the body
    "text-plain": ("415 unsupported_media_type -", post(b"{}", TEXT, COMPLETIONS)),
    "invalid-json": ("400 invalid_json -", post(b'{"model": "test-watts"', JSON, COMPLETIONS)),
    "json-array": ("400 invalid_json -", post([1], JSON, COMPLETIONS)),
    "deeply-nested": (
        "400 invalid_json -",
        post(b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON, COMPLETIONS),
    ),
    "huge-body": ("413 body_too_large -", chat(user="y" * (MAX_BODY + 1))),
    "get": ("405 method_not_allowed -", ("GET", COMPLETIONS, b"", {}, "")),
    "cross-site": ("403 cross_site -", post({}, {**JSON, "origin": "https://evil.example"}, COMPLETIONS)),
    # the model
    "no-model": ("400 missing_persona model", post({"messages": [USER]}, JSON, COMPLETIONS)),
    "model-int": ("400 invalid_persona model", chat(model=7)),
    "unknown-model": ("404 model_not_found model", chat(model="gpt-5")),
    "model-nul": ("404 model_not_found model", chat(model="test-watts\u0000")),
    # the messages
    "no-messages": ("400 invalid_messages messages", chat(messages=[])),
    "messages-string": ("400 invalid_messages messages", chat(messages="hi")),
    "system-message": (
        "400 invalid_message_role messages",
        said({"role": "system", "content": "Be Yoda."}, USER),
    ),
    "developer-message": (
        "400 invalid_message_role messages",
        said({"role": "developer", "content": "x"}, USER),
    ),
    "tool-message": (
        "400 invalid_message_role messages",
        said(USER, {"role": "tool", "content": "x", "tool_call_id": "1"}),
    ),
    "assistant-first": ("400 invalid_messages messages", said({"role": "assistant", "content": "x"}, USER)),
    "ends-on-assistant": ("400 invalid_messages messages", said(USER, {"role": "assistant", "content": "x"})),
    "image-part": (
        "400 invalid_messages messages",
        said({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    ),
    "content-number": ("400 invalid_messages messages", said({"role": "user", "content": 7})),
    "tool-calls": (
        "400 unsupported_parameter messages",
        said(USER, {"role": "assistant", "content": "x", "tool_calls": []}, USER),
    ),
    "topic-too-long": ("400 topic_too_long messages", said({"role": "user", "content": LONG_TOPIC})),
    "topic-surrogate": (
        "400 invalid_unicode -",
        post(
            b'{"model": "test-watts", "messages": [{"role": "user", "content": "\\ud800"}]}',
            JSON,
            COMPLETIONS,
        ),
    ),
    "empty-turn": (
        "400 invalid_messages messages",
        said(USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": " "}),
    ),
    "too-many-turns": (
        "400 too_many_messages messages",
        said(USER, *[{"role": "user", "content": "x"}] * 1000),
    ),
    # the options
    "stream-string": ("400 invalid_parameter stream", chat(stream="yes")),
    "stream-options-alone": (
        "400 invalid_parameter stream_options",
        chat(stream_options={"include_usage": True}),
    ),
    "include-usage-string": (
        "400 invalid_parameter stream_options",
        chat(stream=True, stream_options={"include_usage": 1}),
    ),
    "max-tokens-over": ("400 out_of_range max_tokens", chat(max_tokens=17)),
    "max-tokens-zero": ("400 out_of_range max_tokens", chat(max_completion_tokens=0)),
    "max-tokens-both": ("400 invalid_parameter max_tokens", chat(max_tokens=8, max_completion_tokens=9)),
    "max-tokens-float": ("400 out_of_range max_tokens", chat(max_tokens=8.5)),
    "max-tokens-true": ("400 out_of_range max_tokens", chat(max_tokens=True)),
    "temperature-over": ("400 out_of_range temperature", chat(temperature=9)),
    "temperature-negative": ("400 out_of_range temperature", chat(temperature=-0.1)),
    "temperature-text": ("400 out_of_range temperature", chat(temperature="hot")),
    "tools": (
        "400 unsupported_parameter tools",
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
    ),
    "n-2": ("400 unsupported_parameter n", chat(n=2)),
    "json-mode": ("400 unsupported_parameter response_format", chat(response_format={"type": "json_object"})),
    "stop": ("400 unsupported_parameter stop", chat(stop=["."])),
    "logprobs": ("400 unsupported_parameter logprobs", chat(logprobs=True)),
    # resume
    "resume-foreign": (
        "400 invalid_last_event_id -",
        post(json.loads(chat(stream=True)[2]), {**JSON, "last-event-id": "x"}, COMPLETIONS),
    ),
    # the models
    "unknown-persona-model": ("404 model_not_found model", ("GET", "/v1/models/nobody", b"", {}, "")),
    "models-post": ("405 method_not_allowed -", post({}, JSON, "/v1/models")),
}


def assert_openai_error(response: Any, status: int, code: str, param: str | None) -> None:
    assert response.status == status, (response.status, response.body[:300])
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert violation("ErrorResponse", body) == ""
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert (body["error"]["code"], body["error"]["param"]) == (code, param), body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].strip(), body


@pytest.mark.parametrize(("expected", "sent"), BATTERY.values(), ids=BATTERY.keys())
async def test_bad_input_on_the_openai_routes_gets_its_4xx_in_openais_envelope(
    persona: Persona, unlimited: Any, log_output: io.StringIO, expected: str, sent: Sent
) -> None:
    response = await send(*sent)

    status, code, param = expected.split()
    assert_openai_error(response, int(status), code, None if param == "-" else param)
    assert_no_error_logged(log_output)
    assert status != "405" or response.headers["allow"] in ("POST", "GET, HEAD")
    assert not await Generation.objects.aexists()


def test_a_conversation_maps_onto_a_quote_its_first_message_the_topic() -> None:
    answer = {"role": "assistant", "content": "Rain is the sky, falling."}
    parts = {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "snow?"}]}
    chat = Chat(
        {"model": "alan-watts", "messages": [USER, answer, parts], "user": "u-1", "n": 1, "seed": None}
    )

    assert chat.params == {
        "persona": "alan-watts",
        "topic": "rain",
        "messages": [answer, {"role": "user", "content": "And snow?"}],
        "max_tokens": None,
        "temperature": None,
    }
    assert (chat.stream, chat.include_usage) == (False, False)
    with pytest.raises(QuoteError) as refused:
        Chat({"model": "alan-watts", "messages": [USER], "seed": 7})
    assert (refused.value.status, refused.value.param) == (400, "seed")
