"""The retry and fallback policy: each model in turn, each up to `max_attempts` times, before the
first token only (after it a failure ends the stream: text is never repeated). It is the only
place deadlines live: to the first token (across every attempt, each getting an equal share of
what is left), between tokens, and in total, kept by one Watchdog; a backend keeps none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace

from django.conf import settings

from ... import metrics
from ...models import Persona
from ..backends import Backend
from ..errors import ErrorCode, internal, upstream_timeout
from ..events import Done, Error, Event, GenerationRequest, Message, Meta
from ..voice import guard_copies
from ..watchdog import Watchdog

#: Errors worth another attempt at the same model (before the first token only).
RETRYABLE = frozenset(
    {
        ErrorCode.UPSTREAM_UNREACHABLE,
        ErrorCode.UPSTREAM_UNAVAILABLE,
        ErrorCode.UPSTREAM_CAPACITY,
        ErrorCode.UPSTREAM_TIMEOUT,
        ErrorCode.UPSTREAM_DROPPED,
    }
)
#: Errors another model would not fix: no fallback for these.
NOT_FOR_FALLBACK = frozenset(
    {ErrorCode.UPSTREAM_AUTH, ErrorCode.BUSY, ErrorCode.REQUEST_TOO_LARGE, ErrorCode.CONTEXT_WINDOW_EXCEEDED}
)


@dataclass(slots=True)
class Plan:
    """What a flight generates: the persona's request for each model to try, in order."""

    backend: Backend
    persona: Persona
    topic: str
    messages: tuple[Message, ...]
    #: the request for the persona's own model (built once, by the caller)
    primary: GenerationRequest
    models: list[str]


async def generate(plan: Plan) -> AsyncGenerator[Event, None]:
    """Meta (the model that answers, once text flows), then Tokens and Usage, then one Done or
    Error. After a failure with no text, the last attempt's Meta (its upstream headers, such as
    cf-aig-log-id, belong in the log) and the Error."""
    options = settings.QUOTES_GATEWAY
    loop = asyncio.get_running_loop()
    deadline = loop.time() + options.total_timeout_s
    first_token_deadline = loop.time() + options.ttft_timeout_s
    give_up_at = min(deadline, first_token_deadline)  # before the first token
    attempts_left = len(plan.models) * options.max_attempts
    error: Error = internal()
    meta = Meta()
    watchdog = Watchdog()
    try:
        for step, model in enumerate(plan.models):
            for attempt in range(options.max_attempts):
                if attempt:
                    growth = {"linear": attempt, "exponential": 2 ** (attempt - 1)}.get(options.backoff, 1)
                    await asyncio.sleep(options.retry_delay_ms / 1000 * growth)
                if loop.time() >= first_token_deadline:
                    error = timeout_error(started=False, total=False)
                    break
                request = plan.primary
                if model != plan.primary.model:
                    request = plan.persona.build_request(
                        topic=plan.topic, messages=plan.messages, model=model
                    )
                meta = Meta(model=plan.backend.model_name(model), step=step)
                metrics.attempt_started(
                    backend=plan.backend.name, model=meta.model, step=step, attempt=attempt
                )
                started = False
                # From the request, not from the headers: an upstream's Meta does not restart it.
                now = loop.time()
                first_token_by = now + (first_token_deadline - now) / attempts_left
                attempts_left -= 1
                # Whatever the backend, a quote never copies one of the persona's examples.
                stream = guard_copies(plan.backend.stream(request), request.examples)
                async with aclosing(stream) as events:
                    while True:
                        due = loop.time() + options.idle_timeout_s if started else first_token_by
                        watchdog.expect(due if due < deadline else deadline)
                        try:
                            event = await anext(events)
                        except StopAsyncIteration:
                            event = internal("The model ended without finishing the quote.")
                        except asyncio.CancelledError:
                            if not watchdog.expired():
                                raise
                            event = timeout_error(started=started, total=loop.time() >= deadline)
                        watchdog.release()
                        if type(event) is Meta:
                            # Upstream headers are kept; the step and the answering model are ours.
                            meta = replace(meta, headers={**meta.headers, **event.headers})
                            continue
                        if type(event) is Error:
                            error = event
                            break
                        if not started:
                            started = True
                            yield meta  # the model that answers is known once text flows
                        yield event
                        if type(event) is Done:
                            return
                if started:
                    yield error  # after text, never retry or fall back: that would repeat text
                    return
                if loop.time() >= give_up_at or error.code not in RETRYABLE:
                    break  # out of time, or this model will not do better on a second try
            if loop.time() >= give_up_at or error.code in NOT_FOR_FALLBACK:
                break
    finally:
        watchdog.close()
    yield meta  # the last attempt's upstream headers (its cf-aig-log-id) belong in the log
    yield error


def timeout_error(*, started: bool, total: bool) -> Error:
    if total:
        return Error(ErrorCode.DEADLINE_EXCEEDED, "The quote took too long to write.", 504)
    if started:
        return Error(ErrorCode.IDLE_TIMEOUT, "The model stopped writing mid-quote.", 504)
    return upstream_timeout("The model took too long to start writing.")
