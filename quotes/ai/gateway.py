"""The path every generation takes, whatever the transport (HTTP, EventSource, WebSocket) and
whatever the backend: rate limits, cache, coalescing, retries, fallbacks, timeouts, keep-alive,
and one `Generation` log row on every outcome, a client disconnect included.

How a request flows:

    listener (one per request)  <-  flight (one per distinct request in flight)  <-  backend

A *flight* runs the backend in a task of its own and publishes each event to every listener,
so identical requests arriving together share one upstream call. Retries and fallbacks happen
inside the flight, and only before the first token; once text has flowed, a failure ends the
stream with an error and never repeats text. When the last listener goes away the flight is
cancelled, which closes the upstream connection or stops the model thread at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import OperationalError

from .. import metrics
from ..models import Generation, Persona, PersonaVersion
from ..security import client_address
from . import limits
from .backends import Backend, get_backend
from .cache import CachedAnswer, answer_key, get_answer, store_answer
from .catalog import estimate_cost
from .errors import internal
from .events import Done, Error, Event, GenerationRequest, Message, Meta, Ping, Token, Usage
from .refusals import record_refusal

logger = logging.getLogger(__name__)

#: Errors worth another attempt at the same model (before the first token only).
RETRYABLE = frozenset(
    {
        "upstream_unreachable",
        "upstream_unavailable",
        "upstream_capacity",
        "upstream_timeout",
        "upstream_dropped",
    }
)
#: Errors another model would not fix: no fallback for these.
NOT_FOR_FALLBACK = frozenset({"upstream_auth", "busy", "request_too_large", "context_window_exceeded"})


@dataclass(frozen=True, slots=True)
class Client:
    """Who is asking: the user when logged in, else a salted hash of the IP (of its network for IPv6)."""

    key: str
    ip_hash: str
    user_id: int | None = None

    @classmethod
    def from_request(cls, ip: str, user_id: int | None = None) -> Client:
        ip = client_address(ip)  # an IPv6 address counts as its /64 (QUOTES_IPV6_PREFIX)
        ip_hash = hmac.new(settings.SECRET_KEY.encode(), ip.encode(), hashlib.sha256).hexdigest()[:32]
        return cls(key=f"user:{user_id}" if user_id else f"ip:{ip_hash}", ip_hash=ip_hash, user_id=user_id)


ANONYMOUS = Client(key="local", ip_hash="")


# --- flights ------------------------------------------------------------------------------


class _Flight:
    """One generation in progress, shared by every listener that asked for the same thing."""

    def __init__(self, key: str | None, *, first_token_s: float) -> None:
        self.key = key
        #: the longest this flight can take to its first token or its error, alive
        self.first_token_s = first_token_s
        self.history: list[Event] = []
        self.listeners: set[asyncio.Queue[Event]] = set()
        self.task: asyncio.Task[None] | None = None

    def subscribe(self) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        for event in self.history:  # a late listener gets the text so far, then the rest live
            queue.put_nowait(event)
        self.listeners.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        self.listeners.discard(queue)
        if not self.listeners and self.task is not None and not self.task.done():
            # Out of the registry now, not once the task has unwound: a request arriving while
            # the upstream is being closed must start a flight of its own, not join a dead one.
            self.unregister()
            self.task.cancel()  # nobody is reading: stop the upstream now

    def unregister(self) -> None:
        if self.key is not None and _flights.get(self.key) is self:  # never a newer flight's entry
            del _flights[self.key]

    def publish(self, event: Event) -> None:
        self.history.append(event)
        for queue in self.listeners:
            queue.put_nowait(event)


_flights: dict[str, _Flight] = {}


@dataclass(slots=True)
class _Plan:
    backend: Backend
    persona: Persona
    topic: str
    messages: tuple[Message, ...]
    models: list[str]
    cache_key: str | None
    cache_ttl: int


async def _fly(flight: _Flight, plan: _Plan) -> None:
    try:
        async for event in _generate(plan):
            if type(event) is Done and plan.cache_key:
                # Cached before [DONE] goes out: a client that has seen the end can count on it.
                await _store(plan, flight.history)
            flight.publish(event)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("generation failed for persona %s", plan.persona.slug)
        flight.publish(internal())
    finally:
        flight.unregister()


async def _store(plan: _Plan, history: list[Event]) -> None:
    assert plan.cache_key is not None
    try:
        await store_answer(plan.cache_key, _answer_from(history), ttl=plan.cache_ttl)
    except Exception:  # a cache that is down costs a future hit, never this answer
        logger.exception("could not cache an answer")


def _answer_from(history: list[Event]) -> CachedAnswer:
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


async def _generate(plan: _Plan) -> AsyncGenerator[Event, None]:
    """Try each model in turn (the step), each up to max_attempts times, until text flows."""
    options = settings.QUOTES_GATEWAY
    loop = asyncio.get_running_loop()
    deadline = loop.time() + options["total_timeout_s"]
    error: Error = internal()
    for step, model in enumerate(plan.models):
        for attempt in range(options["max_attempts"]):
            if attempt:
                await asyncio.sleep(_retry_delay(attempt, options))
            request = plan.persona.build_request(topic=plan.topic, messages=plan.messages, model=model)
            meta = Meta(model=plan.backend.model_name(model), step=step)
            metrics.attempt_started(backend=plan.backend.name, model=meta.model, step=step, attempt=attempt)
            started = False
            # From the request, not from the headers: an upstream's Meta does not restart it, so
            # a listener can tell how long a live flight may take (`_first_token_budget`).
            first_token_by = loop.time() + options["ttft_timeout_s"]
            async with aclosing(plan.backend.stream(request)) as events:
                while True:
                    if started:
                        wait = min(options["idle_timeout_s"], deadline - loop.time())
                    else:
                        wait = min(first_token_by, deadline) - loop.time()
                    try:
                        async with asyncio.timeout(wait):
                            event = await anext(events)
                    except TimeoutError:
                        event = _timeout_error(started=started, total=loop.time() >= deadline)
                    except StopAsyncIteration:
                        event = internal("The model ended without finishing the quote.")
                    if type(event) is Meta:
                        # Upstream headers are kept; the step and the answering model are ours.
                        meta = Meta(model=meta.model, headers={**meta.headers, **event.headers}, step=step)
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
            if loop.time() >= deadline:
                break
            if error.code not in RETRYABLE:
                break  # this model will not do better on a second try
        if error.code in NOT_FOR_FALLBACK or loop.time() >= deadline:
            break
    yield meta  # the last attempt's upstream headers (its cf-aig-log-id) belong in the log
    yield error


def _retry_delay(attempt: int, options: dict[str, Any]) -> float:
    base = options["retry_delay_ms"] / 1000
    if options["backoff"] == "linear":
        return base * attempt
    if options["backoff"] == "exponential":
        return base * 2 ** (attempt - 1)
    return base


def _first_token_budget(models: int, options: dict[str, Any]) -> float:
    """The longest a live flight takes to its first token or its error: every model, each
    attempt up to the first-token timeout with the retry delays between, within the total
    (which a retry's delay may overrun)."""
    attempts = options["max_attempts"]
    delays = sum(_retry_delay(attempt, options) for attempt in range(1, attempts))
    return min(models * (attempts * options["ttft_timeout_s"] + delays), options["total_timeout_s"] + delays)


def _timeout_error(*, started: bool, total: bool) -> Error:
    if total:
        return Error("deadline_exceeded", "The quote took too long to write.", 504)
    if started:
        return Error("idle_timeout", "The model stopped writing mid-quote.", 504)
    return Error("upstream_timeout", "The model took too long to start writing.", 504)


# --- listeners: one per request -----------------------------------------------------------


@dataclass(slots=True)
class _Record:
    """What the log row needs, gathered while the stream flows (one append per token)."""

    started: float
    parts: list[str] = field(default_factory=list)
    ttft: float | None = None
    usage: Usage | None = None
    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    step: int = 0
    status: str = ""
    error: Error | None = None
    cache_status: str = ""
    public_id: str = field(default_factory=lambda: str(uuid.uuid4()))


async def stream_generation(
    *,
    persona: Persona,
    topic: str,
    messages: tuple[Message, ...] = (),
    client: Client = ANONYMOUS,
    preview: bool = False,
    bypass_cache: bool = False,
    transport: str = "other",
) -> AsyncGenerator[Event, None]:
    """Stream one generation for `persona` and log it. Ends with exactly one Done or Error.

    `preview` (an admin trying unsaved values) is logged as such and never cached;
    `bypass_cache` asks for a fresh answer (the page's "new quote" button); `transport` names
    the way the client reads the stream, for the metrics ("api", "htmx", "websocket", ...).
    """
    options = settings.QUOTES_GATEWAY
    backend = get_backend(persona.backend or None)
    version = None if preview else await _current_version(persona)
    primary = persona.build_request(topic=topic, messages=messages)
    record = _Record(started=time.perf_counter(), model=backend.model_name(primary.model))
    slot = False
    saved = False

    async def finish() -> None:
        """Write the log row once. Called before the terminal event goes out, so a client that
        has seen [DONE] (or an error) can rely on the row existing; on cancellation, at the end."""
        nonlocal saved
        if not saved:
            saved = True
            await _save(
                record,
                persona=persona,
                version=version,
                backend=backend.name,
                topic=topic,
                request=primary,
                client=client,
                preview=preview,
                transport=transport,
            )

    metrics.stream_opened(transport)  # from here on, finish() runs whatever happens
    try:
        limit, window = options["rate_limit"]
        refused = await limits.admit_stream(
            client.key,
            limit=limit,
            window=window,
            max_streams=options["max_concurrent_streams"],
        )
        if refused is not None:
            reason, retry_after = refused
            record.status = Generation.Status.RATE_LIMITED
            if reason == "rate_limited":
                message = f"You have asked for {limit} quotes in a short while. Try again in {retry_after} s."
            else:
                message = "You already have quotes being written. Wait for one to finish."
            record.error = Error(reason, message, 429, retry_after=retry_after)
            saved = True  # counted per window, not logged one full row each (see refusals.py)
            metrics.stream_refused(transport=transport, backend=backend.name, model=record.model, code=reason)
            await record_refusal(
                persona=persona,
                version=version,
                backend=backend.name,
                model=record.model,
                client_key=client.key,
                client_hash=client.ip_hash,
                preview=preview,
                code=reason,
                message=message,
                window=window,
            )
            yield record.error
            return
        slot = True

        ttl = options["cache_ttl"] if persona.cache_ttl is None else persona.cache_ttl
        use_cache = ttl > 0 and not (preview or bypass_cache or options["skip_cache"])
        key = answer_key(backend=backend.name, request=primary, version_id=version.pk if version else None)
        record.cache_status = Generation.CacheStatus.MISS if use_cache else Generation.CacheStatus.BYPASS
        yield Meta(
            model=record.model,
            cache_status="MISS" if use_cache else "BYPASS",
            generation_id=record.public_id,
        )

        events: AsyncGenerator[Event, None]
        if use_cache and (cached := await get_answer(key)) is not None:
            record.cache_status = Generation.CacheStatus.HIT
            events = _replay(cached, pacing=options["replay_pacing_ms"] / 1000)
        else:
            flight = _flights.get(key) if use_cache else None
            if flight is not None:
                record.cache_status = Generation.CacheStatus.HIT  # shared: upstream called once
                metrics.coalesced_listener()
            else:
                models = [primary.model, *persona.fallback_models, *options["fallback_models"]]
                plan = _Plan(
                    backend=backend,
                    persona=persona,
                    topic=topic,
                    messages=messages,
                    models=list(dict.fromkeys(models)),
                    cache_key=key if use_cache else None,
                    cache_ttl=ttl,
                )
                flight = _Flight(
                    key if use_cache else None,
                    first_token_s=_first_token_budget(len(plan.models), options),
                )
                if flight.key is not None:
                    _flights[flight.key] = flight
                flight.task = asyncio.create_task(_fly(flight, plan))
            events = _listen(flight, keepalive=options["keepalive_s"], idle_s=options["idle_timeout_s"])

        async with aclosing(events):
            async for event in events:
                if type(event) is Token:
                    if record.ttft is None:
                        record.ttft = time.perf_counter()
                    record.parts.append(event.text)
                elif type(event) is Usage:
                    record.usage = event
                elif type(event) is Meta:
                    record.model = event.model or record.model
                    record.headers.update(event.headers)
                    if event.step is not None:
                        record.step = event.step
                    if record.cache_status == Generation.CacheStatus.HIT:
                        event = Meta(
                            model=event.model, headers=event.headers, step=event.step, cache_status="HIT"
                        )
                elif type(event) is Done:
                    record.status = Generation.Status.OK
                elif type(event) is Error:
                    record.status = (
                        Generation.Status.BUSY if event.code == "busy" else Generation.Status.ERROR
                    )
                    record.error = event
                if record.status:
                    if slot:  # free the slot before the client hears "done" and asks again
                        slot = False
                        await _shielded(limits.run_on_cache(limits.release_stream_slot, client.key))
                    await finish()
                    yield event
                    return
                yield event
    except (asyncio.CancelledError, GeneratorExit):
        if not record.status:
            record.status = Generation.Status.CANCELLED
        raise
    except Exception:
        logger.exception("generation failed for persona %s", persona.slug)
        record.status, record.error = Generation.Status.ERROR, internal()
        await finish()
        yield record.error
    finally:
        if slot:
            await _shielded(limits.run_on_cache(limits.release_stream_slot, client.key))
        await finish()


#: How much longer than its flight a listener waits, so a live flight's own error comes first.
_LISTENER_GRACE_S = 1.0


async def _listen(flight: _Flight, *, keepalive: float, idle_s: float) -> AsyncGenerator[Event, None]:
    """The flight's events for one request. The listener keeps deadlines of its own (to the first
    token, then between events) so that whatever becomes of the flight, this request ends with
    the same timeout error the flight would give and frees its stream slot."""
    queue = flight.subscribe()
    loop = asyncio.get_running_loop()
    started = False
    deadline = loop.time() + flight.first_token_s + _LISTENER_GRACE_S
    try:
        while True:
            try:
                async with asyncio.timeout(max(0.0, min(keepalive, deadline - loop.time()))):
                    event = await queue.get()
            except TimeoutError:
                if loop.time() >= deadline:
                    yield _timeout_error(started=started, total=False)
                    return
                yield Ping()
                continue
            if type(event) is Token:
                started = True
            if started:
                deadline = loop.time() + idle_s + _LISTENER_GRACE_S
            yield event
            if type(event) is Done or type(event) is Error:
                return
    finally:
        flight.unsubscribe(queue)


async def _replay(answer: CachedAnswer, *, pacing: float) -> AsyncGenerator[Event, None]:
    yield Meta(model=answer.model, step=answer.step)
    for index, text in enumerate(answer.tokens):
        if pacing and index:
            await asyncio.sleep(pacing)
        yield Token(text)
    if answer.prompt_tokens is not None and answer.completion_tokens is not None:
        yield Usage(prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens)
    yield Done()


async def _current_version(persona: Persona) -> PersonaVersion | None:
    if persona.pk is None:
        return None
    return await persona.versions.order_by("-number").afirst()


async def _shielded(coroutine: Any) -> None:
    """Finish `coroutine` even if this task is cancelled meanwhile."""
    task = asyncio.ensure_future(coroutine)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        raise  # the task goes on by itself
    except Exception:
        logger.exception("cleanup after a generation failed")


async def _save(
    record: _Record,
    *,
    persona: Persona,
    version: PersonaVersion | None,
    backend: str,
    topic: str,
    request: GenerationRequest,
    client: Client,
    preview: bool,
    transport: str,
) -> None:
    """Write the log row. Shielded: a cancelled request must still leave its row."""
    usage = record.usage
    cost = None
    if usage is not None and record.cache_status != Generation.CacheStatus.HIT:
        estimate = estimate_cost(record.model, usage.prompt_tokens, usage.completion_tokens)
        cost = Decimal(str(round(estimate, 8))) if estimate is not None else None
    elif record.cache_status == Generation.CacheStatus.HIT:
        cost = Decimal(0)  # nothing was paid for a cached or shared answer
    row = Generation(
        public_id=record.public_id,
        persona_id=persona.pk,
        persona_version=version,
        backend=backend,
        model=record.model,
        fallback_step=record.step,
        topic=topic,
        status=record.status or Generation.Status.ERROR,
        cache_status=record.cache_status,
        error_code=record.error.code if record.error else "",
        error_message=record.error.message if record.error else "",
        text="".join(record.parts),
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        cost_usd=cost,
        ttft_ms=(record.ttft - record.started) * 1000 if record.ttft is not None else None,
        duration_ms=(time.perf_counter() - record.started) * 1000,
        request=asdict(request),
        upstream_headers=record.headers,
        client_hash=client.ip_hash,
        is_preview=preview,
    )
    metrics.stream_finished(row, transport=transport)
    await _shielded(_save_row(row))


async def _save_row(row: Generation, attempts: int = 5) -> None:
    """Insert the row, retrying a briefly locked database (SQLite under concurrent streams):
    a log row must not be lost to a transient lock."""
    with metrics.log_row_write():  # the writer's queue depth, and the row counted lost if this fails
        for attempt in range(attempts):
            try:
                await row.asave()
                return
            except OperationalError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)
