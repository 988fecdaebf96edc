"""The typed events of a generation. A source yields them; only the transports turn them into
bytes or frames. A stream is Meta, Token and Usage events, then exactly one Done or Error."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Done", "Error", "Event", "Meta", "Ping", "Token", "Usage", "from_json", "merged", "to_json"]


@dataclass(frozen=True, slots=True)
class Token:
    """A piece of generated text (already decoded: never a partial UTF-8 character)."""

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
    """Facts known beside the text: the model that answered, upstream headers worth keeping, the
    fallback `step` (0: the first model), the `cache_status` (HIT, MISS or BYPASS) and the
    stream's `id`. A later Meta updates an earlier one (`merged`)."""

    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    cache_status: str | None = None
    id: str | None = None

    def merged(self, later: Meta) -> Meta:
        return Meta(
            model=later.model or self.model,
            headers={**self.headers, **later.headers},
            step=self.step if later.step is None else later.step,
            cache_status=later.cache_status or self.cache_status,
            id=later.id or self.id,
        )


@dataclass(frozen=True, slots=True)
class Done:
    """The stream ended normally."""


@dataclass(frozen=True, slots=True)
class Error:
    """The stream failed: a stable `code`, a `message` for people, the HTTP `status` to answer
    with while no byte is sent, and `retry_after` (seconds) when trying again makes sense."""

    code: str
    message: str
    status: int = 502
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class Ping:
    """Nothing happened for a while: a keep-alive, so proxies hold the line. Carries no id."""


Event = Token | Usage | Meta | Done | Error | Ping


def merged(events: Iterable[Event]) -> Meta:
    """What the Meta events among `events` say, in order."""
    meta = Meta()
    for event in events:
        if type(event) is Meta:
            meta = meta.merged(event)
    return meta


# -- a finished answer as JSON (a cache of answers) -------------------------------------------
# JSON, never pickle: whoever can write to the cache must not run code here. A Token is its text;
# any other event a one-key object. Reading back is strict: anything else is a ValueError.

_HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")
_HEADER_VALUE = re.compile(r"[^\x00-\x1f\x7f\ud800-\udfff]{0,512}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def to_json(events: Iterable[Event]) -> list[Any]:
    out: list[Any] = []
    for event in events:
        if type(event) is Token:
            out.append(event.text)
        elif type(event) is Usage:
            out.append({"usage": [event.prompt_tokens, event.completion_tokens]})
        elif type(event) is Meta:
            out.append({"meta": {"model": event.model, "headers": event.headers, "step": event.step}})
        elif type(event) is Done:
            out.append({"done": None})
    return out


def from_json(items: object) -> list[Event]:
    if not isinstance(items, list):
        raise ValueError("not a list of events")
    return [_event(item) for item in items]


def _event(item: object) -> Event:
    if isinstance(item, str) and not _SURROGATE.search(item):
        return Token(item)
    if not isinstance(item, dict) or len(item) != 1:
        raise ValueError("not an event")
    [(kind, value)] = item.items()
    if kind == "done" and value is None:
        return Done()
    if kind == "usage" and isinstance(value, list) and len(value) == 2 and all(map(_count, value)):
        return Usage(*value)
    if kind == "meta" and isinstance(value, dict) and _is_meta(value):
        return Meta(**value)
    raise ValueError(f"not an event: {kind!r}")


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def header_safe(value: object) -> bool:
    return isinstance(value, str) and _HEADER_VALUE.fullmatch(value) is not None


def _is_meta(value: dict[str, Any]) -> bool:
    headers, step = value.get("headers"), value.get("step")
    return (
        value.keys() == {"model", "headers", "step"}
        and header_safe(value["model"])
        and (step is None or _count(step))
        and isinstance(headers, dict)
        and all(
            isinstance(name, str) and _HEADER_NAME.fullmatch(name) is not None and header_safe(text)
            for name, text in headers.items()
        )
    )
