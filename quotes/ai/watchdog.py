"""One timer per stream for its deadlines, instead of an `asyncio.timeout` around every wait.

`asyncio.timeout()` pushes a `TimerHandle` onto the event loop's heap when it is entered and
cancels it when it is left: per token, per layer that guards a wait. On the stream path that was
three timers per token (the backend's deadline, the gateway's first-token/idle timeout and the
listener's keep-alive), about 30 % of the CPU spent per token. A stream's deadlines mostly move
forward ("the last event + N s"), so one timer per stream does: each wait stores its deadline
(two attribute stores), and the timer, when it fires before the deadline it finds, re-arms
itself once at that deadline. It fires at most about once per timeout period, not per token.

    watchdog = Watchdog()
    try:
        while ...:
            watchdog.expect(deadline)            # the wait that follows must end by then
            try:
                event = await anext(events)      # the guarded wait
            except asyncio.CancelledError:
                if not watchdog.expired():
                    raise                        # a real cancellation: pass it on
                ...                              # the deadline passed
            watchdog.release()                   # not guarding anything until the next expect()
    finally:
        watchdog.close()

Expiry cancels the task (as `asyncio.timeout` does, and with the same `Task.uncancel()`
bookkeeping, so an outside cancellation is told apart from its own). It only
fires while a wait is guarded: never while the task is between waits, e.g. handing an event on.
"""

from __future__ import annotations

import asyncio
import math


class Watchdog:
    __slots__ = ("_cancelling", "_fired", "_handle", "_loop", "_task", "_when", "deadline", "guarding")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Watchdog guards the waits of a task")
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._when = math.inf  # when the armed timer fires
        self._fired = False
        self._cancelling = 0
        self.deadline = math.inf
        self.guarding = False

    def expect(self, deadline: float) -> None:
        """The wait that follows must end by `deadline` (the loop's clock)."""
        self.deadline = deadline
        self.guarding = True
        if deadline < self._when:  # the first wait, or a deadline earlier than the armed timer
            self._arm(deadline)

    def release(self) -> None:
        """The guarded wait is over."""
        self.guarding = False

    def expired(self) -> bool:
        """Call on CancelledError from a guarded wait: True when this watchdog caused it (the
        deadline passed), False when someone else cancelled the task."""
        self.guarding = False
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self.guarding = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._when = math.inf

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._when = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._when = math.inf
        if not self.guarding:
            return  # between waits: the next expect() arms the timer again
        if self._loop.time() < self.deadline:
            self._arm(self.deadline)  # the deadline moved on since the timer was set
            return
        self._fired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()
