"""Thin views: parse input, call the gateway, hand its events to a transport (quotes.transports).
Two URLs stream a quote: the JSON API (`stream_quote`) and the persona page's form
(`stream_quote_form`); the WebSocket is quotes.consumers."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, cast

from csp.decorators import csp_exempt
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views import csrf
from django.views.decorators.csrf import csrf_exempt
from django_htmx.middleware import HtmxDetails

from . import personas, services
from .ai.backends import backend_for
from .ai.catalog import doc_url
from .ai.errors import ErrorCode, QuoteError
from .ai.events import Error, Meta
from .ai.gateway import admission
from .ai.gateway.generation import Client, refuse_if_full
from .ai.gateway.runs import stop as stop_run
from .feedback import count_action
from .forks import asgi_scope
from .models import Generation, Persona
from .quote_request import count_refused, events_for, parse_quote_request, resume_quote
from .security import refuse_cross_site
from .transports import EventSourceEncoder, HtmxEncoder, WorkersAIEncoder, error_response, stream_response


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails  # set by django-htmx's HtmxMiddleware


async def index(request: HttpRequest) -> HttpResponse:
    personas_ = [persona async for persona in Persona.objects.active()]
    return render(request, "quotes/index.html", {"personas": personas_})


ID_SLOT = uuid.UUID(int=0)


async def persona_page(request: HttpRequest, slug: str) -> HttpResponse:
    # While the database is down, a persona this process has served keeps its page (quotes.personas).
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
            **{
                f"{name}_url": reverse(f"quotes:{name}", args=[ID_SLOT]).replace(str(ID_SLOT), "{id}")
                for name in ("permalink", "feedback", "share", "stop")
            },
            # htmx drives the page; ?transport=fetch runs the same page on the fetch client
            # (static/js/quote-stream.js), which the browser tests use to prove that path too.
            "transport": "fetch" if request.GET.get("transport") == "fetch" else "htmx",
        },
    )


def unavailable_response(request: HttpRequest, error: QuoteError) -> HttpResponseBase:
    """The 503 of a request that met the database down (quotes.database), in its own dialect."""
    response: HttpResponseBase
    if request.headers.get("HX-Request") == "true":
        response = not_a_document(HtmxEncoder().error_answer(error.as_event(), Meta()))
    elif request.path_info.startswith("/api/") or "application/json" in request.headers.get("Accept", ""):
        response = not_a_document(error_response(error))
    else:
        response = unavailable_page(request, error)
    patch_vary_headers(response, ("HX-Request", "Accept"))
    return response


def unavailable_page(request: HttpRequest, error: QuoteError) -> HttpResponse:
    response = render(request, "503.html", {"message": error.message}, status=503)
    if error.retry_after is not None:
        response["Retry-After"] = str(error.retry_after)
    return response


async def client_of(request: HttpRequest) -> Client:
    user_id = None
    if settings.SESSION_COOKIE_NAME in request.COOKIES:  # no session, no user: no session to load
        user = await request.auser()
        user_id = user.pk if user.is_authenticated else None
    return Client.from_request(request.META.get("REMOTE_ADDR") or "", user_id)


#: Marks a response no browser renders as a page (an SSE stream, a JSON error, an htmx event):
#: django-csp leaves it without a CSP. `csp_exempt` marks what the function it wraps returns and
#: cannot wrap an async view: around the identity, it marks a response.
not_a_document: Callable[[HttpResponseBase], HttpResponseBase] = cast(
    Any, csp_exempt()(csp_exempt(REPORT_ONLY=True)(cast(Any, lambda response: response)))
)


class NotRefused(Exception):
    """Raised by a stream view called with `gate` (quotes.middleware.StreamAdmissionGate, before
    Django's handler: at the open-stream limit, refusals come by the hundred), which answers only
    this process's refusal of a new stream there. A session goes on to Django's handler (a user's
    refusal is counted under their key), and so does a resume (a draining process serves the runs
    it holds)."""


@csrf_exempt  # the JSON API requires Content-Type: application/json instead, which needs CORS cross-site
async def stream_quote(request: HttpRequest, *, gate: bool = False) -> HttpResponseBase:
    """POST a JSON body, or GET with query parameters (for EventSource); answer an SSE stream, in
    htmx's dialect for a request from htmx (so every answer varies on HX-Request)."""
    response = not_a_document(await _stream_quote(request, form=False, gate=gate))
    patch_vary_headers(response, ("HX-Request",))
    return response


async def stream_quote_form(request: HttpRequest, *, gate: bool = False) -> HttpResponseBase:
    """The persona page's form, posted by htmx (Django's middleware has checked its CSRF token)."""
    return not_a_document(await _stream_quote(request, form=True, gate=gate))


async def _stream_quote(request: HttpRequest, *, form: bool, gate: bool) -> HttpResponseBase:
    # The gate runs before Django's CSRF check: a refusal starts nothing, and only a same-site form
    # that carries a CSRF cookie and token is answered there (anything else meets Django's check).
    cookies = request.COOKIES
    if gate and (
        settings.SESSION_COOKIE_NAME in cookies or (form and settings.CSRF_COOKIE_NAME not in cookies)
    ):
        raise NotRefused
    # request.htmx's test, by hand: the gate runs no HtmxMiddleware.
    htmx = form or request.headers.get("HX-Request") == "true"
    encoder, transport = _dialect(request, htmx=htmx)
    refused_as = "htmx" if htmx else "api"  # a refusal is counted under its URL's transport
    admitted: admission.Entry | Error | None = asgi_scope(request).get(admission.DECIDED)  # the gate's
    try:
        params = _stream_params(request, form=form)
        # EventSource's Last-Event-ID, else the `last_event_id` parameter (the fetch and htmx clients)
        last_event_id = request.headers.get("Last-Event-ID") or params.get("last_event_id")
        resuming = last_event_id not in (None, "")
        if gate and (resuming or (form and not _csrf_token(request))):
            raise NotRefused
        client = await client_of(request)
        if resuming:
            resumed = await resume_quote(last_event_id, client, admitted)
            if isinstance(resumed, Error):  # refused, and counted, like a new stream
                await refuse_if_full(resumed, slug=params.get("persona"), client=client, transport=refused_as)
                return encoder.error_answer(resumed, Meta())
            return await stream_response(resumed.events, encoder, resumed)
        full = await refuse_if_full(admitted, slug=params.get("persona"), client=client, transport=refused_as)
        if full is not None:
            return encoder.error_answer(full, Meta())
        if gate:
            raise NotRefused
        quote = await parse_quote_request(params)
    except QuoteError as exc:
        if gate:
            raise NotRefused from None
        # A refusal of the request's own input counts against the client's rate limit, so that
        # invalid requests are not free; a cross-site one (403) does not: it spends a victim's.
        error = exc
        if exc.status in (400, 404, 405, 406, 413, 415):
            error = await count_refused(await client_of(request)) or exc
        response = encoder.error_answer(error.as_event(), Meta())
        if error.status == 405:
            response["Allow"] = "POST" if form else "GET, POST"
        return response
    return await stream_response(events_for(quote, client, transport, admitted), encoder)


def _dialect(request: HttpRequest, *, htmx: bool) -> tuple[WorkersAIEncoder | HtmxEncoder, str]:
    """The encoder a stream request is answered with, and its transport's name."""
    if htmx:
        return HtmxEncoder(), "htmx"
    # EventSource always sends `Accept: text/event-stream`; a plain GET (curl) gets Workers AI's format.
    if request.method == "GET" and "text/event-stream" in request.headers.get("Accept", ""):
        return EventSourceEncoder(), "eventsource"
    return WorkersAIEncoder(), "api"


def _csrf_token(request: HttpRequest) -> str | None:
    return request.POST.get("csrfmiddlewaretoken") or request.META.get(settings.CSRF_HEADER_NAME)


def _stream_params(request: HttpRequest, *, form: bool) -> dict[str, Any]:
    """A stream request's parameters: the page's form, or the API's JSON body or query."""
    if form and request.method != "POST":
        raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Post the page's form.", 405)
    # Another site's page must not start a (paid) generation. After Django's CSRF check, which lets
    # a post without an Origin through on plain http on a token alone (and a sibling subdomain can
    # plant the CSRF cookie): its Sec-Fetch-Site still says where it comes from.
    refuse_cross_site(request)
    return _form_params(request) if form else _read_params(request)


def csrf_failure(request: HtmxHttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: an error event for htmx, the JSON error for a client that asks for JSON
    (the page's share button), Django's own page for everyone else."""
    response: HttpResponse
    error = Error(ErrorCode.CSRF_FAILED, "This page has expired. Reload it, then try again.", 403)
    if request.htmx:
        response = HtmxEncoder().error_answer(error, Meta())
    elif "application/json" in request.headers.get("Accept", ""):
        response = error_response(error)
    else:
        response = csrf.csrf_failure(request, reason)
    patch_vary_headers(response, ("HX-Request", "Accept"))
    return response


def _check_body_size(request: HttpRequest) -> None:
    limit = settings.QUOTES_MAX_BODY_BYTES
    try:  # a chunked body has no Content-Length: measure what arrived
        too_large = int(request.headers.get("Content-Length") or 0) > limit or len(request.body) > limit
    except RequestDataTooBig:
        too_large = True
    if too_large:
        raise QuoteError(ErrorCode.BODY_TOO_LARGE, f"The body is over {limit} bytes.", 413)


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
        message = "Use POST with a JSON body, or GET for EventSource."
        raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, message, 405)
    _check_body_size(request)
    if request.content_type != "application/json":
        message = "Send the body as JSON with Content-Type: application/json."
        raise QuoteError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, message, 415)
    try:
        params = json.loads(request.body)
    except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
        raise QuoteError(ErrorCode.INVALID_JSON, "The body is not valid JSON (UTF-8).", 400) from None
    if not isinstance(params, dict):
        raise QuoteError(ErrorCode.INVALID_JSON, "The body must be a JSON object.", 400)
    return params


def _form_params(request: HttpRequest) -> dict[str, Any]:
    _check_body_size(request)
    if request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        raise QuoteError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, "Post the page's form.", 415)
    params: dict[str, Any] = request.POST.dict()
    params.pop("csrfmiddlewaretoken", None)
    if not params.get("topic"):
        params.pop("topic", None)
    if raw := params.pop("messages", ""):
        try:
            params["messages"] = json.loads(raw)
        except (ValueError, RecursionError):
            message = "`messages` must be a JSON list of turns."
            raise QuoteError(ErrorCode.INVALID_MESSAGES, message, 400) from None
    return params


QuoteView = Callable[[HttpRequest, uuid.UUID], Coroutine[Any, Any, HttpResponseBase]]


def post_only(message: str) -> Callable[[QuoteView], QuoteView]:
    """A POST-only JSON view: a QuoteError it raises is its JSON error (`message` for a 405)."""

    def decorator(view: QuoteView) -> QuoteView:
        @functools.wraps(view)
        async def post_view(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
            if request.method != "POST":
                error = QuoteError(ErrorCode.METHOD_NOT_ALLOWED, message, 405)
                return error_response(error, {"Allow": "POST"})
            try:
                return await view(request, public_id)
            except QuoteError as exc:
                return error_response(exc)

        return post_view

    return decorator


@csrf_exempt  # refuse_cross_site instead: a page of another site cannot stop a visitor's quote
@post_only("Use POST.")
async def stop_quote(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """Stop a generation at once (its row says `stopped`), for the client that started it,
    whichever process holds it; `stopped` is false when it had ended. Anyone else, and an unknown
    id, gets the same 404: an id says nothing about someone else's quote."""
    refuse_cross_site(request)
    client = await client_of(request)
    await count_action("stop", client.key)
    stopped = await stop_run(str(public_id), client.key)
    if stopped is None:
        raise QuoteError(ErrorCode.UNKNOWN_STREAM, "You have no quote with this id.", 404)
    return JsonResponse({"id": str(public_id), "stopped": stopped})


#: How long after it was written a quote can still be rated.
FEEDBACK_WINDOW = timedelta(days=1)


async def quote_permalink(request: HttpRequest, public_id: uuid.UUID) -> HttpResponse:
    try:
        generation = await Generation.objects.select_related("persona").aget(
            public_id=public_id, status=Generation.Status.OK, is_preview=False
        )
    except Generation.DoesNotExist:
        raise Http404("No such quote.") from None
    # Showing writes nothing: a link preview's bot, a crawler or a prefetch is no share.
    return render(
        request,
        "quotes/permalink.html",
        {
            "generation": generation,
            "persona": generation.persona,
            "text": generation.text.strip(),
            "model_url": doc_url(generation.model),
            "absolute_url": request.build_absolute_uri(),
            "persona_url": request.build_absolute_uri(
                reverse("quotes:persona", kwargs={"slug": generation.persona.slug})
            ),
        },
    )


@post_only("Use POST.")
async def share_quote(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """The visitor shared this quote (the page's Permalink or Copy button, CSRF-checked by
    Django's middleware): retention keeps it (quotes.services.generation_share)."""
    await count_action("share", (await client_of(request)).key)
    if not await services.generation_share(public_id=public_id):
        raise QuoteError(ErrorCode.UNKNOWN_QUOTE, "There is no such quote.", 404)
    return JsonResponse(
        {"id": str(public_id), "shared": True, "permalink": reverse("quotes:permalink", args=[public_id])}
    )


@csrf_exempt  # JSON only, like the stream API: a cross-site form cannot send application/json
@post_only("Use POST with a JSON body.")
async def quote_feedback(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
    """{"value": 1 | -1}: a visitor's thumbs up or down, one per visitor, rate-limited
    (QUOTES_FEEDBACK_RATE_LIMIT); a new value replaces the visitor's old one."""
    client = await client_of(request)
    await count_action("feedback", client.key)
    value = _read_params(request).get("value")
    if type(value) is not int or value not in (1, -1):
        message = "`value` must be 1 (thumbs up) or -1 (thumbs down)."
        raise QuoteError(ErrorCode.INVALID_FEEDBACK, message, 400)
    try:
        generation = await Generation.objects.aget(public_id=public_id, is_preview=False)
    except Generation.DoesNotExist:
        raise QuoteError(ErrorCode.UNKNOWN_QUOTE, "There is no such quote.", 404) from None
    if generation.status != Generation.Status.OK:
        raise QuoteError(ErrorCode.NOT_RATEABLE, "Only a finished quote can be rated.", 409)
    if generation.created_at < timezone.now() - FEEDBACK_WINDOW:
        raise QuoteError(ErrorCode.FEEDBACK_CLOSED, "This quote is too old to be rated now.", 403)
    await services.generation_feedback_set(generation_id=generation.pk, client_key=client.key, value=value)
    return JsonResponse({"id": str(generation.public_id), "feedback": value})
