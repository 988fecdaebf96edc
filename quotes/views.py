"""Thin views: parse input, call the gateway, hand its events to a transport (quotes.transports).

Three ways in to one stream:
- `stream_quote`: the public JSON API (POST a JSON body, or GET for EventSource), exempt from
  CSRF because it only takes `Content-Type: application/json`, which a cross-site page cannot
  send without CORS; a request from htmx (`HX-Request: true`) gets the htmx dialect;
- `stream_quote_form`: the persona page's form, posted by htmx, with Django's normal CSRF check
  (a failed check is answered by `csrf_failure`, readably for htmx);
- the WebSocket consumer (quotes.consumers).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from csp.decorators import csp_exempt
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views import csrf
from django.views.decorators.csrf import csrf_exempt
from django_htmx.middleware import HtmxDetails

from . import personas, services
from .ai import sse
from .ai.backends import backend_for
from .ai.catalog import doc_url
from .ai.conversation import check_context_window, clean_topic, parse_messages
from .ai.errors import ErrorCode, QuoteError, envelope
from .ai.events import Error, Event, Message, Meta
from .ai.gateway import admission
from .ai.gateway.generation import Client, refuse_if_full, stream_generation
from .ai.gateway.runs import parse_event_id, resume
from .ai.gateway.runs import stop as stop_run
from .feedback import count_action
from .models import Generation, Persona, PersonaVersion
from .request_threads import release_request_thread
from .security import RateLimited, refuse_cross_site
from .transports import (
    Encoder,
    EventSourceEncoder,
    HtmxEncoder,
    Opening,
    WorkersAIEncoder,
    encode_stream,
    error_payload,
    meta_payload,
    open_stream,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class HtmxHttpRequest(HttpRequest):
    """A request that has been through django-htmx's HtmxMiddleware (settings.MIDDLEWARE)."""

    htmx: HtmxDetails


async def index(request: HttpRequest) -> HttpResponse:
    personas_ = [persona async for persona in Persona.objects.active()]
    return render(request, "quotes/index.html", {"personas": personas_})


async def persona_page(request: HttpRequest, slug: str) -> HttpResponse:
    # The stream's own persona cache: while the database is down, a persona this process has
    # served keeps its page, as it keeps its quotes (quotes.personas).
    try:
        active = await personas.get_active(slug)
    except QuoteError as exc:  # the database is down, and this process never loaded the persona
        return unavailable_page(request, exc)
    if active is None:
        raise Http404("No such persona.")
    persona = active.persona
    model = backend_for(persona).model_name(persona.model)
    return render(
        request,
        "quotes/persona.html",
        {
            "persona": persona,
            "model_name": model,
            "model_url": doc_url(model),
            "max_topic_chars": settings.QUOTES_MAX_TOPIC_CHARS,
            "max_message_chars": settings.QUOTES_MAX_MESSAGE_CHARS,
            "stream_url": reverse("quotes:stream"),
            "form_stream_url": reverse("quotes:stream-form"),
            # The page script builds a quote's URLs from these patterns ("{id}" is its id).
            "permalink_url": _url_pattern("quotes:permalink"),
            "feedback_url": _url_pattern("quotes:feedback"),
            "share_url": _url_pattern("quotes:share"),
            "stop_url": _url_pattern("quotes:stop"),
            # htmx drives the page; ?transport=fetch runs the same page on the fetch client
            # (static/js/quote-stream.js), which the browser tests use to prove that path too.
            "transport": "fetch" if request.GET.get("transport") == "fetch" else "htmx",
        },
    )


_ID_SLOT = uuid.UUID(int=0)


def _url_pattern(name: str) -> str:
    """The URL `name` takes a quote's public id in, with `{id}` where the id goes."""
    return reverse(name, args=[_ID_SLOT]).replace(str(_ID_SLOT), "{id}")


# --- the database down --------------------------------------------------------------------


def unavailable_response(request: HttpRequest, error: QuoteError) -> HttpResponseBase:
    """The 503 for a request the database was needed for and is down (quotes.database), in the
    request's own dialect: the htmx error event, the JSON error for the API (and any client that
    asks for JSON), a readable page for everyone else. All three carry Retry-After."""
    response: HttpResponseBase
    if request.headers.get("HX-Request") == "true":
        response = not_a_document(_htmx_error_response(error.as_event(), Meta()))
    elif request.path_info.startswith("/api/") or "application/json" in request.headers.get("Accept", ""):
        response = not_a_document(error_response(error))
    else:
        response = unavailable_page(request, error)
    patch_vary_headers(response, ("HX-Request", "Accept"))
    return response


def unavailable_page(request: HttpRequest, error: QuoteError) -> HttpResponse:
    """The readable 503 page (templates/503.html); it reads nothing from the database."""
    response = render(request, "503.html", {"message": error.message}, status=503)
    if error.retry_after is not None:
        response["Retry-After"] = str(error.retry_after)
    return response


def error_response(error: QuoteError | Error, headers: dict[str, str] | None = None) -> JsonResponse:
    headers = dict(headers or {})
    retry_after = getattr(error, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JsonResponse(envelope(error.code, error.message), status=error.status, headers=headers)


async def client_of(request: HttpRequest) -> Client:
    if settings.SESSION_COOKIE_NAME not in request.COOKIES:
        # No session, so no user: what request.auser() would find, without loading a session.
        return Client.from_request(request.META.get("REMOTE_ADDR") or "")
    user = await request.auser()
    return Client.from_request(
        request.META.get("REMOTE_ADDR") or "", user.pk if user.is_authenticated else None
    )


def not_a_document(response: HttpResponseBase) -> HttpResponseBase:
    """Mark a response that no browser renders as a page (an SSE stream, a JSON error, an htmx
    event): django-csp leaves it without a Content-Security-Policy."""
    return _csp_exempt(response)


# django-csp's `csp_exempt` marks what the function it wraps returns, and cannot wrap an async
# view: around the identity, it marks a response.
_csp_exempt: Callable[[HttpResponseBase], HttpResponseBase] = cast(
    Any, csp_exempt()(csp_exempt(REPORT_ONLY=True)(cast(Any, lambda response: response)))
)


@dataclass(frozen=True, slots=True)
class QuoteInput:
    """A checked request for one quote, whatever the transport (HTTP, htmx, WebSocket)."""

    persona: Persona
    version: PersonaVersion | None
    topic: str
    messages: tuple[Message, ...]
    fresh: bool


async def parse_quote_request(params: dict[str, Any]) -> QuoteInput:
    """Check `persona`, `topic`, `messages` and `fresh` the same way for every transport, or
    raise the QuoteError (400/404) that says what is wrong."""
    active = await _find_persona(params.get("persona"))
    persona = active.persona
    topic = clean_topic(params.get("topic"), default=persona.default_topic)
    messages = parse_messages(params.get("messages"))
    check_context_window(
        persona.build_request(topic=topic, messages=messages),
        model=backend_for(persona).model_name(persona.model),
    )
    return QuoteInput(
        persona=persona,
        version=active.version,
        topic=topic,
        messages=messages,
        fresh=_truthy(params.get("fresh")),
    )


def events_for(quote: QuoteInput, client: Client, transport: str) -> AsyncGenerator[Event, None]:
    return stream_generation(
        persona=quote.persona,
        version=quote.version,
        topic=quote.topic,
        messages=quote.messages,
        client=client,
        bypass_cache=quote.fresh,
        transport=transport,
    )


async def count_refused(client: Client) -> RateLimited | None:
    """Count a quote request refused before admission (invalid, its socket busy...) against the
    client's and its network's limits: the 429 to answer instead of its own error once over."""
    refused = await admission.count(client.key, settings.QUOTES_GATEWAY, network_key=client.network_key)
    return None if refused is None else RateLimited(refused.message, refused.retry_after or 1)


def _last_event_id(request: HttpRequest, params: dict[str, Any]) -> str | None:
    """The event a reconnecting client saw last: EventSource's own header, else the
    `last_event_id` parameter (the fetch and htmx clients)."""
    value = request.headers.get("Last-Event-ID") or params.get("last_event_id")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise bad_event_id()
    return value


def bad_event_id() -> QuoteError:
    message = "`last_event_id` must be an event id this site sent: <generation id>.<key>:<number>."
    return QuoteError(ErrorCode.INVALID_LAST_EVENT_ID, message, 400)


def resume_unavailable() -> QuoteError:
    message = "This quote cannot be resumed here (unknown, or kept no longer). Ask for a new one."
    return QuoteError(ErrorCode.RESUME_UNAVAILABLE, message, 404)


async def _resume(
    last_event_id: str,
    encoder: Encoder[bytes],
    request: HttpRequest,
    params: Mapping[str, Any],
    transport: str,
) -> HttpResponseBase:
    """The events of a generation after `last_event_id`, then its live rest (quotes.ai.gateway.runs):
    200 and a stream, whatever those events are (the client has had the stream's beginning)."""
    parsed = parse_event_id(last_event_id)
    if parsed is None:
        raise bad_event_id()
    client = await client_of(request)
    public_id, key, after = parsed
    resumed = await resume(public_id, key, after, client_key=client.key, options=settings.QUOTES_GATEWAY)
    if isinstance(resumed, Error):
        # Refused like a new stream (the client's slots, the process's cap, a draining process:
        # 503, nginx asks another one), and counted like one when the process refuses it (when
        # the request names its persona, as the page's and the API's resumes do).
        await refuse_if_full(slug=params.get("persona"), client=client, transport=transport)
        if isinstance(encoder, HtmxEncoder):
            return _htmx_error_response(resumed, Meta())
        return error_response(resumed)
    if resumed is None:
        raise resume_unavailable()
    release_request_thread()
    return StreamingHttpResponse(
        encode_stream(resumed.events, encoder, Opening(resumed.meta, None, resumed.after, resumed=True)),
        content_type="text/event-stream",
        headers={**SSE_HEADERS, **_meta_headers(resumed.meta), "X-Generation-Id": public_id},
    )


@csrf_exempt  # the JSON API requires Content-Type: application/json instead, which needs CORS cross-site
async def stream_quote(request: HtmxHttpRequest) -> HttpResponseBase:
    """POST a JSON body, or GET with query parameters (for EventSource); answer an SSE stream.

    A request from htmx (`HX-Request: true`) gets the htmx dialect (see HtmxEncoder), so every
    answer varies on that header."""
    response = not_a_document(await _stream_quote(request))
    patch_vary_headers(response, ("HX-Request",))
    return response


async def refuse_stream_when_full(request: HttpRequest, *, form: bool = False) -> HttpResponseBase | None:
    """The over-capacity (or server-draining) 503 of `stream_quote` (`form`: of
    `stream_quote_form`), as the view gives it (Retry-After, the JSON envelope or the htmx error
    event, the refusal counted), or None when the view must answer: the process is not at its
    limit, the request carries a session (a user's refusal is counted under their key, which only
    the session knows), or it is not a well-formed request for a persona this process knows.

    Called by quotes.middleware.StreamAdmissionGate before Django's handler runs: at the limit,
    refusals come by the hundred, and each one's cost is taken from the streams the process
    holds. A refusal starts nothing, so answering the form's before its CSRF check spends
    nothing on anyone's behalf; still, only a same-site post that carries a CSRF cookie and
    token is answered here, and anything else meets Django's check."""
    if not admission.at_capacity(settings.QUOTES_GATEWAY) or settings.SESSION_COOKIE_NAME in request.COOKIES:
        return None
    htmx = form or request.headers.get("HX-Request") == "true"  # what django-htmx's request.htmx says
    try:
        refuse_cross_site(request)
        params = _read_form(request) if form else _read_params(request)
        if params is not None and _last_event_id(request, params) is not None:
            return None  # a resume: the view admits it (a draining process serves the runs it holds)
    except QuoteError:
        return None  # the view answers it, as it answers any bad request
    if params is None:
        return None
    client = Client.from_request(request.META.get("REMOTE_ADDR") or "")
    full = await refuse_if_full(
        slug=params.get("persona"), client=client, transport="htmx" if htmx else "api"
    )
    if full is None:
        return None
    response = not_a_document(_htmx_error_response(full, Meta()) if htmx else error_response(full))
    if not form:
        patch_vary_headers(response, ("HX-Request",))  # as stream_quote's answers
    return response


def _read_form(request: HttpRequest) -> dict[str, Any] | None:
    """The form's fields, if it is a post that can pass Django's CSRF check (a CSRF cookie and a
    token in the form or the header), else None."""
    if request.method != "POST" or settings.CSRF_COOKIE_NAME not in request.COOKIES:
        return None
    _check_body_size(request)
    params = _form_params(request)
    if not (request.POST.get("csrfmiddlewaretoken") or request.META.get(settings.CSRF_HEADER_NAME)):
        return None
    return params


async def _stream_quote(request: HtmxHttpRequest) -> HttpResponseBase:
    htmx = bool(request.htmx)
    # EventSource always sends `Accept: text/event-stream`; a plain GET (curl) keeps the exact
    # Workers AI wire format.
    eventsource = request.method == "GET" and "text/event-stream" in request.headers.get("Accept", "")
    try:
        refuse_cross_site(request)  # another site's page must not start a (paid) generation
        params = _read_params(request)
        if (last_event_id := _last_event_id(request, params)) is not None:
            encoder = HtmxEncoder() if htmx else EventSourceEncoder() if eventsource else WorkersAIEncoder()
            return await _resume(last_event_id, encoder, request, params, "htmx" if htmx else "api")
        client = await client_of(request)
        # At the process's cap, refused before anything else is spent (see refuse_if_full; most
        # requests without a session were refused by StreamAdmissionGate already).
        full = await refuse_if_full(
            slug=params.get("persona"), client=client, transport="htmx" if htmx else "api"
        )
        if full is not None:
            return _htmx_error_response(full, Meta()) if htmx else error_response(full)
        quote = await parse_quote_request(params)
    except QuoteError as exc:
        headers = {"Allow": "GET, POST"} if exc.status == 405 else None
        exc = await _counted(request, exc)
        if htmx:
            return _htmx_error_response(exc.as_event(), Meta(), headers)
        return error_response(exc, headers)
    transport = "htmx" if htmx else "eventsource" if eventsource else "api"
    events = events_for(quote, client, transport)
    if htmx:
        return await _htmx_stream(events)
    return await stream_response(events, EventSourceEncoder() if eventsource else None)


async def stream_quote_form(request: HttpRequest) -> HttpResponseBase:
    """The persona page's form (form-encoded, with its CSRF token, which Django's middleware has
    checked by now: a form from another site never gets here), posted by htmx: answered in the
    htmx dialect."""
    return not_a_document(await _stream_quote_form(request))


async def _stream_quote_form(request: HttpRequest) -> HttpResponseBase:
    try:
        if request.method != "POST":
            raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Post the page's form.", 405)
        # The stream URLs' one rule, after Django's CSRF check: that check lets a post without an
        # Origin through on plain http on a token alone, and a sibling subdomain can plant the
        # CSRF cookie; its Sec-Fetch-Site still says where it comes from.
        refuse_cross_site(request)
        _check_body_size(request)
        params = _form_params(request)
        if (last_event_id := _last_event_id(request, params)) is not None:
            return await _resume(last_event_id, HtmxEncoder(), request, params, "htmx")
        client = await client_of(request)
        full = await refuse_if_full(slug=params.get("persona"), client=client, transport="htmx")
        if full is not None:
            return _htmx_error_response(full, Meta())
        quote = await parse_quote_request(params)
    except QuoteError as exc:
        exc = await _counted(request, exc)
        return _htmx_error_response(exc.as_event(), Meta(), {"Allow": "POST"} if exc.status == 405 else None)
    return await _htmx_stream(events_for(quote, client, "htmx"))


#: The refusals of a request's own input (bad JSON, an unknown persona, a body too large...):
#: each counts against the client's rate limit, as a quote it asked for would, so that invalid
#: requests are not free (each may cost a look-up). A cross-site refusal (403) does not: another
#: site's page would spend its visitor's budget.
_COUNTED_STATUSES = frozenset({400, 404, 405, 406, 413, 415})


async def _counted(request: HttpRequest, error: QuoteError) -> QuoteError:
    """Count a refused request against its client: the 429 to answer instead once the client is
    over its limit, else the request's own error."""
    if error.status not in _COUNTED_STATUSES:
        return error
    return await count_refused(await client_of(request)) or error


def csrf_failure(request: HtmxHttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: htmx gets the refusal as an error event the page can show (hx-sse
    handles any text/event-stream response, whatever its status), a client that asks for JSON
    (the page's share button) the JSON error, and everyone else Django's own page. One URL
    answers all three, so the answer varies on HX-Request and Accept."""
    response: HttpResponse
    error = Error(ErrorCode.CSRF_FAILED, "This page has expired. Reload it, then try again.", 403)
    if request.htmx:
        response = _htmx_error_response(error, Meta())
    elif "application/json" in request.headers.get("Accept", ""):
        response = error_response(error)
    else:
        response = csrf.csrf_failure(request, reason)
    patch_vary_headers(response, ("HX-Request", "Accept"))
    return response


def _truthy(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("1", "true", "yes"))


def _check_body_size(request: HttpRequest) -> None:
    too_large = QuoteError(
        ErrorCode.BODY_TOO_LARGE, f"The body is over {settings.QUOTES_MAX_BODY_BYTES} bytes.", 413
    )
    if int(request.headers.get("Content-Length") or 0) > settings.QUOTES_MAX_BODY_BYTES:
        raise too_large
    try:
        # A chunked body has no Content-Length: measure what arrived.
        if len(request.body) > settings.QUOTES_MAX_BODY_BYTES:
            raise too_large
    except RequestDataTooBig:
        raise too_large from None


def _read_params(request: HttpRequest) -> dict[str, Any]:
    if request.method == "GET":
        # An <img> or <link> of another site's page must not start a quote: browsers without
        # fetch metadata (Safari before 16.4) send no Sec-Fetch-Site to refuse it by, but an
        # EventSource always asks for text/event-stream, and a fetch() says Sec-Fetch-Dest: empty.
        if "text/event-stream" not in request.headers.get("Accept", "") and (
            request.headers.get("Sec-Fetch-Dest") != "empty"
        ):
            message = "A GET must accept the stream: send Accept: text/event-stream (EventSource does)."
            raise QuoteError(ErrorCode.NOT_ACCEPTABLE, message, 406)
        return request.GET.dict()
    if request.method != "POST":
        raise QuoteError(
            ErrorCode.METHOD_NOT_ALLOWED, "Use POST with a JSON body, or GET for EventSource.", 405
        )
    _check_body_size(request)
    if request.content_type != "application/json":
        raise QuoteError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            "Send the body as JSON with Content-Type: application/json.",
            415,
        )
    try:
        params = json.loads(request.body)
    except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
        raise QuoteError(ErrorCode.INVALID_JSON, "The body is not valid JSON (UTF-8).", 400) from None
    if not isinstance(params, dict):
        raise QuoteError(ErrorCode.INVALID_JSON, "The body must be a JSON object.", 400)
    return params


FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def _form_params(request: HttpRequest) -> dict[str, Any]:
    if request.content_type not in FORM_TYPES:
        raise QuoteError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, "Post the page's form.", 415)
    params: dict[str, Any] = request.POST.dict()
    params.pop("csrfmiddlewaretoken", None)
    if not params.get("topic"):
        params.pop("topic", None)
    raw = params.pop("messages", "")
    if raw:
        try:
            params["messages"] = json.loads(raw)
        except (ValueError, RecursionError):
            raise QuoteError(
                ErrorCode.INVALID_MESSAGES, "`messages` must be a JSON list of turns.", 400
            ) from None
    return params


_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,100}")


async def _find_persona(slug: object) -> personas.ActivePersona:
    if slug is None or slug == "":
        raise QuoteError(
            ErrorCode.MISSING_PERSONA, "Say which persona should speak: the `persona` field.", 400
        )
    if not isinstance(slug, str):
        raise QuoteError(ErrorCode.INVALID_PERSONA, "`persona` must be a string (a persona's slug).", 400)
    if not _SLUG.fullmatch(slug):  # never a persona, and PostgreSQL refuses some bytes (NUL) outright
        raise QuoteError(ErrorCode.UNKNOWN_PERSONA, f"There is no persona called {slug[:100]!r}.", 404)
    active = await personas.get_active(slug)
    if active is None:
        raise QuoteError(ErrorCode.UNKNOWN_PERSONA, f"There is no persona called {slug[:100]!r}.", 404)
    return active


def _meta_headers(meta: Meta) -> dict[str, str]:
    headers = meta.response_headers()
    if meta.model:
        headers["X-Quote-Model"] = meta.model
        headers["X-Quote-Model-Url"] = doc_url(meta.model)
    if meta.generation_id:
        headers["X-Quote-Id"] = meta.generation_id
    return headers


async def stream_response(
    events: AsyncGenerator[Event, None], encoder: Encoder[bytes] | None = None
) -> HttpResponseBase:
    """Wait for the first token (or an error) before answering, so an error that happens before
    any text gets its real HTTP status (a refusal its 429 or 503 and Retry-After); then stream."""
    # Nothing from here on needs the request's thread: it goes back to the pool before the wait
    # for the first token, so a burst of new streams holds none either (quotes.request_threads).
    release_request_thread()
    opening = await open_stream(events)
    headers = _meta_headers(opening.meta)
    if type(opening.first) is Error:
        await events.aclose()
        # The gateway headers (cf-aig-log-id above all) matter most when something failed.
        return error_response(opening.first, headers)
    if opening.meta.generation_id:
        headers["X-Generation-Id"] = opening.meta.generation_id
    return StreamingHttpResponse(
        encode_stream(events, encoder or WorkersAIEncoder(), opening),
        content_type="text/event-stream",
        headers={**SSE_HEADERS, **headers},
    )


# --- htmx ---------------------------------------------------------------------------------


def _htmx_error_response(error: Error, meta: Meta, headers: dict[str, str] | None = None) -> HttpResponse:
    """An error before any text, for htmx: the real status, and the error as a named SSE event
    (hx-sse handles any text/event-stream response, whatever its status), so the page can
    show the message instead of swapping an error page into the quote."""
    headers = {**SSE_HEADERS, **(headers or {})}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    body = sse.named("meta", meta_payload(meta)) if meta.generation_id else b""
    body += sse.named("error", error_payload(error))
    return HttpResponse(body, status=error.status, content_type="text/event-stream", headers=headers)


async def _htmx_stream(events: AsyncGenerator[Event, None]) -> HttpResponseBase:
    release_request_thread()  # as in stream_response
    opening = await open_stream(events)
    headers = _meta_headers(opening.meta)
    if type(opening.first) is Error:
        await events.aclose()
        return _htmx_error_response(opening.first, opening.meta, headers)
    if opening.meta.generation_id:
        headers["X-Generation-Id"] = opening.meta.generation_id
    return StreamingHttpResponse(
        encode_stream(events, HtmxEncoder(), opening),
        content_type="text/event-stream",
        headers={**SSE_HEADERS, **headers},
    )


# --- stop --------------------------------------------------------------------------------


@csrf_exempt  # refuse_cross_site instead: a page of another site cannot stop a visitor's quote
async def stop_quote(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """POST: stop a generation at once (the upstream is closed now, its row says `stopped`),
    for the client that started it, whichever process holds it. `stopped` is false when it had
    ended already. Anyone else, and an unknown id, gets the same 404: an id says nothing about
    someone else's quote."""
    try:
        if request.method != "POST":
            raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use POST.", 405)
        refuse_cross_site(request)
        client = await client_of(request)
        await count_action("stop", client.key)
        stopped = await stop_run(str(public_id), client.key)
        if stopped is None:
            raise QuoteError(ErrorCode.UNKNOWN_STREAM, "You have no quote with this id.", 404)
    except QuoteError as exc:
        return error_response(exc, {"Allow": "POST"} if exc.status == 405 else None)
    return JsonResponse({"id": str(public_id), "stopped": stopped})


# --- permalinks and feedback --------------------------------------------------------------

#: How long after it was written a quote can still be rated.
FEEDBACK_WINDOW = timedelta(days=1)


async def quote_permalink(request: HttpRequest, public_id: uuid.UUID) -> HttpResponse:
    try:
        generation = await Generation.objects.select_related("persona").aget(
            public_id=public_id, status=Generation.Status.OK, is_preview=False
        )
    except Generation.DoesNotExist:
        raise Http404("No such quote.") from None
    # Showing writes nothing: a link preview's bot, a crawler or a prefetch is no share. Only the
    # page's buttons keep a quote past the log's retention (share_quote).
    text = generation.text.strip()
    return render(
        request,
        "quotes/permalink.html",
        {
            "generation": generation,
            "persona": generation.persona,
            "text": text,
            "model_url": doc_url(generation.model),
            "absolute_url": request.build_absolute_uri(),
            "persona_url": request.build_absolute_uri(
                reverse("quotes:persona", kwargs={"slug": generation.persona.slug})
            ),
        },
    )


async def share_quote(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """POST: the visitor shared this quote (the persona page's Permalink or Copy button, with
    the page's CSRF token, which Django's middleware has checked by now): retention keeps it
    (quotes.services.generation_share). Opening the permalink page does not, so link previews
    and crawlers keep nothing. Sharing again changes nothing."""
    try:
        if request.method != "POST":
            raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use POST.", 405)
        await count_action("share", (await client_of(request)).key)
        if not await services.generation_share(public_id=public_id):
            raise QuoteError(ErrorCode.UNKNOWN_QUOTE, "There is no such quote.", 404)
    except QuoteError as exc:
        return error_response(exc, {"Allow": "POST"} if exc.status == 405 else None)
    return JsonResponse(
        {"id": str(public_id), "shared": True, "permalink": reverse("quotes:permalink", args=[public_id])}
    )


@csrf_exempt  # JSON only, like the stream API: a cross-site form cannot send application/json
async def quote_feedback(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """POST {"value": 1 | -1}: a visitor's thumbs up or down on a quote, one per visitor (see
    quotes.services.generation_feedback_set). Setting the same value again changes nothing (idempotent); a new value
    replaces that visitor's old one. Rate-limited per visitor (QUOTES_FEEDBACK_RATE_LIMIT)."""
    try:
        if request.method != "POST":
            raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use POST with a JSON body.", 405)
        client = await client_of(request)
        await count_action("feedback", client.key)
        params = _read_params(request)
        value = params.get("value")
        if type(value) is not int or value not in (1, -1):
            raise QuoteError(
                ErrorCode.INVALID_FEEDBACK, "`value` must be 1 (thumbs up) or -1 (thumbs down).", 400
            )
        try:
            generation = await Generation.objects.aget(public_id=public_id, is_preview=False)
        except Generation.DoesNotExist:
            raise QuoteError(ErrorCode.UNKNOWN_QUOTE, "There is no such quote.", 404) from None
        if generation.status != Generation.Status.OK:
            raise QuoteError(ErrorCode.NOT_RATEABLE, "Only a finished quote can be rated.", 409)
        if generation.created_at < timezone.now() - FEEDBACK_WINDOW:
            raise QuoteError(ErrorCode.FEEDBACK_CLOSED, "This quote is too old to be rated now.", 403)
    except QuoteError as exc:
        return error_response(exc, {"Allow": "POST"} if exc.status == 405 else None)
    await services.generation_feedback_set(generation_id=generation.pk, client_key=client.key, value=value)
    return JsonResponse({"id": str(generation.public_id), "feedback": value})
