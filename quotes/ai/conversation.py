"""A conversation with a persona: the visitor's follow-up turns, checked before any model runs."""

from __future__ import annotations

from django.conf import settings

from .catalog import count_tokens_estimate, get_model
from .errors import ErrorCode, QuoteError
from .events import GenerationRequest, Message

ROLES = ("user", "assistant")


def check_encodable(text: str, *, field: str) -> None:
    """JSON can carry a lone surrogate (`"\\ud800"`), which is no character at all: no backend
    can send it (UTF-8 cannot encode it) and PostgreSQL refuses it. Refuse it at the door."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise QuoteError(
            ErrorCode.INVALID_UNICODE,
            f"{field} contains an unpaired surrogate (such as \\ud800), which is not text. Send valid Unicode.",
            400,
        ) from None


def clean_topic(topic: object, *, default: str) -> str:
    """The visitor's topic, checked and tidied, or `default` when none was given."""
    if topic is None:
        return default
    if not isinstance(topic, str):
        raise QuoteError(ErrorCode.INVALID_TOPIC, "`topic` must be a string.", 400)
    check_encodable(topic, field="`topic`")
    # Control characters (NUL above all, which PostgreSQL cannot store) go; spaces collapse.
    topic = " ".join("".join(ch for ch in topic if ch.isprintable() or ch.isspace()).split())
    if len(topic) > settings.QUOTES_MAX_TOPIC_CHARS:
        raise QuoteError(
            ErrorCode.TOPIC_TOO_LONG,
            f"The topic is too long: keep it under {settings.QUOTES_MAX_TOPIC_CHARS} characters.",
            400,
        )
    return topic or default


def parse_messages(raw: object) -> tuple[Message, ...]:
    """Turn the `messages` field of a request into Message turns, or raise a 400 saying which
    limit was hit. Roles are `user` and `assistant` only: the system prompt is the persona's."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise QuoteError(
            ErrorCode.INVALID_MESSAGES, "`messages` must be a list of {role, content} turns.", 400
        )
    max_turns = settings.QUOTES_MAX_TURNS
    if len(raw) > max_turns:
        raise QuoteError(
            ErrorCode.TOO_MANY_MESSAGES, f"The conversation is too long: at most {max_turns} turns.", 400
        )
    max_chars = settings.QUOTES_MAX_MESSAGE_CHARS
    turns = []
    for index, turn in enumerate(raw):
        if not isinstance(turn, dict) or set(turn) != {"role", "content"}:
            raise QuoteError(
                ErrorCode.INVALID_MESSAGES, f"Turn {index + 1} must be exactly {{role, content}}.", 400
            )
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            raise QuoteError(
                ErrorCode.INVALID_MESSAGE_ROLE, f"Turn {index + 1}: role must be 'user' or 'assistant'.", 400
            )
        if not isinstance(content, str) or not content.strip():
            raise QuoteError(
                ErrorCode.INVALID_MESSAGES, f"Turn {index + 1}: content must be non-empty text.", 400
            )
        check_encodable(content, field=f"Turn {index + 1}")
        if "\x00" in content:
            raise QuoteError(
                ErrorCode.INVALID_MESSAGES, f"Turn {index + 1}: content must not contain NUL characters.", 400
            )
        if len(content) > max_chars:
            raise QuoteError(
                ErrorCode.MESSAGE_TOO_LONG,
                f"Turn {index + 1} is too long: at most {max_chars} characters.",
                400,
            )
        turns.append(Message(role, content))
    if turns and turns[-1].role != "user":
        raise QuoteError(
            ErrorCode.INVALID_MESSAGES, "The conversation must end with the visitor's (user) turn.", 400
        )
    return tuple(turns)


def check_context_window(request: GenerationRequest, *, model: str) -> None:
    """The whole request (prompts, turns and the answer's max_tokens) must fit the model's context."""
    info = get_model(model)
    if info is None:
        return
    prompt_tokens = sum(count_tokens_estimate(m.content) + 4 for m in request.messages)
    if prompt_tokens + request.max_tokens > info.context_window:
        raise QuoteError(
            ErrorCode.CONTEXT_WINDOW_EXCEEDED,
            f"The conversation is too long for {model}: about {prompt_tokens} tokens plus "
            f"{request.max_tokens} for the answer, over its {info.context_window}-token context window.",
            400,
        )
