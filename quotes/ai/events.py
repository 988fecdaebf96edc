"""The typed events every backend yields, and the request every backend takes.

A backend is an async iterator of these events. Only the view layer turns them into bytes
(SSE, htmx fragments or WebSocket frames), so every transport sees the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .errors import ErrorCode

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What one generation asks of a backend, whatever the backend.

    `messages` is the chat a cloud model receives: the persona's system prompt first, then the
    user turns. `speaker`, `description` and `topic` let a base model (the embedded one) build its own
    completion frame instead of a chat, since chat prompts fail on it.
    """

    model: str
    messages: tuple[Message, ...]
    speaker: str
    topic: str
    #: the persona's description: the embedded model's frame uses it, chat models do not
    description: str = ""
    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    lora: str | None = None

    def sampling(self) -> dict[str, float | int | str]:
        """The sampling fields that are set, under their Workers AI names."""
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        return {name: value for name, value in fields.items() if value is not None}


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
class Error:
    """The stream failed. `code` is stable and machine-readable, `message` is for people,
    `status` is the HTTP status to answer with when no byte has been sent yet, and
    `retry_after` (seconds) says when trying again makes sense."""

    code: ErrorCode
    message: str
    status: int = 502
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class Ping:
    """Nothing happened for a while: transports send a keep-alive so proxies hold the line."""


Event = Token | Usage | Meta | Done | Error | Ping
