"""Cloudflare Workers AI, directly or through AI Gateway, streamed over SSE (wire facts:
shared/reference/workers-ai.md).

Only the connect and pool timeouts are httpx's: every other wait is bounded by the policy, which
cancels the stream's task, and the response is closed on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncGenerator, Iterable
from dataclasses import replace
from typing import Any

import httpx
from django.conf import settings
from streaming import Done, Error, Event, Meta, Token, Usage

from ..errors import (
    ErrorCode,
    Scrubber,
    scrub,
    upstream_dropped,
    upstream_malformed,
    upstream_status_error,
    upstream_text,
    upstream_timeout,
    upstream_unreachable,
)
from .base import GenerationRequest
from .upstream_sse import ServerSentEvent, finish_body, read_error_body, upstream_events

logger = logging.getLogger(__name__)

#: Response headers kept on the Meta event (cache hits, fallback step, log ids).
META_HEADERS = ("cf-aig-cache-status", "cf-aig-step", "cf-aig-log-id", "cf-aig-request-id")

# `@cf/meta/llama-3.1-8b-instruct`: it goes into the URL path, so nothing that could climb out of
# it ("..", "?", "#", "%", spaces) is allowed.
_MODEL_ID = re.compile(r"@?[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*", re.ASCII)

_RETRY = "Please try again shortly."

#: The site's request itself was refused: our fault, not the visitor's (a 502 to them).
_OUR_REQUEST = "The model service refused the site's request. This is not your fault; please try again later."

# Documented Workers AI codes (src/content/docs/workers-ai/platform/errors.mdx in Cloudflare's docs)
# -> (our code, the status we answer, a message for the visitor). 5006 is not in that table: it is
# what Workers AI answers a body its input schema refuses ("AiError: Bad input: Error: oneOf at '/'
# not met", cloudflare/ai#279).
ERROR_CODES: dict[int, tuple[ErrorCode, int, str]] = {
    5007: (
        ErrorCode.MODEL_NOT_FOUND,
        502,
        "This persona's model is not offered by Workers AI any more. The site's admins have been told.",
    ),
    3042: (ErrorCode.MODEL_NOT_FOUND, 502, "This persona's model id is not valid on Workers AI."),
    3003: (ErrorCode.UPSTREAM_BAD_REQUEST, 502, _OUR_REQUEST),
    5006: (ErrorCode.UPSTREAM_BAD_REQUEST, 502, _OUR_REQUEST),
    5005: (ErrorCode.LORA_NOT_SUPPORTED, 400, "This model does not accept a LoRA adapter."),
    5016: (
        ErrorCode.UPSTREAM_FORBIDDEN,
        403,
        "This model's terms of use have not been accepted for this site.",
    ),
    5018: (ErrorCode.UPSTREAM_FORBIDDEN, 403, "This model is private and not available to this site."),
    3041: (ErrorCode.UPSTREAM_FORBIDDEN, 403, "This model is private and not available to this site."),
    3023: (ErrorCode.UPSTREAM_FORBIDDEN, 403, "The site's Workers AI account is blocked."),
    3006: (ErrorCode.REQUEST_TOO_LARGE, 413, "The request is too large for the model. Try a shorter topic."),
    3007: (ErrorCode.UPSTREAM_TIMEOUT, 408, f"The model took too long to answer. {_RETRY}"),
    3008: (ErrorCode.UPSTREAM_TIMEOUT, 408, f"The model request was aborted. {_RETRY}"),
    3036: (
        ErrorCode.UPSTREAM_QUOTA_EXCEEDED,
        429,
        "Today's free model allowance is used up. Please try again tomorrow.",
    ),
    3040: (ErrorCode.UPSTREAM_CAPACITY, 429, f"The model is out of capacity right now. {_RETRY}"),
}
#: Said once per persona and model in a process (a persona on a retired model would otherwise log
#: on every quote while its fallback serves).
ONCE = frozenset({ErrorCode.MODEL_NOT_FOUND})


def error_for_status(status: int, body: bytes, retry_after: int | None = None) -> Error:
    """The visitor's Error for a non-2xx answer, by documented envelope code, else by status, with
    the upstream's Retry-After. What Workers AI said is for the operator's log only
    (`upstream_said`)."""
    codes, _ = _parse_envelope(body)
    for number in codes:
        if number in ERROR_CODES:
            code, our_status, message = ERROR_CODES[number]
            return Error(code, message, our_status, retry_after=retry_after)
    error = upstream_status_error(status)
    return replace(error, retry_after=retry_after) if retry_after is not None else error


def retry_after(headers: httpx.Headers) -> int | None:
    """A Retry-After in seconds (the delay form; an HTTP date is not worth parsing here)."""
    value = headers.get("retry-after", "")
    return min(int(value), 3600) if value.isdigit() else None


def upstream_said(body: bytes, secrets: Iterable[str]) -> str:
    """A v4 envelope's first message, else the body's text, redacted for the log."""
    _, message = _parse_envelope(body)
    return upstream_text(message or body.decode("utf-8", "replace"), secrets=secrets)


def _parse_envelope(body: bytes) -> tuple[list[int], str]:
    """The error codes and the first message of a Cloudflare v4 envelope; ([], "") otherwise."""
    try:
        envelope = json.loads(body)
    except (ValueError, RecursionError):
        return [], ""
    errors = envelope.get("errors") if isinstance(envelope, dict) else None
    if not isinstance(errors, list):
        return [], ""
    items = [item for item in errors if isinstance(item, dict)]
    codes = [item["code"] for item in items if isinstance(item.get("code"), int)]
    return codes, next((item["message"] for item in items if isinstance(item.get("message"), str)), "")


class StreamParser:
    """The Workers AI wire format: `feed(event)` returns the events it carries, ending with Done
    or an Error once the stream has ended (`finished`).

    `response` is the text (a number too), else an OpenAI-style `choices[0].delta.content`; `p`
    is padding; `usage` may come on any event; `[DONE]` ends the stream; a payload that is not a
    JSON object is `upstream_malformed`; an error envelope (some proxies send one) ends it with
    its Error, and what it said is kept in `said` for the log, redacted.
    """

    __slots__ = ("_secrets", "finished", "said")

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = secrets
        self.finished = False
        self.said = ""

    def feed(self, message: ServerSentEvent) -> list[Event]:
        data = message.data
        if data == "[DONE]":
            self.finished = True
            return [Done()]
        if not data:
            return []
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):
            payload = None
        if not isinstance(payload, dict):
            self.finished = True
            return [upstream_malformed()]
        text = payload.get("response")
        if text is None:
            text = _openai_delta(payload)
            if text is None and "errors" in payload:
                self.finished = True
                self.said = upstream_said(data.encode(), self._secrets)
                return [error_for_status(502, data.encode())]
        elif type(text) is not str:
            text = str(text) if isinstance(text, int | float) and not isinstance(text, bool) else None
        events: list[Event] = [Token(text)] if text else []
        usage = payload.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                events.append(Usage(prompt_tokens=prompt, completion_tokens=completion))
        return events


def _openai_delta(payload: dict[str, Any]) -> str | None:
    choices = payload.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    delta = choice.get("delta") if isinstance(choice, dict) else None
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else None


class WorkersAIBackend:
    """Every response (any status) first yields `Meta` with the model and the cf-aig-* headers."""

    name = "workers-ai"
    paid = True

    def __init__(
        self,
        *,
        account_id: str,
        api_token: str,
        base_url: str = "https://api.cloudflare.com/client/v4",
        gateway_id: str = "",
        gateway_base_url: str = "https://gateway.ai.cloudflare.com/v1",
        gateway_token: str = "",
        gateway_skip_cache: bool = False,
        gateway_cache_ttl: int | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        headers = {
            "Authorization": f"Bearer {api_token}",
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            # A compressed event stream can be buffered whole by the compressor: ask for none.
            "Accept-Encoding": "identity",
        }
        if gateway_id:  # AI Gateway's options, as the Workers binding's `gateway` option names them
            if gateway_skip_cache:
                headers["cf-aig-skip-cache"] = "true"
            if gateway_cache_ttl is not None:
                headers["cf-aig-cache-ttl"] = str(gateway_cache_ttl)
            if gateway_token:
                headers["cf-aig-authorization"] = f"Bearer {gateway_token}"
        self.account_id = account_id
        self.base_url = base_url.rstrip("/")
        self.gateway_id = gateway_id
        self.gateway_base_url = gateway_base_url.rstrip("/")
        self._headers = headers
        self._connect_timeout_s = connect_timeout_s
        self._secrets = tuple(s for s in (api_token, gateway_token) if s)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._said_once: set[tuple[str, str, str]] = set()

    @classmethod
    def from_settings(cls) -> WorkersAIBackend:
        return cls(
            account_id=settings.CLOUDFLARE_ACCOUNT_ID,
            api_token=settings.CLOUDFLARE_API_TOKEN,
            base_url=settings.CLOUDFLARE_API_BASE_URL,
            gateway_id=settings.AI_GATEWAY_ID,
            gateway_base_url=settings.AI_GATEWAY_BASE_URL,
            gateway_token=settings.AI_GATEWAY_TOKEN,
            gateway_skip_cache=settings.AI_GATEWAY_SKIP_CACHE,
            gateway_cache_ttl=settings.AI_GATEWAY_CACHE_TTL,
        )

    def model_name(self, requested: str) -> str:
        return requested

    def url(self, model: str) -> str:
        if self.gateway_id:
            return f"{self.gateway_base_url}/{self.account_id}/{self.gateway_id}/workers-ai/{model}"
        return f"{self.base_url}/accounts/{self.account_id}/ai/run/{model}"

    async def aclose(self) -> None:
        client, self._client, self._client_loop = self._client, None, None
        if client is not None:
            await client.aclose()

    def _http(self) -> httpx.AsyncClient:
        # Pooled connections belong to the loop that opened them: a new loop (a test, a
        # management command) gets a new client instead of a pool it cannot use.
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            connect_s = self._connect_timeout_s
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=connect_s, pool=connect_s),
                # One connection per open stream: the open-stream cap bounds them.
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=20, keepalive_expiry=30.0
                ),
                headers=self._headers,
                follow_redirects=False,
                trust_env=False,
            )
            self._client_loop = loop
        return self._client

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [{"role": m.role, "content": m.content} for m in request.messages],
            "stream": True,
            "max_tokens": request.max_tokens,
            **request.sampling(),
        }
        if request.lora:
            body["lora"] = request.lora
            body["raw"] = True
        return body

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        if not _MODEL_ID.fullmatch(request.model):
            yield Error(ErrorCode.MODEL_NOT_FOUND, f"{request.model[:80]!r} is not a valid model id.", 400)
            return
        client = self._http()
        async with contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(
                    client.stream("POST", self.url(request.model), json=self._body(request))
                )
            except httpx.TimeoutException:  # connect or pool
                yield self._log(upstream_timeout(), request)
                return
            except httpx.ConnectError:
                yield self._log(upstream_unreachable(), request)
                return
            except httpx.TransportError:
                yield self._log(upstream_dropped(), request)
                return

            headers = response.headers
            yield Meta(
                model=request.model,
                headers={
                    name: scrub(headers[name], self._secrets) for name in META_HEADERS if name in headers
                },
            )

            if not response.is_success:
                body = await read_error_body(response)
                said = upstream_said(body, self._secrets)
                status = response.status_code
                said = f"HTTP {status}: {said}" if said else f"HTTP {status}"
                yield self._log(error_for_status(status, body, retry_after(headers)), request, said)
                return
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type.partition(";")[0].lower():
                yield self._log(upstream_malformed(), request)
                return

            parser = StreamParser(self._secrets)
            scrubber = Scrubber(self._secrets)
            messages = upstream_events(response)
            try:
                while True:
                    events: list[Event]
                    try:
                        events = parser.feed(await anext(messages))
                    except StopAsyncIteration:
                        events = [upstream_dropped()]
                    except httpx.DecodingError:
                        events = [upstream_malformed()]
                    except httpx.TransportError:  # the connection broke
                        events = [upstream_dropped()]
                    for event in events:
                        if type(event) is Token:
                            text = scrubber.feed(event.text)
                            if text:
                                yield event if text is event.text else Token(text)
                        elif type(event) is Done or type(event) is Error:
                            tail = scrubber.flush()  # text held back in case it began a secret
                            if tail:
                                yield Token(tail)
                            if type(event) is Error:
                                self._log(event, request, parser.said)
                            else:
                                await finish_body(messages)
                            yield event
                            return
                        else:
                            yield event
            finally:
                await messages.aclose()

    def _log(self, error: Error, request: GenerationRequest, said: str = "") -> Error:
        if error.code in ONCE:
            key = (error.code, request.speaker, request.model)
            if key in self._said_once:
                return error
            self._said_once.add(key)
        logger.warning(
            "workers-ai %s: %s (persona %s, model %s, status %s)%s%s",
            error.code,
            error.message,
            request.speaker,
            request.model,
            error.status,
            f" Workers AI said: {said}" if said else "",
            " Said once per persona and model; its fallbacks serve meanwhile." if error.code in ONCE else "",
        )
        return error
