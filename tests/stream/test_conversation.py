"""A quote's topic and follow-up conversation: checked (quotes.streams.clean_topic,
parse_messages, check_context_window), then sent upstream as the persona's chat."""

from __future__ import annotations

from typing import Any

import pytest

from harness.workers_ai import FakeWorkersAI
from quotes.backends import backend_for
from quotes.backends.base import Message
from quotes.errors import QuoteError
from quotes.models import Generation, Persona
from quotes.streams import check_context_window, clean_topic, parse_messages
from tests.asgi import parse_sse, post_quote
from tests.fixtures import saved

TOO_LONG = "word " * 390  # ~1950 characters, ~490 estimated tokens


def refusal(call: Any, *args: Any, **kwargs: Any) -> tuple[str, str, int]:
    with pytest.raises(QuoteError) as caught:
        call(*args, **kwargs)
    return caught.value.code, caught.value.message, caught.value.status


@pytest.mark.unit
def test_clean_topic_collapses_spaces_drops_control_characters_and_defaults() -> None:
    assert clean_topic("  the \t  sea\x00 ", default="tea") == "the sea"
    assert clean_topic(None, default="tea") == clean_topic(" \x07 ", default="tea") == "tea"
    assert refusal(clean_topic, 3, default="tea")[::2] == ("invalid_topic", 400)
    assert refusal(clean_topic, "\ud800", default="tea")[::2] == ("invalid_unicode", 400)
    code, message, _ = refusal(clean_topic, "x" * 201, default="tea")
    assert code == "topic_too_long" and "200 characters" in message


def turn(role: str, content: object) -> dict[str, object]:
    return {"role": role, "content": content}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("messages", "code", "says"),
    [
        ("hello", "invalid_messages", "list"),
        ([turn("system", "obey")], "invalid_message_role", "role"),
        ([{"role": "user"}], "invalid_messages", "role, content"),
        ([turn("user", 3)], "invalid_messages", "text"),
        ([turn("user", "  ")], "invalid_messages", "non-empty"),
        ([turn("user", "\ud800")], "invalid_unicode", "surrogate"),
        ([turn("user", "x" * 2001)], "message_too_long", "2000"),
        ([turn("user", "hi")] * 21, "too_many_messages", "20 turns"),
        ([turn("assistant", "hi")], "invalid_messages", "end with"),
    ],
)
def test_parse_messages_refuses_bad_turns_saying_which_limit(messages: object, code: str, says: str) -> None:
    got, message, status = refusal(parse_messages, messages)

    assert (got, status) == (code, 400)
    assert says in message


@pytest.mark.unit
def test_parse_messages_reads_user_and_assistant_turns() -> None:
    turns = [turn("assistant", "Work is play."), turn("user", "And rest?")]

    assert parse_messages(turns) == (Message("assistant", "Work is play."), Message("user", "And rest?"))
    assert parse_messages(None) == ()


@pytest.mark.unit
def test_a_conversation_must_fit_the_models_context_window() -> None:
    persona = Persona(
        slug="p", name="P", system_prompt="You are P", user_prompt_template="On {topic}", max_tokens=16
    )
    turns = (Message("user", TOO_LONG), Message("assistant", TOO_LONG), Message("user", TOO_LONG))

    backend = backend_for(persona)
    check_context_window(backend, persona.build_request(topic="tea", messages=turns[:1]))
    code, message, status = refusal(
        check_context_window, backend, persona.build_request(topic="tea", messages=turns)
    )
    # The embedded model (the tests' AI_BACKEND) answers whatever model the persona names.
    assert (code, status) == ("context_window_exceeded", 400)
    assert "gemma-3-270m" in message and "1024-token context window" in message


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    await saved(persona, max_tokens=48, temperature=1.25)
    return fake


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_the_conversation_and_topic_reach_the_model_after_the_personas_prompts(
    fake: FakeWorkersAI,
) -> None:
    turns = [
        turn("assistant", "Work is play, seen from far enough away."),
        turn("user", "Shorter, and about tea."),
    ]

    refused = await post_quote({"persona": "test-watts", "messages": [turn("tool", "x")]})
    response = await post_quote({"persona": "test-watts", "topic": "  the   sea ", "messages": turns})

    assert (refused.status, refused.json()["error"]["code"]) == (400, "invalid_message_role")
    assert response.status == 200 and parse_sse(response.body)[-1]["data"] == "[DONE]"
    [upstream] = fake.requests  # the refused one reached no model, and has no row
    prompt = "Write 1 inspiring quote that is less than 50 words about the sea as if you were Alan Watts"
    messages = [turn("system", "You are Alan Watts"), turn("user", prompt), *turns]
    assert upstream.json == {"messages": messages, "stream": True, "max_tokens": 48, "temperature": 1.25}
    row = await Generation.objects.aget()
    assert (row.topic, row.request["messages"][2:]) == ("the sea", turns)
