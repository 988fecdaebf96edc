"""The path every generation takes, whatever the transport: backend events in, the same events
out, and one `Generation` log row written on every outcome (a client disconnect included).

Later layers (cache, rate limits, retries, fallbacks) wrap this same path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field

from ..models import Generation, Persona
from .backends import Backend, get_backend
from .errors import internal
from .events import Done, Error, Event, Message, Meta, Token, Usage

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Record:
    """What the log row needs, gathered while the stream flows (cheaply: one append per token)."""

    started: float
    parts: list[str] = field(default_factory=list)
    ttft: float | None = None
    usage: Usage | None = None
    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    status: str = ""
    error: Error | None = None


async def stream_generation(
    *,
    persona: Persona,
    topic: str,
    messages: tuple[Message, ...] = (),
    backend: Backend | None = None,
) -> AsyncGenerator[Event, None]:
    """Stream one generation for `persona` and log it. Ends with exactly one Done or Error."""
    backend = backend or get_backend()
    request = persona.build_request(topic=topic, messages=messages)
    record = _Record(started=time.perf_counter(), model=backend.model_name(request.model))
    try:
        yield Meta(model=record.model)
        async with aclosing(backend.stream(request)) as events:
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
                elif type(event) is Done:
                    record.status = Generation.Status.OK
                elif type(event) is Error:
                    record.status = (
                        Generation.Status.BUSY if event.code == "busy" else Generation.Status.ERROR
                    )
                    record.error = event
                yield event
                if record.status:
                    return
        if not record.status:
            # The backend ended without saying how: a bug, but the visitor still gets an answer.
            record.status, record.error = Generation.Status.ERROR, internal()
            yield record.error
    except (asyncio.CancelledError, GeneratorExit):
        if not record.status:
            record.status = Generation.Status.CANCELLED
        raise
    except Exception:
        logger.exception("generation failed for persona %s", persona.slug)
        record.status, record.error = Generation.Status.ERROR, internal()
        yield record.error
    finally:
        await _save(record, persona=persona, backend=backend.name, topic=topic, request=asdict(request))


async def _save(
    record: _Record, *, persona: Persona, backend: str, topic: str, request: dict[str, object]
) -> None:
    """Write the log row. Shielded: a cancelled request must still leave its row."""
    now = time.perf_counter()
    row = Generation(
        persona=persona,
        backend=backend,
        model=record.model,
        topic=topic,
        status=record.status or Generation.Status.ERROR,
        error_code=record.error.code if record.error else "",
        error_message=record.error.message if record.error else "",
        text="".join(record.parts),
        prompt_tokens=record.usage.prompt_tokens if record.usage else None,
        completion_tokens=record.usage.completion_tokens if record.usage else None,
        ttft_ms=(record.ttft - record.started) * 1000 if record.ttft is not None else None,
        duration_ms=(now - record.started) * 1000,
        request=request,
        upstream_headers=record.headers,
    )
    task = asyncio.ensure_future(row.asave())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        # Cancelled again while saving: the task goes on by itself; let the cancellation through.
        raise
    except Exception:
        logger.exception("could not write the generation log row")
