"""Complete answers: kept in the cache once a flight reaches Done, replayed as the same stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from ..cache import CachedAnswer, store_answer
from ..events import Done, Event, Meta, Token, Usage
from ..redis_health import report

logger = logging.getLogger(__name__)


async def store(key: str, history: list[Event], *, ttl: int) -> None:
    try:
        await store_answer(key, answer_from(history), ttl=ttl)
    except Exception as exc:  # a cache that is down costs a future hit, never this answer
        report(logger, "could not cache an answer", exc)


def answer_from(history: list[Event]) -> CachedAnswer:
    model, step, usage = "", 0, None
    tokens = []
    for event in history:
        if type(event) is Token:
            tokens.append(event.text)
        elif type(event) is Meta:
            model = event.model or model
            step = event.step if event.step is not None else step
        elif type(event) is Usage:
            usage = event
    return CachedAnswer(
        model=model,
        tokens=tuple(tokens),
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        step=step,
    )


async def replay(answer: CachedAnswer, *, pacing: float) -> AsyncGenerator[Event, None]:
    """The answer as a stream: one token every `pacing` seconds, so it still reads as writing."""
    yield Meta(model=answer.model, step=answer.step)
    for index, text in enumerate(answer.tokens):
        if pacing and index:
            await asyncio.sleep(pacing)
        yield Token(text)
    if answer.prompt_tokens is not None and answer.completion_tokens is not None:
        yield Usage(prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens)
    yield Done()
