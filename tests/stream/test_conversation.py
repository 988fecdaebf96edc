"""Follow-up conversations through the stream endpoint (embedded model)."""

from __future__ import annotations

import pytest

from quotes.models import Generation, Persona
from tests.asgi import parse_sse, request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


async def test_conversation_continues_with_the_persona(persona: Persona) -> None:
    messages = [
        {"role": "assistant", "content": "Work is play that forgot its name."},
        {"role": "user", "content": "And what about rest?"},
    ]
    response = await request(
        "POST", "/api/quotes/stream", json_body={"persona": persona.slug, "messages": messages}
    )

    assert response.status == 200
    assert parse_sse(response.body)[-1]["data"] == "[DONE]"
    row = await Generation.objects.aget()
    sent = row.request["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[0]["content"] == "You are Alan Watts"
    assert sent[-1]["content"] == "And what about rest?"


TOO_LONG = "word " * 390  # ~1950 characters, ~490 estimated tokens


@pytest.mark.parametrize(
    ("messages", "code", "says"),
    [
        pytest.param("hello", "invalid_messages", "list", id="not-a-list"),
        pytest.param(
            [{"role": "system", "content": "obey"}], "invalid_message_role", "role", id="system-role"
        ),
        pytest.param([{"role": "tool", "content": "x"}], "invalid_message_role", "role", id="tool-role"),
        pytest.param([{"role": "user"}], "invalid_messages", "role, content", id="missing-content"),
        pytest.param([{"role": "user", "content": 3}], "invalid_messages", "text", id="content-number"),
        pytest.param([{"role": "user", "content": "  "}], "invalid_messages", "non-empty", id="blank"),
        pytest.param(
            [{"role": "user", "content": "x" * 2001}], "message_too_long", "2000", id="turn-too-long"
        ),
        pytest.param(
            [{"role": "user", "content": "hi"}] * 21, "too_many_messages", "20 turns", id="too-many-turns"
        ),
        pytest.param(
            [{"role": "assistant", "content": "hi"}], "invalid_messages", "end with", id="ends-on-assistant"
        ),
        pytest.param(
            [
                {"role": "user", "content": TOO_LONG},
                {"role": "assistant", "content": TOO_LONG},
                {"role": "user", "content": TOO_LONG},
            ],
            "context_window_exceeded",
            "1024-token context window",
            id="over-context-window",
        ),
    ],
)
async def test_conversation_rejects_bad_turns_saying_which_limit(
    persona: Persona, messages: object, code: str, says: str
) -> None:
    response = await request(
        "POST", "/api/quotes/stream", json_body={"persona": persona.slug, "messages": messages}
    )
    assert response.status == 400
    error = response.json()["error"]
    assert error["code"] == code
    assert says in error["message"]
    assert not await Generation.objects.aexists()
