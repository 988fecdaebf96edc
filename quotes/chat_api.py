"""OpenAI's Chat Completions, spoken by every persona: any OpenAI client (the official SDK,
LiteLLM, curl) gets a quote with the site's admission, cache, spend ceiling, fallbacks, log row
and metrics behind it: the same start path (streams.begin) as every other face.

    POST /v1/chat/completions   model: a persona's slug; messages: the conversation
    GET  /v1/models             the active personas, as models
    GET  /v1/models/<slug>

A request maps onto the site's own: its first message, the user's, is the quote's topic (an
empty one: the persona's default topic), and the turns after it are the follow-up conversation.
The persona's system prompt stays the site's: a `system` or `developer` message is refused,
never merged. `max_tokens` (or `max_completion_tokens`) and `temperature` may be set within the
persona's limits; fields that would change what a persona is (tools, n > 1, a response format)
are refused with the field named. No key is asked for: the API is as open as the site's page,
and rate-limited the same way."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from django.db.models import Max
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from streaming import Done, Error, Meta, Stream, Token, Usage

from . import personas, rows, streams
from .encoders import (
    ChatCompletionsEncoder,
    completion_id,
    finish_reason,
    meta_headers,
    openai_error_response,
    openai_usage,
    stream_response,
)
from .errors import ErrorCode, QuoteError
from .models import Persona
from .security import refuse_cross_site
from .views import client_of, count_bad_input, not_a_document, open_stream, read_json

TRANSPORT = "openai"
ENDED_EARLY = Error(ErrorCode.INTERNAL_ERROR, "The answer ended without finishing.", 500)
OWNER = "persona-quotes"
#: Fields the API takes.
TAKEN = frozenset(
    {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature"}
)
#: Fields that change nothing a persona says (who asks, what to keep), read and let be.
LET_BE = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "parallel_tool_calls",
    }
)
#: Fields whose default is the only value a persona takes.
DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "n": lambda value: value == 1,
    "logprobs": lambda value: value is False,
    "response_format": lambda value: value == {"type": "text"},
    "modalities": lambda value: value == ["text"],
}


def _bad(message: str, param: str, code: ErrorCode = ErrorCode.INVALID_PARAMETER) -> QuoteError:
    return QuoteError(code, message, 400, param=param)


class Chat:
    """A Chat Completions body, checked: what the site's start path takes (`params`), and how
    to answer (`stream`, `include_usage`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        for name, value in body.items():
            if name in TAKEN or name in LET_BE or value is None:
                continue
            if name in DEFAULTS and DEFAULTS[name](value):
                continue
            raise _bad(
                f"`{name}` is not supported: a persona answers in its own voice, with text only.",
                name,
                ErrorCode.UNSUPPORTED_PARAMETER,
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            code = ErrorCode.INVALID_PERSONA if model else ErrorCode.MISSING_PERSONA
            raise _bad("`model` must be a persona's slug (GET /v1/models lists them).", "model", code)
        self.model = model
        self.stream = body.get("stream") or False
        if not isinstance(self.stream, bool):
            raise _bad("`stream` must be true or false.", "stream")
        options = body.get("stream_options")
        if options is not None and (not self.stream or not isinstance(options, dict)):
            raise _bad("`stream_options` is an object, and only for a streamed answer.", "stream_options")
        include_usage = (options or {}).get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise _bad("`stream_options.include_usage` must be true or false.", "stream_options")
        self.include_usage = include_usage
        topic, turns = self._messages(body.get("messages"))
        self.params: dict[str, Any] = {"persona": model, "topic": topic, "messages": turns}
        most = body.get("max_completion_tokens")
        if most is not None and body.get("max_tokens") not in (None, most):
            raise _bad("Send `max_completion_tokens` or `max_tokens`, not both.", "max_tokens")
        self.params["max_tokens"] = body.get("max_tokens", most)
        self.params["temperature"] = body.get("temperature")

    @staticmethod
    def _messages(raw: object) -> tuple[str, list[dict[str, str]]]:
        """The topic (the first message, the user's) and the turns after it."""
        if not isinstance(raw, list) or not raw:
            raise _bad(
                "`messages` must be a non-empty list of {role, content} messages.",
                "messages",
                ErrorCode.INVALID_MESSAGES,
            )
        turns = [_turn(index, message) for index, message in enumerate(raw)]
        first = turns[0]
        if first["role"] != "user":
            raise _bad(
                "messages[0] must be the user's: it names the quote's topic.",
                "messages",
                ErrorCode.INVALID_MESSAGES,
            )
        field = "messages[0], the quote's topic,"
        topic = streams.clean_topic(first["content"], default="", field=field, param="messages")
        rest = turns[1:]
        if rest:  # the same checks as the site's follow-up turns, named as this body names them
            streams.parse_messages(rest, turn="messages[{}]", first=1)
        return topic, rest


def _turn(index: int, message: object) -> dict[str, str]:
    """One message as the site's turn: a role and its text (a list of text parts joined)."""
    if not isinstance(message, dict):
        raise _bad(
            f"messages[{index}] must be an object with `role` and `content`.",
            "messages",
            ErrorCode.INVALID_MESSAGES,
        )
    role = message.get("role")
    if role in ("system", "developer"):
        raise _bad(
            f"messages[{index}]: the persona's own system prompt speaks for it; send no {role} message.",
            "messages",
            ErrorCode.INVALID_MESSAGE_ROLE,
        )
    if role not in ("user", "assistant"):
        message_ = f"messages[{index}]: role must be 'user' or 'assistant' (a persona calls no tools)."
        raise _bad(message_, "messages", ErrorCode.INVALID_MESSAGE_ROLE)
    extra = [
        name
        for name, value in message.items()
        if name not in ("role", "content", "name") and value is not None
    ]
    if extra:
        raise _bad(
            f"messages[{index}]: `{extra[0]}` is not supported.", "messages", ErrorCode.UNSUPPORTED_PARAMETER
        )
    content = message.get("content")
    if isinstance(content, list):
        if not all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            raise _bad(
                f"messages[{index}]: only text parts are supported.", "messages", ErrorCode.INVALID_MESSAGES
            )
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise _bad(f"messages[{index}]: content must be text.", "messages", ErrorCode.INVALID_MESSAGES)
    return {"role": role, "content": content}


@csrf_exempt  # JSON only: a cross-site form cannot send application/json without CORS
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    """A `chat.completion`, or with `stream` the `chat.completion.chunk` stream; with
    Last-Event-ID, the rest of a dropped stream."""
    body: dict[str, Any] = {}
    try:
        refuse_cross_site(request)
        client = await client_of(request)
        try:
            if request.method != "POST":
                raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use POST with a JSON body.", 405)
            body = read_json(request)
            chat = Chat(body)
        except QuoteError as exc:
            await count_bad_input(request, client, exc)
            raise
        stream, after = await open_stream(request, client, chat.params, TRANSPORT)
        active = personas.peek(chat.model)
        most = chat.params["max_tokens"] or (active.persona.max_tokens if active else None)
        if chat.stream:
            encoder = ChatCompletionsEncoder(
                stream.id, chat.model, include_usage=chat.include_usage, max_tokens=most
            )
            response = await stream_response(stream, encoder, after)
        else:
            response = await completion(stream, chat.model, most)
    except QuoteError as exc:
        rows.refused(exc, body.get("model"), TRANSPORT)
        response = openai_error_response(exc, {"Allow": "POST"} if exc.status == 405 else None)
    return not_a_document(response)


async def completion(stream: Stream, model: str, max_tokens: int | None) -> JsonResponse:
    """The whole answer as one `chat.completion`, once the stream ends; its error, if it fails
    (a client that leaves stops reading it: the stream ends as any left stream does)."""
    meta, text, usage = Meta(), [], None
    end: Done | Error | None = None
    async with aclosing(stream.read(0)) as events:
        async for event in events:
            if type(event) is Token:
                text.append(event.text)
            elif type(event) is Meta:
                meta = meta.merged(event)
            elif type(event) is Usage:
                usage = event
            elif type(event) is Done or type(event) is Error:
                end = event
                break
    headers = meta_headers(meta)
    if type(end) is Error:
        return openai_error_response(end, headers)
    if end is None:
        return openai_error_response(ENDED_EARLY, headers)
    answer: dict[str, Any] = {
        "id": completion_id(stream.id),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(text),
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": finish_reason(usage, max_tokens),
            }
        ],
    }
    if usage is not None:
        answer["usage"] = openai_usage(usage)
    return JsonResponse(answer, headers=headers)


# -- the personas, as models -----------------------------------------------------------------


def _models() -> Any:
    """The active personas with when each last changed (its latest version)."""
    return Persona.objects.active().annotate(updated=Max("versions__created_at"))


def _model(persona: Any) -> dict[str, Any]:
    created = int(persona.updated.timestamp()) if persona.updated else 0
    return {"id": persona.slug, "object": "model", "created": created, "owned_by": OWNER}


@csrf_exempt  # read-only: any other method gets OpenAI's 405, not Django's CSRF page
async def list_models(request: HttpRequest) -> HttpResponseBase:
    if request.method not in ("GET", "HEAD"):
        error = QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use GET.", 405)
        return not_a_document(openai_error_response(error, {"Allow": "GET, HEAD"}))
    data = [_model(persona) async for persona in _models()]
    return not_a_document(JsonResponse({"object": "list", "data": data}))


@csrf_exempt
async def get_model(request: HttpRequest, model: str) -> HttpResponseBase:
    if request.method not in ("GET", "HEAD"):
        error = QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use GET.", 405)
        return not_a_document(openai_error_response(error, {"Allow": "GET, HEAD"}))
    persona = (
        await Persona.objects.active()
        .annotate(updated=Max("versions__created_at"))
        .filter(slug=model)
        .afirst()
    )
    if persona is None:
        error = QuoteError(ErrorCode.UNKNOWN_PERSONA, f"There is no persona called {model[:100]!r}.", 404)
        return not_a_document(openai_error_response(error))
    return not_a_document(JsonResponse(_model(persona)))
