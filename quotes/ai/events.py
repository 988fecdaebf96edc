"""The typed events every backend yields, and the request every backend takes.

A backend is an async iterator of these events. Only the view layer turns them into bytes
(SSE, htmx fragments or WebSocket frames), so every transport sees the same stream.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import Error, ErrorCode  # an event too: defined with the error vocabulary it carries

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class VoiceExample:
    """One line in a persona's voice, on its own topic ("" when the admin gave none): the model
    is shown these so that it writes like the persona (quotes.ai.voice parses and guards them)."""

    topic: str
    text: str


_HELP = "Leave empty for the model's default. The allowed range depends on the model."


def _sampling(*, integer: bool = False, openai: bool, help_text: str = _HELP) -> Any:
    """Declare a sampling field of GenerationRequest: its name is the same for the Persona field,
    Workers AI and the catalog's per-model range (`ModelInfo.<name>`); `openai` says whether the
    OpenAI API takes it under that name too (strict servers answer 400 to unknown ones)."""
    metadata = {"sampling": True, "integer": integer, "openai": openai, "help_text": help_text}
    return field(default=None, metadata=metadata)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What one generation asks of a backend, whatever the backend.

    `messages` is the chat a cloud model receives: the persona's system prompt first, then one
    user turn and one assistant turn per voice example (the example's topic asked, the example
    answered: few-shot turns), then the user prompt for `topic`, then the visitor's conversation.
    `speaker`, `description`, `topic` and `examples` let a base model (the embedded one) build its
    own completion frame instead of a chat, since chat prompts fail on it.
    """

    model: str
    messages: tuple[Message, ...]
    speaker: str
    topic: str
    #: the persona's description: the embedded model's frame uses it, chat models do not
    description: str = ""
    max_tokens: int = 256
    # The sampling fields: declared here once. Persona's fields, its form's help texts, the
    # catalog's range checks and the OpenAI body are derived from these (SAMPLING_FIELDS).
    temperature: float | None = _sampling(openai=True, help_text="")
    top_p: float | None = _sampling(openai=True)
    top_k: int | None = _sampling(integer=True, openai=False)
    seed: int | None = _sampling(integer=True, openai=True)
    repetition_penalty: float | None = _sampling(openai=False)
    frequency_penalty: float | None = _sampling(openai=True)
    presence_penalty: float | None = _sampling(openai=True)
    lora: str | None = None
    #: the persona's voice examples; `messages` carries them too, as few-shot turns
    examples: tuple[VoiceExample, ...] = ()

    @property
    def conversation(self) -> tuple[Message, ...]:
        """The visitor's follow-up turns: what comes after the persona's own part of `messages`
        (its system prompt, a question and answer per example, the user prompt)."""
        return self.messages[2 + 2 * len(self.examples) :]

    def sampling(self) -> dict[str, float | int | str]:
        """The sampling fields that are set, under their Workers AI names."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One sampling field of GenerationRequest, as the rest of the project needs to know it."""

    name: str
    #: a whole number (top_k, seed), else any number
    integer: bool
    #: the OpenAI API takes it under the same name
    openai: bool
    #: the persona form's help text ("" for none)
    help_text: str


#: The sampling fields, in GenerationRequest's order, by name.
SAMPLING_FIELDS: dict[str, SamplingField] = {
    f.name: SamplingField(
        name=f.name,
        integer=f.metadata["integer"],
        openai=f.metadata["openai"],
        help_text=f.metadata["help_text"],
    )
    for f in dataclasses.fields(GenerationRequest)
    if f.metadata.get("sampling")
}

#: Everything about a persona that shapes what the model is sent: a change to any of these is a
#: new PersonaVersion (quotes.services.persona_save).
GENERATION_FIELDS: tuple[str, ...] = (
    "system_prompt",
    "user_prompt_template",
    "default_topic",
    "voice_examples",
    "backend",
    "model",
    "fallback_models",
    "lora",
    "max_tokens",
    *SAMPLING_FIELDS,
)


@dataclass(frozen=True, slots=True)
class Token:
    """A piece of generated text (already decoded; never a partial UTF-8 character)."""

    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Meta:
    """Facts about the stream known before or beside the text: the model that actually
    answered, upstream headers worth keeping (cf-aig-log-id, ...), and the gateway's own
    fallback `step` and `cache_status` ("HIT", "MISS" or "BYPASS") when it knows them."""

    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    cache_status: str | None = None
    #: the log row's public id (its permalink), known from the start of the stream
    generation_id: str | None = None

    def merged(self, later: Meta) -> Meta:
        """This Meta updated by a later one: later values win, headers accumulate."""
        return Meta(
            model=later.model or self.model,
            headers={**self.headers, **later.headers},
            step=self.step if later.step is None else later.step,
            cache_status=later.cache_status or self.cache_status,
            generation_id=later.generation_id or self.generation_id,
        )

    def response_headers(self) -> dict[str, str]:
        """Headers for the client: the upstream's, with the gateway's step and cache status.
        An answer from either cache (ours, or Cloudflare's gateway) reads as a HIT."""
        headers = dict(self.headers)
        if self.step is not None:
            headers["cf-aig-step"] = str(self.step)
        if self.cache_status and headers.get("cf-aig-cache-status", "").upper() != "HIT":
            headers["cf-aig-cache-status"] = self.cache_status
        return headers


@dataclass(frozen=True, slots=True)
class Done:
    """The stream ended normally."""


@dataclass(frozen=True, slots=True)
class Ping:
    """Nothing happened for a while: transports send a keep-alive so proxies hold the line."""


@dataclass(frozen=True, slots=True)
class Reconnect:
    """The process is going away (draining): resume elsewhere. A connection's last event, never
    in a run's log (the run ends with server_draining there)."""


Event = Token | Usage | Meta | Done | Error | Ping | Reconnect


# -- events as JSON (a live run's events in Redis, a finished run's in the cache) ------------------
#
# JSON, not pickle: whatever can write to Redis must not be able to run code in every process
# that reads it. A Token is its text (most events are tokens); any other event is a one-key
# object naming its kind. Reading back is strict (ValueError for anything else): a Meta becomes
# response headers and a permalink, so only the shapes written here, with values fit for those.

#: The upstream response headers a Meta may carry (lower-case prefixes): the backends keep these.
UPSTREAM_HEADERS = ("x-request-id", "cf-aig-", "openai-processing-ms")
_HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")
_HEADER_VALUE = re.compile(r"[^\x00-\x1f\x7f\ud800-\udfff]{0,512}")
# JSON's \u escapes can make lone surrogates, which no response can encode.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_META_FIELDS = {f.name for f in dataclasses.fields(Meta)}


def to_json(events: list[Event]) -> bytes:
    return json.dumps(encode_events(events), separators=(",", ":")).encode()


def from_json(data: bytes) -> list[Event]:
    """The events `to_json` wrote: ValueError for anything else."""
    try:
        return decode_events(json.loads(data))
    except RecursionError:
        raise ValueError("nested too deep") from None


def encode_events(events: Iterable[Event]) -> list[Any]:
    return [_encoded(event) for event in events]


def decode_events(items: object) -> list[Event]:
    """The events `encode_events` made: ValueError for anything else."""
    if not isinstance(items, list):
        raise ValueError("not a list of events")
    return [_decoded(item) for item in items]


def _encoded(event: Event) -> Any:
    match event:
        case Token(text):
            return text
        case Usage(prompt_tokens, completion_tokens):
            return {"usage": [prompt_tokens, completion_tokens]}
        case Meta():
            return {"meta": dataclasses.asdict(event)}
        case Error(code, message, status, retry_after):
            return {"error": [str(code), message, status, retry_after]}
        case Done():
            return {"done": None}
    return {"ping": None}


def _decoded(item: object) -> Event:
    if isinstance(item, str) and plain_text(item):
        return Token(item)
    if not isinstance(item, dict) or len(item) != 1:
        raise ValueError("not an event")
    [(kind, value)] = item.items()
    if kind == "usage" and isinstance(value, list) and len(value) == 2 and all(map(_count, value)):
        return Usage(*value)
    if kind == "meta" and isinstance(value, dict) and _is_meta(value):
        return Meta(**value)
    if kind == "error" and isinstance(value, list) and len(value) == 4:
        code, message, status, retry_after = value
        if (
            isinstance(code, str)
            and plain_text(message)
            and _count(status)
            and 400 <= status <= 599
            and (retry_after is None or _count(retry_after))
        ):
            return Error(ErrorCode(code), message, status, retry_after)
    if kind in ("done", "ping") and value is None:
        return Done() if kind == "done" else Ping()
    raise ValueError(f"not an event: {kind!r}")


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def plain_text(value: object) -> bool:
    """A str that encodes as UTF-8."""
    return isinstance(value, str) and _SURROGATE.search(value) is None


def header_safe(value: object) -> bool:
    """Fit for a response header's value (no control characters, bounded)."""
    return isinstance(value, str) and _HEADER_VALUE.fullmatch(value) is not None


def _is_meta(value: dict[str, Any]) -> bool:
    if value.keys() != _META_FIELDS:
        return False
    headers, step, generation_id = value["headers"], value["step"], value["generation_id"]
    return (
        header_safe(value["model"])
        and (value["cache_status"] is None or header_safe(value["cache_status"]))
        and (step is None or _count(step))
        and (
            generation_id is None or (isinstance(generation_id, str) and bool(_UUID.fullmatch(generation_id)))
        )
        and isinstance(headers, dict)
        and all(
            isinstance(name, str)
            and _HEADER_NAME.fullmatch(name) is not None
            and name.lower().startswith(UPSTREAM_HEADERS)
            and header_safe(text)
            for name, text in headers.items()
        )
    )
