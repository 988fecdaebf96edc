"""Flights: one generation in progress, shared by every request that asked the same thing.

    listener (one per request)  <-  flight (one per distinct request in flight)  <-  policy

A flight runs the retry/fallback policy in a task of its own and keeps every event it publishes
(`history`), so identical requests arriving together share one upstream call and a late one
still gets the whole text from the start. When the last listener goes away the flight is
cancelled, which closes the upstream connection or stops the model thread at once, and it
leaves the registry at that moment (a request arriving while it unwinds starts a flight of its
own).

The flight runs in its own task, not in its first listener's, for two reasons: a listener that
leaves (its client disconnected) must not stop the text for the others, and a listener must be
free to send keep-alive pings while the upstream is silent, which a task blocked on the
upstream read cannot. So each event crosses from the flight's task to each listener's. That
hop is cheap: a listener reads the flight's history by index and is woken through one future
when it has caught up (no queue, no per-listener copy of the events), and its timers (the
keep-alive and its own deadlines) are one TimerHandle that re-arms itself about once per
keep-alive interval, not per token.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable

from asgiref.sync import SyncToAsync

from ..errors import internal
from ..events import Done, Error, Event, Ping, Token
from .policy import Plan, generate, timeout_error

logger = logging.getLogger(__name__)

#: How much longer than its flight a listener waits, so a live flight's own error comes first.
LISTENER_GRACE_S = 1.0


class Flight:
    def __init__(self, key: str | None, *, first_token_s: float) -> None:
        self.key = key
        #: the longest this flight can take to its first token or its error, alive
        self.first_token_s = first_token_s
        self.history: list[Event] = []
        self.listeners: set[Listener] = set()
        self.task: asyncio.Task[None] | None = None

    def start(self, plan: Plan, store: Callable[[list[Event]], Awaitable[None]] | None = None) -> None:
        """Run `plan` in a task of its own; registered under `key` (when it has one) so that
        identical requests join it. `store` keeps a complete answer before Done goes out."""
        if self.key is not None:
            flights[self.key] = self
        # Not in the request's thread-sensitive context: the flight may outlive that request.
        context = contextvars.copy_context()
        context.run(SyncToAsync.thread_sensitive_context.set, None)  # type: ignore[arg-type]
        self.task = asyncio.create_task(self._fly(plan, store), context=context)

    def subscribe(self, *, keepalive_s: float, idle_s: float) -> Listener:
        listener = Listener(self, keepalive_s=keepalive_s, idle_s=idle_s)
        self.listeners.add(listener)
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        self.listeners.discard(listener)
        if not self.listeners and self.task is not None and not self.task.done():
            # Out of the registry now, not once the task has unwound: a request arriving while
            # the upstream is being closed must start a flight of its own, not join a dead one.
            self.unregister()
            self.task.cancel()  # nobody is reading: stop the upstream now

    def unregister(self) -> None:
        if self.key is not None and flights.get(self.key) is self:  # never a newer flight's entry
            del flights[self.key]

    def publish(self, event: Event) -> None:
        self.history.append(event)
        for listener in self.listeners:
            waiter = listener.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _fly(self, plan: Plan, store: Callable[[list[Event]], Awaitable[None]] | None) -> None:
        try:
            async for event in generate(plan):
                if store is not None and type(event) is Done:
                    # Cached before [DONE] goes out: a client that has seen the end can count on it.
                    await store(self.history)
                self.publish(event)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("generation failed for persona %s", plan.persona.slug)
            self.publish(internal())
        finally:
            self.unregister()


#: Flights that identical requests may join, by answer-cache key.
flights: dict[str, Flight] = {}


class Listener:
    """One request's view of a flight: its events from the start, keep-alive pings while it is
    quiet, and deadlines of its own (to the first token, then between events) so that whatever
    becomes of the flight, the request ends with the timeout error the flight would give."""

    __slots__ = (
        "_handle",
        "_ping_due",
        "_quiet_since",
        "_timed_out",
        "deadline",
        "flight",
        "idle_s",
        "index",
        "keepalive_s",
        "started",
        "waiter",
    )

    def __init__(self, flight: Flight, *, keepalive_s: float, idle_s: float) -> None:
        self.flight = flight
        self.keepalive_s = keepalive_s
        self.idle_s = idle_s
        self.index = 0  # the next event of the flight's history to hand on
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.deadline = math.inf
        self._quiet_since = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._ping_due = False
        self._timed_out = False

    async def events(self) -> AsyncGenerator[Event, None]:
        loop = asyncio.get_running_loop()
        history = self.flight.history
        now = loop.time()
        self._quiet_since = now
        self.deadline = now + self.flight.first_token_s + LISTENER_GRACE_S
        try:
            while True:
                if self.index < len(history):
                    event = history[self.index]
                    self.index += 1
                    if self.index == len(history) and self.flight.key is None:
                        # Nobody can join a flight without a key: what its one listener has
                        # read is not kept (a stream may run for minutes).
                        history.clear()
                        self.index = 0
                    kind = type(event)
                    if kind is Token:
                        self.started = True
                    now = loop.time()
                    self._quiet_since = now
                    if self.started:
                        self.deadline = now + self.idle_s + LISTENER_GRACE_S
                    yield event
                    if kind is Done or kind is Error:
                        return
                    continue
                self.waiter = loop.create_future()
                if self._handle is None:
                    self._arm(loop)
                try:
                    await self.waiter
                finally:
                    self.waiter = None
                if self._timed_out:
                    yield timeout_error(started=self.started, total=False)
                    return
                if self._ping_due:
                    self._ping_due = False
                    yield Ping()
        finally:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            self.flight.unsubscribe(self)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        due = min(self._quiet_since + self.keepalive_s, self.deadline)
        self._handle = loop.call_at(due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """The one timer: re-armed at the next due time while the listener is waiting; left
        off while it is busy (the next wait arms it again)."""
        self._handle = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        now = loop.time()
        if now >= self.deadline:
            self._timed_out = True
            waiter.set_result(None)
        elif now >= self._quiet_since + self.keepalive_s:
            self._quiet_since = now  # the next ping, another interval on
            self._ping_due = True
            waiter.set_result(None)
        else:
            self._arm(loop)
