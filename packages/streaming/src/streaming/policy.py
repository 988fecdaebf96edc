"""Retries and fallbacks, before the first token only, under one set of deadlines.

Each model in turn, each up to `max_attempts` times (after the upstream's Retry-After when it
gives one, else a backoff); after the first token a failure ends the stream (a retry would repeat
text). The deadlines live here and nowhere else: to the first token
(across every attempt, each getting an equal share of what is left), between tokens, and in
total. One timer per stream keeps them (`Watchdog`): an `asyncio.timeout` around each wait would
push and cancel a timer per token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from .events import Done, Error, Event, Meta

__all__ = ["Outcomes", "Policy", "generate"]


@dataclass(frozen=True, slots=True)
class Policy:
    max_attempts: int = 2
    retry_delay_s: float = 0.25
    backoff: str = "exponential"  # or "linear", "constant"
    ttft_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0
    total_timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class Outcomes:
    """The caller's words: which error codes are worth another attempt at the same model
    (`retryable`), which no other model would do better on (`final`), and the errors the policy
    ends a stream with itself."""

    retryable: frozenset[str]
    final: frozenset[str]
    #: no first token within its share of the first-token deadline
    first_token_timeout: Error
    #: no token for `idle_timeout_s` once text flowed
    idle_timeout: Error
    #: past `total_timeout_s`
    deadline: Error
    #: an attempt ended without a Done or an Error
    ended_early: Error

    def timeout(self, *, started: bool, total: bool) -> Error:
        return self.deadline if total else self.idle_timeout if started else self.first_token_timeout


async def generate(
    attempt: Callable[[str], AsyncGenerator[Event, None]],
    models: Sequence[str],
    policy: Policy,
    outcomes: Outcomes,
) -> AsyncGenerator[Event, None]:
    """`attempt(model)` under the policy: a Meta (the model that answers, its fallback step and
    upstream headers) once text flows, Tokens and Usage, then one Done or Error. A failure
    before any text ends with the last attempt's Meta (its headers belong in the log) and Error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.total_timeout_s
    first_token_deadline = min(deadline, loop.time() + policy.ttft_timeout_s)
    attempts_left = len(models) * policy.max_attempts
    error = outcomes.ended_early
    meta = Meta()
    watchdog = Watchdog(loop)
    try:
        for step, model in enumerate(models):
            for tried in range(policy.max_attempts):
                if tried:
                    growth = {"linear": tried, "exponential": 2 ** (tried - 1)}.get(policy.backoff, 1)
                    # The upstream's Retry-After, when it gave one; past the first-token deadline,
                    # the next model instead.
                    delay = max(policy.retry_delay_s * growth, error.retry_after or 0)
                    if loop.time() + delay >= first_token_deadline:
                        break
                    await asyncio.sleep(delay)
                now = loop.time()
                if now >= first_token_deadline:
                    error = outcomes.timeout(started=False, total=now >= deadline)
                    break
                first_token_by = now + (first_token_deadline - now) / attempts_left
                attempts_left -= 1
                meta, started = Meta(model=model, step=step), False
                async with aclosing(attempt(model)) as events:
                    while True:
                        due = loop.time() + policy.idle_timeout_s if started else first_token_by
                        watchdog.expect(min(due, deadline))
                        try:
                            event = await anext(events)
                        except StopAsyncIteration:
                            event = outcomes.ended_early
                        except asyncio.CancelledError:
                            if not watchdog.expired():
                                raise
                            event = outcomes.timeout(started=started, total=loop.time() >= deadline)
                        watchdog.release()
                        if type(event) is Meta:
                            meta = Meta(event.model or meta.model, {**meta.headers, **event.headers}, step)
                            continue
                        if type(event) is Error:
                            error = event
                            break
                        if not started:
                            started = True
                            yield meta
                        yield event
                        if type(event) is Done:
                            return
                if started:
                    yield error  # after text, never a retry: it would repeat text
                    return
                if loop.time() >= first_token_deadline or error.code not in outcomes.retryable:
                    break
            if loop.time() >= first_token_deadline or error.code in outcomes.final:
                break
    finally:
        watchdog.close()
    yield meta
    yield error


class Watchdog:
    """One timer for a task's successive deadlines. `expect(when)` guards the wait that follows,
    `release()` ends it; on expiry the task is cancelled and `expired()` says it was this. The
    timer fires at most once per deadline period (it re-arms itself when the deadline moved on),
    not once per wait."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_loop", "_task", "_when", "deadline", "guarding")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._loop, self._task = loop, task
        self._handle: asyncio.TimerHandle | None = None
        self._when = math.inf
        self._fired = False
        self._cancelling = 0
        self.deadline = math.inf
        self.guarding = False

    def expect(self, deadline: float) -> None:
        self.deadline, self.guarding = deadline, True
        if deadline < self._when:
            self._arm(deadline)

    def release(self) -> None:
        self.guarding = False

    def expired(self) -> bool:
        """On a CancelledError from a guarded wait: was it this deadline (not a real cancel)?"""
        self.guarding = False
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self.guarding = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle, self._when = None, math.inf

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._when = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle, self._when = None, math.inf
        if not self.guarding:
            return
        if self._loop.time() < self.deadline:
            self._arm(self.deadline)
            return
        self._fired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()
