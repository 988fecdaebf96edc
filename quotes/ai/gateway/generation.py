"""`stream_generation`: one request's stream, from admission to its run.

admission -> a Run (the row's id, its Meta first) -> answer cache? replay : join or start a
flight -> the request reads the run from its start (a Listener); the run writes the log row
before its terminal event goes out (runs.py), and outlives the request if the client drops.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from ... import metrics, personas
from ...models import Generation, Persona, PersonaVersion
from ...security import client_address, client_network
from ..backends import backend_for
from ..cache import answer_key, get_answer
from ..errors import ErrorCode, internal
from ..events import Error, Event, Message
from ..refusals import record_refusal
from . import admission, shared_runs
from .policy import Plan, generate
from .rows import Record, RowFacts, write_row
from .runs import Flight, Run, flights, listed

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Client:
    """Who is asking: the user when logged in, else a salted hash of the IP (of its network for IPv6)."""

    key: str
    ip_hash: str
    user_id: int | None = None
    #: the network it asks from (a salted hash of its IPv6 /48 or IPv4 /24; "" when unknown), for
    #: the coarser rate limit
    network_key: str = ""

    @classmethod
    def from_request(cls, ip: str, user_id: int | None = None) -> Client:
        network = client_network(ip)
        ip = client_address(ip)  # an IPv6 address counts as its /64 (QUOTES_IPV6_PREFIX)
        ip_hash = _salted(ip)
        return cls(
            key=f"user:{user_id}" if user_id else f"ip:{ip_hash}",
            ip_hash=ip_hash,
            user_id=user_id,
            network_key=f"net:{_salted(network)}" if network else "",
        )


def _salted(text: str) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), text.encode(), hashlib.sha256).hexdigest()[:32]


ANONYMOUS = Client(key="local", ip_hash="")

#: Refusals for this process's own state (its cap, its drain), not the client's: busy rows,
#: counted in this process.
_PROCESS_REFUSALS = frozenset({ErrorCode.OVER_CAPACITY, ErrorCode.SERVER_DRAINING})


async def _refuse(
    error: Error, *, persona: Persona, version: Any, client: Client, transport: str, preview: bool = False
) -> None:
    """Count a refused stream in the metrics and in its refusal row (one per client and window,
    see refusals.py). A refusal for this process's own state (its cap, its drain) is a busy row
    counted in this process; a client's limit is counted where the limit is (the shared cache)."""
    backend = backend_for(persona)
    model = backend.model_name(persona.model)
    metrics.stream_refused(transport=transport, backend=backend.name, model=model, code=error.code)
    mine = error.code in _PROCESS_REFUSALS
    await record_refusal(
        persona=persona,
        version=version,
        backend=backend.name,
        model=model,
        client_key=client.key,
        client_hash=client.ip_hash,
        preview=preview,
        code=error.code,
        message=error.message,
        window=settings.QUOTES_GATEWAY.rate_limit[1],
        status=Generation.Status.BUSY if mine else None,
        local=mine,
    )


async def refuse_if_full(
    decided: admission.Entry | Error | None, *, slug: object, client: Client, transport: str
) -> Error | None:
    """`decided` (admission.enter's answer) when it is this process's refusal (its cap, its
    drain), counted against the persona if this process knows it (no round trip); else None, and
    stream_generation, given the same answer, counts it."""
    active = personas.peek(slug) if isinstance(slug, str) else None
    if not isinstance(decided, Error) or decided.code not in _PROCESS_REFUSALS or active is None:
        return None
    metrics.stream_opened(transport)
    await _refuse(decided, persona=active.persona, version=active.version, client=client, transport=transport)
    return decided


async def stream_generation(
    *,
    persona: Persona,
    topic: str,
    messages: tuple[Message, ...] = (),
    client: Client = ANONYMOUS,
    preview: bool = False,
    bypass_cache: bool = False,
    version: Any = ...,  # PersonaVersion | None, or ... for "look it up"
    transport: str = "other",
    admitted: admission.Entry | Error | None = None,
) -> AsyncGenerator[Event, None]:
    """Stream one generation for `persona` and log it. Ends with exactly one Done or Error.

    `preview` (an admin trying unsaved values) is logged as such and never cached;
    `bypass_cache` asks for a fresh answer (the page's "new quote" button). `version` is the
    persona's current version when the caller knows it (quotes.personas keeps it); looked up
    otherwise. `transport` names the way the client reads the stream, for the metrics ("api",
    "htmx", "websocket", ...). `admitted`: admission.enter's answer, where the request came in.
    Its events are the generation's from the first, numbered as they come (the resume ids: the
    transports count them).

    A client that stops reading does not stop the generation: its run keeps going for the
    resume grace (runs.py). `Run.stop()` stops it at once.
    """
    options = settings.QUOTES_GATEWAY
    backend = backend_for(persona)
    if preview:
        version = None
    elif version is ...:
        version = await _current_version(persona)
    primary = persona.build_request(topic=topic, messages=messages)
    record = Record(started=time.perf_counter(), model=backend.model_name(primary.model))
    facts = RowFacts(
        persona=persona,
        version=version,
        backend=backend.name,
        topic=topic,
        request=primary,
        client_hash=client.ip_hash,
        preview=preview,
        transport=transport,
    )
    ticket: admission.Ticket | None = None
    #: the request's row is written (or counted as a refusal), not the run's to write
    logged = False

    metrics.stream_opened(transport)  # from here on, a row is written whatever happens
    run: Run | None = None
    try:
        answer = await admission.admit(client.key, options, admitted=admitted, network_key=client.network_key)
        if isinstance(answer, Error):
            # Counted per client and window, not logged one full row each (see refusals.py).
            logged = True
            await _refuse(
                answer, persona=persona, version=version, client=client, preview=preview, transport=transport
            )
            yield answer
            return
        ticket = answer
        shared_runs.sweep_soon()  # the rows of runs whose process died, now and then

        ttl = options.cache_ttl if persona.cache_ttl is None else persona.cache_ttl
        use_cache = ttl > 0 and not (preview or bypass_cache or options.skip_cache)
        key = (
            answer_key(backend=backend.name, request=primary, version_id=version.pk if version else None)
            if use_cache
            else ""
        )
        record.cache_status = Generation.CacheStatus.MISS if use_cache else Generation.CacheStatus.BYPASS
        cached = await get_answer(key) if use_cache else None
        claim = ""
        if cached is not None:
            record.cache_status = Generation.CacheStatus.HIT
            flight = Flight()
            flight.start(listed(cached), pacing=options.replay_pacing_ms / 1000)
        elif use_cache and key in flights:
            record.cache_status = Generation.CacheStatus.HIT  # shared: the upstream is called once
            metrics.coalesced_listener()
            flight = flights[key]
        else:
            models = [primary.model, *persona.fallback_models, *options.fallback_models]
            plan = Plan(
                backend=backend,
                persona=persona,
                topic=topic,
                messages=messages,
                primary=primary,
                models=list(dict.fromkeys(models)),
            )
            flight = Flight(key, ttl)  # with a key: registered now, so identical requests join it
            owner = None
            if use_cache and shared_runs.available():
                # Across processes, one of them claims the upstream call; the others follow its run.
                try:
                    owner = await shared_runs.claim(key, record.public_id)
                except BaseException:
                    if flight.runs:  # requests joined meanwhile: they get their answer
                        flight.start(generate(plan))
                    else:
                        flight.unregister()
                    raise
                claim = "" if owner else key
            if owner is None:
                flight.start(generate(plan))
            else:
                record.cache_status = Generation.CacheStatus.HIT
                metrics.coalesced_listener()
                # The owner's events after its own opening Meta (this run has its own).
                flight.start(shared_runs.follow(owner, for_run=True, skip=1), plan=plan)
        # From here the run owns the row: it outlives this request if the client drops.
        run = Run(record=record, facts=facts, client_key=client.key, flight=flight, claim=claim)
        listener = run.subscribe(0, ticket=ticket)
        ticket = None  # the connection's now: given back when it ends
        async with aclosing(listener.events()) as events:
            async for event in events:
                yield event
    except (asyncio.CancelledError, GeneratorExit):
        if run is None and not record.status:
            record.status = Generation.Status.CANCELLED
        raise
    except Exception:
        logger.exception("generation failed for persona %s", persona.slug)
        if run is not None:
            run.fail(internal())  # the run writes the row
        else:
            record.status, record.error = Generation.Status.ERROR, internal()
            logged = True
            await write_row(record, facts)
            yield record.error
    finally:
        if ticket is not None:
            await ticket.release()
        if run is None and not logged:
            await write_row(record, facts)


async def _current_version(persona: Persona) -> PersonaVersion | None:
    if persona.pk is None:
        return None
    return await persona.versions.order_by("-number").afirst()
