"""A quote's stream, from the request to its row: the one way one starts, its source, its bill,
and its record when it ends; a resume and a stop.

    stream = await begin(client, transport=..., params=params)
        # admission (quotes.admission: 503, 429), the input checked (parse: 400, 404), then
        # start(quote, client, slot): its source, its row, its task
    stream.read(after)                               # what a connection streams
    find(last_event_id), stop(public_id, client)     # a resume, a stop

A stream's source is one of: a cached answer replayed at a pace; another stream of an identical
request in flight here (coalescing: one upstream call); or the persona's backend under the retry
and fallback policy. Its row is inserted `running` as it starts; when its source ends, the stream
awaits `_record` (the row completed, the answer cached, the spend settled, the slot given back)
before its readers see the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import math
import re
import uuid
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, replace
from decimal import Decimal
from typing import Any

from django.conf import settings
from opentelemetry.trace import Span
from streaming import Done, Error, Event, Meta, Stream, Token, generate, replay

from . import personas, spend
from .admission import Slot, admit
from .backends import backend_for
from .backends.base import Backend, GenerationRequest, Message
from .backends.catalog import USUAL_RANGES, count_tokens_estimate, estimate_cost, get_model
from .backends.voice import guard_copies
from .cache import answer_key, get_answer, store_answer
from .clients import Client
from .errors import OUTCOMES, STOPPED, ErrorCode, QuoteError
from .models import Experiment, Persona, PersonaVersion
from .models import Generation as Row
from .ops import metrics, tracing
from .registry import streams
from .rows import clamp_cost, finish_fields, writer

logger = logging.getLogger(__name__)

# -- the input ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Quote:
    persona: Persona
    version: PersonaVersion | None
    topic: str
    #: what the persona's backend is asked: built once, here
    request: GenerationRequest
    backend: Backend
    messages: tuple[Message, ...] = ()
    #: a new answer, not a cached one (the page's New quote button)
    fresh: bool = False
    #: the request's own max_tokens and temperature, within the persona's limits
    overrides: tuple[tuple[str, Any], ...] = ()
    #: the persona's running experiment and the reader's arm in it
    experiment: Experiment | None = None
    arm: str = ""

    @classmethod
    def of(
        cls,
        persona: Persona,
        version: PersonaVersion | None,
        topic: str,
        messages: tuple[Message, ...] = (),
        *,
        fresh: bool = False,
        overrides: dict[str, Any] | None = None,
        experiment: Experiment | None = None,
        arm: str = "",
    ) -> Quote:
        """The quote, its request checked against the model's context window (400)."""
        request = replace(persona.build_request(topic=topic, messages=messages), **(overrides or {}))
        backend = backend_for(persona)
        check_context_window(backend, request)
        return cls(
            persona,
            version,
            topic,
            request,
            backend,
            messages,
            fresh,
            tuple((overrides or {}).items()),
            experiment,
            arm,
        )

    def request_for(self, model: str) -> GenerationRequest:
        """What `model` is asked: the request, or a fallback's own (its examples and overrides)."""
        if model == self.request.model:
            return self.request
        request = self.persona.build_request(topic=self.topic, messages=self.messages, model=model)
        return replace(request, **dict(self.overrides))


_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,100}")


async def parse(params: dict[str, Any], reader: str = "") -> Quote:
    """`params` checked: a Quote, or the QuoteError (400, 404) that says what is wrong. While the
    persona runs an experiment, `reader`'s arm says which of its versions speaks."""
    slug = params.get("persona")
    if slug is None or slug == "":
        raise QuoteError(
            ErrorCode.MISSING_PERSONA, "Say which persona should speak: the `persona` field.", 400
        )
    if not isinstance(slug, str):
        raise QuoteError(ErrorCode.INVALID_PERSONA, "`persona` must be a string (a persona's slug).", 400)
    # Not a slug: never a persona, and PostgreSQL refuses some bytes (NUL) outright.
    if not _SLUG.fullmatch(slug) or (active := await personas.get_active(slug)) is None:
        raise QuoteError(ErrorCode.UNKNOWN_PERSONA, f"There is no persona called {slug[:100]!r}.", 404)
    persona, version, experiment, arm = active.persona, active.version, active.experiment, ""
    if experiment is not None and active.draft is not None and reader:
        arm = experiment.arm_of(reader)
        if arm == experiment.DRAFT:
            persona, version = active.draft, experiment.draft
    topic = clean_topic(params.get("topic"), default=persona.default_topic)
    messages = parse_messages(params.get("messages"))
    fresh = params.get("fresh")
    fresh = fresh is True or (isinstance(fresh, str) and fresh.lower() in ("1", "true", "yes"))
    overrides = request_overrides(persona, params)
    return Quote.of(
        persona,
        version,
        topic,
        messages,
        fresh=fresh,
        overrides=overrides,
        experiment=experiment if arm else None,
        arm=arm,
    )


def request_overrides(persona: Persona, params: dict[str, Any]) -> dict[str, Any]:
    """A request's own `max_tokens` (1 to the persona's) and `temperature` (its model's range);
    outside them a 400 that says the range. A query string's text is read as the number."""
    overrides: dict[str, Any] = {}
    value = _number(params.get("max_tokens"))
    if value is not None:
        if type(value) is not int or not 1 <= value <= persona.max_tokens:
            message = f"`max_tokens` must be a whole number from 1 to {persona.max_tokens} for this persona."
            raise QuoteError(ErrorCode.OUT_OF_RANGE, message, 400, param="max_tokens")
        overrides["max_tokens"] = value
    value = _number(params.get("temperature"))
    if value is not None:
        info = get_model(backend_for(persona).model_name(persona.model))
        allowed = info.range("temperature") if info else USUAL_RANGES["temperature"]
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value not in allowed
        ):
            message = f"`temperature` must be a number from {allowed} for this persona's model."
            raise QuoteError(ErrorCode.OUT_OF_RANGE, message, 400, param="temperature")
        overrides["temperature"] = float(value)
    return overrides


def _number(value: object) -> object:
    if isinstance(value, str):
        try:
            return int(value) if value.strip().isdigit() else float(value)
        except ValueError:
            return value
    return value


def encodable(text: str, field: str) -> None:
    """JSON can carry a lone surrogate ("\\ud800"), which no backend can send and PostgreSQL
    refuses: not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        message = f"{field} contains an unpaired surrogate (such as \\ud800), which is not text. Send valid Unicode."
        raise QuoteError(ErrorCode.INVALID_UNICODE, message, 400) from None


def clean_topic(topic: object, *, default: str, field: str = "`topic`", param: str = "topic") -> str:
    """The topic fit to send; `field` names it in a message (OpenAI's face: its first message)."""
    if topic is None:
        return default
    if not isinstance(topic, str):
        raise QuoteError(ErrorCode.INVALID_TOPIC, f"{field} must be a string.", 400, param=param)
    encodable(topic, field)
    # Control characters (NUL above all, which PostgreSQL cannot store) go; spaces collapse.
    topic = " ".join("".join(ch for ch in topic if ch.isprintable() or ch.isspace()).split())
    if len(topic) > settings.QUOTES_MAX_TOPIC_CHARS:
        message = f"{field} is too long: keep it under {settings.QUOTES_MAX_TOPIC_CHARS} characters."
        raise QuoteError(ErrorCode.TOPIC_TOO_LONG, message, 400, param=param)
    return topic or default


def parse_messages(raw: object, turn: str = "Turn {}", first: int = 1) -> tuple[Message, ...]:
    """A follow-up conversation: user and assistant turns, ending on the visitor's. `turn` names
    one in a message (OpenAI's face: "messages[{}]", counted from `first`)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        message = "`messages` must be a list of {role, content} turns."
        raise QuoteError(ErrorCode.INVALID_MESSAGES, message, 400, param="messages")
    if len(raw) > settings.QUOTES_MAX_TURNS:
        message = f"The conversation is too long: at most {settings.QUOTES_MAX_TURNS} turns."
        raise QuoteError(ErrorCode.TOO_MANY_MESSAGES, message, 400, param="messages")
    turns = []
    for number, item in enumerate(raw, first):
        name = turn.format(number)
        if not isinstance(item, dict) or set(item) != {"role", "content"}:
            message = f"{name} must be exactly {{role, content}}."
            raise QuoteError(ErrorCode.INVALID_MESSAGES, message, 400, param="messages")
        role, content = item["role"], item["content"]
        if role not in ("user", "assistant"):
            message = f"{name}: role must be 'user' or 'assistant'."
            raise QuoteError(ErrorCode.INVALID_MESSAGE_ROLE, message, 400, param="messages")
        if not isinstance(content, str) or not content.strip() or "\x00" in content:
            message = f"{name}: content must be non-empty text, without NUL characters."
            raise QuoteError(ErrorCode.INVALID_MESSAGES, message, 400, param="messages")
        encodable(content, name)
        if len(content) > settings.QUOTES_MAX_MESSAGE_CHARS:
            message = f"{name} is too long: at most {settings.QUOTES_MAX_MESSAGE_CHARS} characters."
            raise QuoteError(ErrorCode.MESSAGE_TOO_LONG, message, 400, param="messages")
        turns.append(Message(role, content))
    if turns and turns[-1].role != "user":
        message = "The conversation must end with the visitor's (user) turn."
        raise QuoteError(ErrorCode.INVALID_MESSAGES, message, 400, param="messages")
    return tuple(turns)


def check_context_window(backend: Backend, request: GenerationRequest) -> None:
    """The prompts, the turns and the answer's max_tokens must fit the model's context."""
    model = backend.model_name(request.model)
    info = get_model(model)
    if info is None or info.context_window is None:
        return
    prompt = sum(count_tokens_estimate(m.content) + 4 for m in request.messages)
    if prompt + request.max_tokens > info.context_window:
        message = (
            f"The conversation is too long for {model}: about {prompt} tokens plus {request.max_tokens} "
            f"for the answer, over its {info.context_window}-token context window."
        )
        raise QuoteError(ErrorCode.CONTEXT_WINDOW_EXCEEDED, message, 400)


# -- event ids ---------------------------------------------------------------------------------

#: `<public id>.<resume key>:<n>`: the generation's id, its resume key, an event's number.
EVENT_ID = re.compile(r"([0-9a-fA-F-]{36})\.([0-9a-f]{16}):(\d{1,9})")


def resume_key(public_id: str) -> str:
    """The secret half of a generation's event ids, which only its own stream carries: its id
    (a permalink's) alone resumes nothing. Keyed with SECRET_KEY: nothing stored."""
    return hmac.new(
        settings.SECRET_KEY.encode(), b"resume:" + public_id.encode(), hashlib.sha256
    ).hexdigest()[:16]


def event_id(public_id: str, number: int) -> str:
    return f"{public_id}.{resume_key(public_id)}:{number}"


def find(last_event_id: object) -> tuple[Stream, int]:
    """The stream a client resumes, and the number of the last event it had; the QuoteError for
    an id this site never sent (400) or a stream this process keeps no longer (404)."""
    match = EVENT_ID.fullmatch(last_event_id.strip()) if isinstance(last_event_id, str) else None
    if match is None:
        message = "`last_event_id` must be an event id this site sent: <generation id>.<key>:<number>."
        raise QuoteError(ErrorCode.INVALID_LAST_EVENT_ID, message, 400)
    public_id, key, after = match[1].lower(), match[2], int(match[3])
    stream = streams().get(public_id)
    if (
        stream is None
        or not hmac.compare_digest(key, resume_key(public_id))
        or after > len(stream.events) + 1
    ):
        message = "This quote cannot be resumed here (unknown, or kept no longer). Ask for a new one."
        raise QuoteError(ErrorCode.RESUME_UNAVAILABLE, message, 404)
    return stream, after


async def stop(public_id: str, client: Client) -> bool | None:
    """Stop the client's own stream now: True, or False when it had ended; None when the client
    has no such stream here."""
    live = streams()
    stream = live.get(public_id)
    if stream is None or live.owners.get(public_id) != client.key:
        return None
    if not stream.stop(STOPPED):
        return False
    await asyncio.wait([stream.closed], timeout=5)  # the upstream is closed, the row written
    return True


# -- starting one ------------------------------------------------------------------------------


async def begin(
    client: Client,
    *,
    transport: str,
    params: dict[str, Any] | None = None,
    quote: Quote | None = None,
    preview: bool = False,
) -> Stream:
    """The one way a stream starts, whatever its transport: admission (503, 429), then its input
    (`params` checked by `parse`, or a `quote` made already: the admin's preview), then its
    stream, which keeps the client's slot until it ends; the slot is given back if it does not
    start."""
    slot = await admit(client)
    try:
        if quote is None:
            quote = await parse(params or {}, client.reader)
        return await start(quote, client, slot, transport=transport, preview=preview)
    except BaseException:
        slot.release()
        raise


async def start(quote: Quote, client: Client, slot: Slot, *, transport: str, preview: bool = False) -> Stream:
    """Start `quote`'s stream for `client`, which holds `slot` until it ends. Raises the 503
    `budget_exhausted` QuoteError when a paid model would pass today's spend ceiling."""
    persona, backend, request, live = quote.persona, quote.backend, quote.request, streams()
    ttl = settings.QUOTES_CACHE_TTL if persona.cache_ttl is None else persona.cache_ttl
    key = ""
    if ttl > 0 and not (preview or quote.fresh or settings.AI_GATEWAY_SKIP_CACHE):
        key = answer_key(
            backend=backend.name, request=request, version_id=quote.version.pk if quote.version else None
        )
    cached = await get_answer(key) if key else None
    joined = live.joinable(key) if key and cached is None else None
    if key:
        metrics.cache_lookup(hit=cached is not None or joined is not None)
    models = [backend.model_name(model) for model in model_chain(persona, request.model)]
    reservation = None
    if cached is None and joined is None and backend.paid:
        most = most_cost(models, request)
        reservation = await spend.reserve(persona.pk, persona.daily_spend_limit_usd, most)
    public_id = str(uuid.uuid4())
    status = (
        Row.CacheStatus.HIT if cached or joined else Row.CacheStatus.MISS if key else Row.CacheStatus.BYPASS
    )
    row = Row(
        public_id=public_id,
        persona=persona,
        persona_version=None if preview else quote.version,
        backend=backend.name,
        model=models[0],
        topic=quote.topic,
        status=Row.Status.RUNNING,
        cache_status=status,
        request=asdict(request),
        client_hash=client.ip_hash,
        is_preview=preview,
        experiment=quote.experiment,
        arm=quote.arm,
    )
    span = None
    if tracing.TRACER is not None:
        span = tracing.start_generation(
            request,
            model=models[0],
            backend=backend.name,
            public_id=public_id,
            cache_status=status,
            prompt=persona.slug,
            version=row.persona_version.number if row.persona_version else None,
            arm=quote.arm,
        )
    source: AsyncGenerator[Event, None]
    if cached is not None:
        source = replay(cached, settings.QUOTES_CACHE_REPLAY_PACING_MS / 1000)
        if span is not None:
            span.add_event("cache.hit")
    elif joined is not None:
        source = _joined(joined)
        if span is not None:
            span.add_event("stream.joined", {"quotes.joined.id": joined.id})
    else:
        source = _upstream(backend, persona, quote, request, span)
    stream = live.open(
        public_id,
        key=key if cached is None and joined is None else "",
        grace_s=settings.QUOTES_RESUME_GRACE_S,
        keepalive_s=settings.QUOTES_KEEPALIVE_S,
        events=[Meta(model=models[0], cache_status=status.upper(), id=public_id)],
    )
    live.own(public_id, client.key)
    writer().insert(row)
    bill = Bill(models, request, paid=backend.paid, reservation=reservation)

    async def on_end(stream: Stream, end: Done | Error) -> None:
        try:
            await _record(stream, end, row, key, ttl, bill, transport)
        finally:
            slot.release()
            if span is not None:
                tracing.end_generation(span, row, row.text)

    stream.start(source, on_end)
    return stream


async def _record(
    stream: Stream, end: Done | Error, row: Row, key: str, ttl: int, bill: Bill, transport: str
) -> None:
    """The row completed from the stream's events, its answer cached, its cost settled; a step
    that fails is logged and the next still runs."""
    try:
        finish_fields(row, stream, end)
        bill.price(row, stream, end)
        metrics.stream_finished(row, transport)
    except Exception:
        logger.exception("stream %s: its row could not be completed from its events", stream.id)
        row.status, row.error_code = Row.Status.ERROR, ErrorCode.INTERNAL_ERROR
    if key and type(end) is Done and row.status == Row.Status.OK and row.cache_status == Row.CacheStatus.MISS:
        try:
            await store_answer(key, stream.events, ttl=ttl)  # before [DONE]: a client who saw it finds it
        except Exception:
            logger.exception("stream %s: its answer could not be cached", stream.id)
    if bill.reservation is not None:
        try:
            await bill.reservation.settle(row.cost_usd)
        except Exception:
            logger.exception("stream %s: its spend could not be settled (its reservation stays)", stream.id)
    await writer().finish(row)


def _upstream(
    backend: Backend, persona: Persona, quote: Quote, primary: GenerationRequest, span: Span | None
) -> AsyncGenerator[Event, None]:
    """The persona's backend under the retry and fallback policy; a quote never copies eight
    words in a row from one of the persona's voice examples. Each attempt is a child of the
    generation's `span`, when it is traced."""
    models = model_chain(persona, primary.model)
    attempts = itertools.count(1)

    def attempt(model: str) -> AsyncGenerator[Event, None]:
        request = quote.request_for(model)
        events = guard_copies(backend.stream(request), request.examples)
        if span is None:
            return events
        return tracing.attempt(
            span,
            events,
            model=backend.model_name(request.model),
            backend=backend.name,
            number=next(attempts),
        )

    return generate(attempt, models, settings.QUOTES_POLICY, OUTCOMES)


def model_chain(persona: Persona, model: str) -> list[str]:
    """`model`, then the persona's fallbacks, then the site's, each once."""
    return list(dict.fromkeys((model, *persona.fallback_models, *settings.QUOTES_FALLBACK_MODELS)))


def most_cost(models: list[str], request: GenerationRequest) -> float:
    """The most this generation can cost on any of `models` (the chain, as the backend names
    them): every prompt character a token, plus a chat template's, and max_tokens written."""
    prompt = most_prompt_tokens(request)
    costs = [estimate_cost(model, prompt, request.max_tokens) for model in models]
    return max((cost for cost in costs if cost is not None), default=0.0)


def most_prompt_tokens(request: GenerationRequest) -> int:
    """A prompt's tokens at most: each character one, and 16 a turn for the chat template."""
    return sum(len(m.content) + 16 for m in request.messages)


#: How a generation can end with no text, the upstream working on it when we left: its prompt
#: may have been billed.
LEFT_WORKING = frozenset(
    {
        ErrorCode.STOPPED,
        ErrorCode.ABANDONED,
        ErrorCode.SERVER_DRAINING,
        ErrorCode.UPSTREAM_TIMEOUT,
        ErrorCode.DEADLINE_EXCEEDED,
        ErrorCode.IDLE_TIMEOUT,
        ErrorCode.UPSTREAM_DROPPED,
    }
)


@dataclass(slots=True)
class Bill:
    """What a generation costs: `models`, its model chain as the backend names them (a row is
    priced by the one the app asked for, never by the name an upstream echoes), and the
    reservation it settles."""

    models: list[str]
    request: GenerationRequest
    paid: bool
    reservation: spend.Reservation | None

    def price(self, row: Row, stream: Stream, end: Done | Error) -> None:
        """The row's cost: its usage at the price of the model asked for; without usage (a stop,
        a drop, a deadline, a server that sends none) an estimate, never $0 (`cost_estimated`):
        the prompt, counted as the reservation counts it, plus the text streamed."""
        if row.cache_status == Row.CacheStatus.HIT:
            return
        model = self.models[min(row.fallback_step, len(self.models) - 1)]
        if row.prompt_tokens is not None and row.completion_tokens is not None:
            cost = estimate_cost(model, row.prompt_tokens, row.completion_tokens)
            estimated = False
        elif self.paid:
            text = [event.text for event in stream.events if type(event) is Token]
            if not text and not (type(end) is Error and end.code in LEFT_WORKING):
                return  # the upstream refused it: an error answer is not billed
            written = max(len(text), count_tokens_estimate("".join(text)))
            cost = estimate_cost(model, most_prompt_tokens(self.request), written)
            estimated = True
        else:
            return
        if cost is not None:
            row.cost_usd = clamp_cost(Decimal(str(round(cost, 8))))
            row.cost_estimated = estimated


async def _joined(other: Stream) -> AsyncGenerator[Event, None]:
    """An identical stream's events, without its own id and cache status."""
    async for event in other.follow():
        yield Meta(event.model, event.headers, event.step) if type(event) is Meta else event
