"""Flights: one upstream call in progress, shared by every generation that asked the same thing.

    listener (one per connection)  <-  run (one per generation)  <-  flight (one per upstream call)  <-  policy

A flight runs the retry/fallback policy in a task of its own and hands each event, in that task
and synchronously, to every run attached to it (quotes.ai.gateway.runs): a run is a few field
updates and a list append per token, so there is no extra task hop between the upstream read
and the connections reading a run. A flight with a key (the answer cache's) keeps every event
it publishes (`history`), so a generation that asks the same thing while it is in flight
shares its upstream call and still gets the whole text from the start. When the last run
leaves (it was stopped, or abandoned after its grace) the flight is cancelled, which closes
the upstream connection or stops the model thread at once, and it leaves the registry at that
moment (a request arriving while it unwinds starts a flight of its own).

The flight runs in its own task, not in a connection's, so that a connection that leaves (its
client disconnected) stops nothing by itself: its run decides (see runs.py), and the
connections are free to send keep-alive pings while the upstream is silent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from ..cache import store_answer
from ..errors import internal
from ..events import Done, Event, Token
from . import shared_runs
from .policy import Plan, generate
from .tasks import detached_task

logger = logging.getLogger(__name__)


class Reader(Protocol):
    """What a flight feeds (quotes.ai.gateway.runs.Run): each event, synchronously."""

    def feed(self, event: Event) -> None: ...

    def calls_upstream(self) -> None:
        """The flight calls the upstream itself after all (it followed another process's call)."""


class Flight:
    def __init__(self, key: str | None, ttl: int = 0) -> None:
        #: the answer cache's key: a flight with one is joined by identical requests, and its
        #: complete answer is kept for `ttl` seconds
        self.key = key
        self.ttl = ttl
        #: every event so far, for a run that joins late (kept only when the flight has a key)
        self.history: list[Event] = []
        self.runs: list[Reader] = []
        self.task: asyncio.Task[None] | None = None

    def register(self) -> None:
        """Under `key` (when it has one), so that identical requests join it."""
        if self.key is not None:
            flights[self.key] = self

    def start(self, plan: Plan) -> None:
        """Run `plan` in a task of its own; registered under `key` (when it has one) so that
        identical requests join it."""
        self.register()
        self.task = detached_task(self._fly(plan))

    def follow_elsewhere(self, events: AsyncIterator[Event], plan: Plan) -> None:
        """Publish `events` (another process's upstream call, read from Redis: shared_runs.follow)
        instead of calling the upstream; registered like a flight of this process's own. If that
        call's owner gives up on it (its client left, it drained) or dies before a token came,
        call the upstream with `plan` after all; after a token, the generation is lost."""
        self.register()
        self.task = detached_task(self._follow(events, plan))

    async def _follow(self, events: AsyncIterator[Event], plan: Plan) -> None:
        try:
            async for event in events:
                self.publish(event)
        except asyncio.CancelledError:
            raise
        except shared_runs.OwnerGone:
            if any(type(event) is Token for event in self.history):
                self.publish(shared_runs.generation_lost())
            else:
                if self.runs:  # this process's own call now: one of its rows counts it
                    self.runs[0].calls_upstream()
                await self._fly(plan)
        except Exception:
            logger.exception("following another process's generation failed")
            self.publish(internal())
        finally:
            self.unregister()

    def join(self, run: Reader) -> None:
        """Attach `run`: it gets what the flight has published so far, then each event as it comes."""
        for event in self.history:
            run.feed(event)
        self.runs.append(run)

    def leave(self, run: Reader) -> None:
        if run in self.runs:
            self.runs.remove(run)
        if not self.runs and self.task is not None and not self.task.done():
            # Out of the registry now, not once the task has unwound: a request arriving while
            # the upstream is being closed must start a flight of its own, not join a dead one.
            self.unregister()
            self.task.cancel()  # nobody is reading: stop the upstream now

    def unregister(self) -> None:
        if self.key is not None and flights.get(self.key) is self:  # never a newer flight's entry
            del flights[self.key]

    def publish(self, event: Event) -> None:
        if self.key is not None:
            self.history.append(event)
        for run in self.runs:
            run.feed(event)

    async def _fly(self, plan: Plan) -> None:
        try:
            async for event in generate(plan):
                if self.key is not None and type(event) is Done:
                    # Cached before [DONE] goes out: a client that has seen the end can count on it.
                    await store_answer(self.key, self.history, ttl=self.ttl)
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
