"""Thin views: check the request, admit it, start or resume a generation, hand it to an encoder.

Two URLs stream a quote: the JSON API (`stream_quote`, also htmx and EventSource) and the persona
page's form (`stream_quote_form`, under Django's CSRF check); the WebSocket is quotes.consumers.
Every answer to another site's page comes first (403, counted against nobody); bad input is
counted against the client's rate limit only when the request shows it comes from this site or
from no browser at all, so a page elsewhere cannot spend a visitor's budget."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, cast

from asgiref.sync import markcoroutinefunction
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
from streaming import Error, Meta, Stream

from . import personas, rows, services, streams
from .backends import backend_for
from .backends.catalog import doc_url
from .clients import Client
from .encoders import (
    EventSourceEncoder,
    HtmxEncoder,
    SSEEncoder,
    WorkersAIEncoder,
    error_response,
    openai_error_response,
    stream_response,
)
from .errors import ErrorCode, QuoteError
from .models import Generation, Persona
from .personas import UNREACHABLE, memory
from .rate_limits import count_action, count_stream, count_vote
from .security import counts_bad_input, refuse_cross_site

#: Marks a response no browser renders as a page (a stream, a JSON error): no CSP for it.
not_a_document: Callable[[HttpResponseBase], HttpResponseBase] = cast(
    Any, csp_exempt()(csp_exempt(REPORT_ONLY=True)(cast(Any, lambda response: response)))
)
ID_SLOT = uuid.UUID(int=0)
FEEDBACK_WINDOW = timedelta(days=1)


async def index(request: HttpRequest) -> HttpResponse:
    return render(request, "quotes/index.html", {"personas": [p async for p in Persona.objects.active()]})


async def persona_page(request: HttpRequest, slug: str) -> HttpResponse:
    active = await personas.get_active(slug)  # a 503 page while the database is down (the middleware)
    if active is None:
        raise Http404("No such persona.")
    persona = active.persona
    model = backend_for(persona).model_name(persona.model)
    urls = {
        f"{name}_url": reverse(f"quotes:{name}", args=[ID_SLOT]).replace(str(ID_SLOT), "{id}")
        for name in ("permalink", "feedback", "share", "stop")
    }
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
            **urls,
            # htmx drives the page; ?transport=fetch runs it on the fetch client instead.
            "transport": "fetch" if request.GET.get("transport") == "fetch" else "htmx",
        },
    )


async def quote_permalink(request: HttpRequest, public_id: uuid.UUID) -> HttpResponse:
    try:
        generation = await Generation.objects.select_related("persona").aget(
            public_id=public_id, status=Generation.Status.OK, is_preview=False
        )
    except Generation.DoesNotExist:
        raise Http404("No such quote.") from None
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
                reverse("quotes:persona", args=[generation.persona.slug])
            ),
        },
    )


async def client_of(request: HttpRequest) -> Client:
    user_id = None
    if settings.SESSION_COOKIE_NAME in request.COOKIES:  # no session, no user: nothing to load
        user = await request.auser()
        user_id = user.pk if user.is_authenticated else None
    return Client.of(
        request.META.get("REMOTE_ADDR") or "", user_id, request.COOKIES.get(settings.CSRF_COOKIE_NAME, "")
    )


def from_htmx(request: HttpRequest) -> bool:
    """The page's htmx asks (its dialect: fragments and named events); an answer that depends on
    it varies on HX-Request."""
    return request.headers.get("HX-Request") == "true"


# -- the stream ------------------------------------------------------------------------------


@csrf_exempt  # JSON only: a cross-site form cannot send application/json without CORS
async def stream_quote(request: HttpRequest) -> HttpResponseBase:
    """POST a JSON body, or GET with query parameters (EventSource); an SSE stream, in htmx's
    dialect for htmx (so every answer varies on HX-Request)."""
    accept = request.headers.get("Accept", "")
    encoder, transport = stream_dialect(htmx=from_htmx(request), method=request.method or "", accept=accept)
    response = not_a_document(await _stream(request, encoder, transport, form=False))
    patch_vary_headers(response, ("HX-Request",))
    return response


def stream_dialect(*, htmx: bool, method: str, accept: str) -> tuple[SSEEncoder, str]:
    """The stream URL's answer for a request (also quotes.gate's): htmx's fragments, an
    EventSource's stream, or the JSON API's; and its transport's name."""
    if htmx:
        return HtmxEncoder(), "htmx"
    if method == "GET" and "text/event-stream" in accept:
        return EventSourceEncoder(), "eventsource"
    return WorkersAIEncoder(), "api"


async def stream_quote_form(request: HttpRequest) -> HttpResponseBase:
    """The persona page's form, posted by htmx (Django's middleware has checked its CSRF token)."""
    return not_a_document(await _stream(request, HtmxEncoder(), "htmx", form=True))


async def _stream(
    request: HttpRequest, encoder: SSEEncoder, transport: str, *, form: bool
) -> HttpResponseBase:
    params: dict[str, Any] = {}
    try:
        refuse_cross_site(request)
        client = await client_of(request)
        try:
            params = _form_params(request) if form else _api_params(request)
        except QuoteError as exc:
            await count_bad_input(request, client, exc)
            raise
        stream, after = await open_stream(request, client, params, transport)
        return await stream_response(stream, encoder, after)
    except QuoteError as exc:
        rows.refused(exc, params.get("persona"), transport)
        response = encoder.error_answer(exc.as_event(), Meta())
        if exc.status == 405:
            response["Allow"] = "POST" if form else "GET, POST"
        return response


async def count_bad_input(request: HttpRequest, client: Client, error: QuoteError) -> None:
    """A request's mistake counts against the client's stream budget when it comes from this
    site or from no browser at all; a 406 (a GET no EventSource sent: an <img>) never does."""
    if error.status != 406 and counts_bad_input(request):
        await count_stream(client)


async def open_stream(
    request: HttpRequest, client: Client, params: dict[str, Any], transport: str
) -> tuple[Stream, int]:
    """The stream a request resumes (Last-Event-ID, or a `last_event_id` field) and the number
    of the last event it had, or a new one (streams.begin) and 0."""
    if last_event_id := request.headers.get("Last-Event-ID") or params.get("last_event_id"):
        await count_stream(client)
        return streams.find(last_event_id)
    return await streams.begin(client, transport=transport, params=params), 0


def _check_body_size(request: HttpRequest) -> None:
    limit = settings.QUOTES_MAX_BODY_BYTES
    try:  # a chunked body has no Content-Length: measure what arrived
        too_large = int(request.headers.get("Content-Length") or 0) > limit or len(request.body) > limit
    except RequestDataTooBig:
        too_large = True
    if too_large:
        raise QuoteError(ErrorCode.BODY_TOO_LARGE, f"The body is over {limit} bytes.", 413)


def _api_params(request: HttpRequest) -> dict[str, Any]:
    if request.method == "GET":
        # An <img> or <script> of another site's page must not start a quote, in a browser that
        # sends no Sec-Fetch-Site: an EventSource asks for text/event-stream, a fetch() says
        # Sec-Fetch-Dest: empty.
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
    return read_json(request)


def read_json(request: HttpRequest) -> dict[str, Any]:
    if request.content_type != "application/json":
        message = "Send the body as JSON with Content-Type: application/json."
        raise QuoteError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, message, 415)
    _check_body_size(request)
    return json_object(request.body)


def json_object(body: bytes) -> dict[str, Any]:
    """A body that must be one JSON object (also quotes.gate's reading), else the 400."""
    try:
        params = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
        raise QuoteError(ErrorCode.INVALID_JSON, "The body is not valid JSON (UTF-8).", 400) from None
    if not isinstance(params, dict):
        raise QuoteError(ErrorCode.INVALID_JSON, "The body must be a JSON object.", 400)
    return params


def _form_params(request: HttpRequest) -> dict[str, Any]:
    if request.method != "POST":
        raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Post the page's form.", 405)
    if request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        raise QuoteError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, "Post the page's form.", 415)
    _check_body_size(request)
    params: dict[str, Any] = request.POST.dict()
    params.pop("csrfmiddlewaretoken", None)
    if not params.get("topic"):
        params.pop("topic", None)
    if raw := params.pop("messages", ""):
        try:
            params["messages"] = json.loads(raw)
        except (ValueError, RecursionError):
            raise QuoteError(
                ErrorCode.INVALID_MESSAGES, "`messages` must be a JSON list of turns.", 400
            ) from None
    return params


# -- what a visitor does with a quote ---------------------------------------------------------


ActionView = Callable[..., Coroutine[Any, Any, HttpResponseBase]]


def quote_action(
    action: str, *, json_body: bool = False, counted: bool = True
) -> Callable[[ActionView], ActionView]:
    """A POST-only JSON view for a quote: another site's page refused first, then the method,
    the body's type, then (`counted`) the count against the action's budget; a QuoteError is its
    JSON."""

    def decorator(view: ActionView) -> ActionView:
        async def action_view(request: HttpRequest, public_id: uuid.UUID) -> HttpResponseBase:
            try:
                refuse_cross_site(request)
                if request.method != "POST":
                    raise QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "Use POST.", 405)
                body = read_json(request) if json_body else {}
                client = await client_of(request)
                if counted:
                    await count_action(action, client)
                return await view(request, public_id, client, body)
            except QuoteError as exc:
                return error_response(exc, {"Allow": "POST"} if exc.status == 405 else None)

        return action_view

    return decorator


@csrf_exempt  # refuse_cross_site instead: another site's page cannot stop a visitor's quote
@quote_action("stop", counted=False)
async def stop_quote(request: HttpRequest, public_id: uuid.UUID, client: Client, body: Any) -> JsonResponse:
    """Stop the client's own generation now (its row says `stopped`); `stopped` is false when it
    had ended. Anyone else, and an unknown id, gets the same 404. Only those count against the
    budget for stops: a Stop that stops a visitor's own quote saves what it would cost, and is
    never refused."""
    stopped = await streams.stop(str(public_id), client)
    if stopped is None:
        await count_action("stop", client)
        raise QuoteError(ErrorCode.UNKNOWN_STREAM, "You have no quote with this id.", 404)
    return JsonResponse({"id": str(public_id), "stopped": stopped})


@quote_action("share")  # under Django's CSRF check: the page's Permalink and Copy buttons
async def share_quote(request: HttpRequest, public_id: uuid.UUID, client: Client, body: Any) -> JsonResponse:
    """The visitor shared this quote: retention keeps it (services.generation_share)."""
    if not await services.generation_share(public_id=public_id):
        raise QuoteError(ErrorCode.UNKNOWN_QUOTE, "There is no such quote.", 404)
    return JsonResponse(
        {"id": str(public_id), "shared": True, "permalink": reverse("quotes:permalink", args=[public_id])}
    )


@csrf_exempt  # JSON only, like the stream API
@quote_action("feedback", json_body=True)
async def quote_feedback(
    request: HttpRequest, public_id: uuid.UUID, client: Client, body: dict[str, Any]
) -> JsonResponse:
    """{"value": 1 | -1}: a visitor's thumbs up or down, one per visitor; a new value replaces it."""
    value = body.get("value")
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
    await count_vote(client, str(public_id))
    await services.generation_feedback_set(generation_id=generation.pk, client_key=client.key, value=value)
    return JsonResponse({"id": str(generation.public_id), "feedback": value})


# -- failures --------------------------------------------------------------------------------


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: an error event for htmx, the JSON error for a client that asks for
    JSON (the share button), Django's own page for everyone else."""
    error = Error(ErrorCode.CSRF_FAILED, "This page has expired. Reload it, then try again.", 403)
    response: HttpResponse
    if from_htmx(request):
        response = HtmxEncoder().error_answer(error, Meta())
    elif "application/json" in request.headers.get("Accept", ""):
        response = error_response(error)
    else:
        response = csrf.csrf_failure(request, reason)
    patch_vary_headers(response, ("HX-Request", "Accept"))
    return response


class DatabaseOutageMiddleware:
    """The database down: a 503 with Retry-After in the request's dialect (the htmx error event,
    the JSON error, a readable page), not a 500 and a traceback per request."""

    sync_capable, async_capable = False, True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return await self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponseBase | None:
        if isinstance(exception, QuoteError) and exception.code == ErrorCode.SERVICE_UNAVAILABLE:
            error = exception
        elif isinstance(exception, UNREACHABLE):
            memory.outage.failed(exception)
            error = memory.outage.error()
        else:
            return None
        response: HttpResponseBase
        if from_htmx(request):
            response = not_a_document(HtmxEncoder().error_answer(error.as_event(), Meta()))
        elif request.path_info.startswith("/v1/"):  # OpenAI's face: OpenAI's envelope
            response = not_a_document(openai_error_response(error))
        elif request.path_info.startswith("/api/") or "application/json" in request.headers.get("Accept", ""):
            response = not_a_document(error_response(error))
        else:
            response = render(request, "503.html", {"message": error.message}, status=503)
            response["Retry-After"] = str(error.retry_after or 1)
        patch_vary_headers(response, ("HX-Request", "Accept"))
        return response
