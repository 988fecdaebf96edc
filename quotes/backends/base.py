"""What every backend shares: the request it takes (GenerationRequest) and the shape it has
(Backend). A backend knows no Django models or responses."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from streaming import Event

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class VoiceExample:
    """One line in a persona's voice, on its own topic ("" when none)."""

    topic: str
    text: str


_HELP = "Leave empty for the model's default. The allowed range depends on the model."


def _sampling(*, integer: bool = False, openai: bool, help_text: str = _HELP) -> Any:
    """A field named the same on Persona, in Workers AI's body and in the catalog's ranges;
    `openai`: the OpenAI API takes it under that name too."""
    metadata = {"sampling": True, "integer": integer, "openai": openai, "help_text": help_text}
    return field(default=None, metadata=metadata)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What one generation asks of a backend.

    `messages` is the chat a cloud model receives: the system prompt, a user and an assistant
    turn per voice example, the user prompt for `topic`, then the visitor's conversation. The
    embedded base model, on which chat prompts fail, builds its own frame from `speaker`,
    `description`, `topic` and `examples` instead."""

    model: str
    messages: tuple[Message, ...]
    speaker: str
    topic: str
    description: str = ""
    max_tokens: int = 256
    temperature: float | None = _sampling(openai=True, help_text="")
    top_p: float | None = _sampling(openai=True)
    top_k: int | None = _sampling(integer=True, openai=False)
    seed: int | None = _sampling(integer=True, openai=True)
    repetition_penalty: float | None = _sampling(openai=False)
    frequency_penalty: float | None = _sampling(openai=True)
    presence_penalty: float | None = _sampling(openai=True)
    lora: str | None = None
    examples: tuple[VoiceExample, ...] = ()

    @property
    def conversation(self) -> tuple[Message, ...]:
        """The visitor's follow-up turns."""
        return self.messages[2 + 2 * len(self.examples) :]

    def sampling(self) -> dict[str, float | int | str]:
        """The sampling fields that are set, under their Workers AI names."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, slots=True)
class SamplingField:
    name: str
    integer: bool
    openai: bool
    help_text: str


SAMPLING_FIELDS: dict[str, SamplingField] = {
    f.name: SamplingField(f.name, f.metadata["integer"], f.metadata["openai"], f.metadata["help_text"])
    for f in dataclasses.fields(GenerationRequest)
    if f.metadata.get("sampling")
}

#: Everything about a persona that shapes what the model is sent: a change is a new version.
GENERATION_FIELDS: tuple[str, ...] = (
    *("system_prompt", "user_prompt_template", "default_topic", "voice_examples", "backend"),
    *("model", "fallback_models", "lora", "max_tokens"),
    *SAMPLING_FIELDS,
)


class Backend(Protocol):
    #: its name in settings and in the log: "local", "workers-ai", "openai"
    name: str
    #: whether its answers are billed (the spend ceiling counts them)
    paid: bool

    def stream(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        """Meta, Token and Usage events, then exactly one Done or Error. Cancelled (the task,
        or the consumer closing it), it stops the upstream work at once."""
        ...

    def model_name(self, requested: str) -> str:
        """The model that actually answers a request for `requested`."""
        ...

    async def aclose(self) -> None: ...
