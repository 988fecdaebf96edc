"""OpenTelemetry traces, when the standard variables ask for them (`OTEL_EXPORTER_OTLP_ENDPOINT`
or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
turn them off; the exporter reads its own variables: headers, protocol, timeouts).

Each request is a span (OpenTelemetry's ASGI middleware, outermost, so it covers the gate and
Django), and each generation a child span named as the GenAI conventions name an inference,
`chat {model}`, with one child per upstream attempt (retries and fallbacks show as siblings) and
events for a cache hit, a join and a stop. Prompts and answers stay out of spans unless
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.

Without the variables nothing here is imported beyond the API, no provider is set and `TRACER` is
None: the stream path asks that once per generation and does nothing more.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from streaming import Error, Event, Meta, Usage

if TYPE_CHECKING:
    from ..backends.base import GenerationRequest
    from ..models import Generation

#: gen_ai.provider.name by backend: the conventions' own value where they have one
PROVIDERS = {"workers-ai": "cloudflare.workers_ai", "openai-compatible": "openai", "local": "llama.cpp"}


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Do the standard variables ask for traces exported over OTLP?"""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) and (
        environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
        and environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() != "none"
    )


def _tracer() -> Tracer:
    """The SDK's provider, batching spans to the OTLP/HTTP exporter, set as the process's."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "persona-quotes"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider.get_tracer("quotes")


TRACER: Tracer | None = _tracer() if wanted() else None
CAPTURE_CONTENT = os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").lower() == "true"


def instrument(application: Any) -> Any:
    """`application` inside OpenTelemetry's ASGI middleware when traces are on: a span per request,
    none per message sent or received (a stream sends one per token)."""
    if TRACER is None:
        return application
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    traced = OpenTelemetryMiddleware(
        application,
        exclude_spans=["receive", "send"],
        server_request_hook=None if CAPTURE_CONTENT else _no_query,
    )

    async def each_request_its_own_trace(scope: Any, receive: Any, send: Any) -> None:
        # daphne starts a request on a kept-alive connection from the context of the one before:
        # its span would be this one's parent. A request continues only the trace it names
        # (`traceparent`), or starts one.
        token = otel_context.attach(otel_context.Context())
        try:
            await traced(scope, receive, send)
        finally:
            otel_context.detach(token)

    return each_request_its_own_trace


def _no_query(span: Span, scope: dict[str, Any]) -> None:
    """A request span without its query string: an EventSource's topic is part of a prompt."""
    if span.is_recording() and scope.get("query_string"):
        span.set_attribute("http.target", scope["path"])
        span.set_attribute(
            "http.url",
            f"{scope.get('scheme', 'http')}://{dict(scope['headers']).get(b'host', b'').decode()}{scope['path']}",
        )
        span.set_attribute("url.query", "")


def start_generation(
    request: GenerationRequest,
    *,
    model: str,
    backend: str,
    public_id: str,
    cache_status: str,
    prompt: str,
    version: int | None,
    arm: str = "",
) -> Span:
    """A generation's span, a child of the request's: what was asked (`model` as the backend
    names it: the embedded model's own name)."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": PROVIDERS.get(backend, backend),
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.prompt.name": prompt,
        "quotes.generation.id": public_id,
        "quotes.cache_status": cache_status,
    }
    if version is not None:
        attributes["gen_ai.prompt.version"] = str(version)
    if arm:
        attributes["quotes.experiment.arm"] = arm
    if CAPTURE_CONTENT:
        attributes["gen_ai.input.messages"] = json.dumps(
            [{"role": m.role, "parts": [{"type": "text", "content": m.content}]} for m in request.messages]
        )
    assert TRACER is not None  # called only when traces are on
    return TRACER.start_span(f"chat {model}", kind=SpanKind.INTERNAL, attributes=attributes)


def end_generation(span: Span, row: Generation, text: str) -> None:
    """What the generation's row says, onto its span, and the span ended."""
    span.set_attribute("gen_ai.response.model", row.model)
    if row.prompt_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", row.prompt_tokens)
    if row.completion_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", row.completion_tokens)
    if row.ttft_ms is not None:
        span.set_attribute("gen_ai.response.time_to_first_chunk", row.ttft_ms / 1000)
    span.set_attribute("quotes.fallback_step", row.fallback_step)
    if row.cost_usd is not None:
        span.set_attribute("quotes.cost_usd", float(row.cost_usd))
    if row.error_code:
        if row.status == row.Status.CANCELLED:
            span.add_event("stream.stopped", {"quotes.reason": row.error_code})
        else:
            span.set_attribute("error.type", row.error_code)
            span.set_status(StatusCode.ERROR, row.error_message[:200])
    if CAPTURE_CONTENT:
        span.set_attribute(
            "gen_ai.output.messages",
            json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}]}]),
        )
    span.end()


async def attempt(
    parent: Span,
    events: AsyncGenerator[Event, None],
    *,
    model: str,
    backend: str,
    number: int,
) -> AsyncGenerator[Event, None]:
    """One upstream attempt's events, under a child span of its generation's."""
    assert TRACER is not None  # a traced generation's attempt
    span = TRACER.start_span(
        f"chat {model}",
        context=trace.set_span_in_context(parent),
        kind=SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDERS.get(backend, backend),
            "gen_ai.request.model": model,
            "quotes.attempt": number,
        },
    )
    try:
        async for event in events:
            if isinstance(event, Error):
                span.set_attribute("error.type", event.code)
                span.set_status(StatusCode.ERROR, event.message[:200])
            elif isinstance(event, Meta) and event.model:
                span.set_attribute("gen_ai.response.model", event.model)
            elif isinstance(event, Usage):
                span.set_attribute("gen_ai.usage.input_tokens", event.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", event.completion_tokens)
            yield event
    finally:
        span.end()
