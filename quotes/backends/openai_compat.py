"""Any OpenAI-compatible `/chat/completions` server, streamed: llama.cpp's servers, vLLM,
Workers AI's own OpenAI route, OpenAI itself.

Only the connect and pool timeouts are httpx's: every other wait is bounded by the policy, which
cancels the stream's task, and the response is closed on the way out. What the server says when
it fails goes to the log, redacted; the visitor's message is ours, one per kind of failure.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import httpx
from django.conf import settings
from httpx_sse import SSEError
from streaming import Done, Error, Event, Meta, Token, Usage

from ..errors import (
    Scrubber,
    scrub,
    upstream_dropped,
    upstream_malformed,
    upstream_status_error,
    upstream_text,
    upstream_timeout,
    upstream_unavailable,
    upstream_unreachable,
)
from .base import SAMPLING_FIELDS, GenerationRequest
from .upstream_sse import finish_body, read_error_body, upstream_events

logger = logging.getLogger(__name__)

#: Response headers worth keeping on the row (a request id to quote to the server's operators).
UPSTREAM_HEADERS = ("x-request-id", "cf-aig-", "openai-processing-ms")

# Strict servers (OpenAI itself) answer 400 to parameters they do not know (top_k,
# repetition_penalty): only OpenAI's are sent.
_OPENAI_SAMPLING = tuple(name for name, field in SAMPLING_FIELDS.items() if field.openai)


class OpenAICompatBackend:
    name = "openai"
    paid = True

    def __init__(self, *, base_url: str, api_key: str, connect_timeout_s: float = 5.0) -> None:
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._api_key = api_key
        self._secrets = (api_key,) if api_key else ()
        self._timeout = httpx.Timeout(None, connect=connect_timeout_s, pool=connect_timeout_s)
        # Each open stream holds a connection: the open-stream cap bounds them, not httpx's 100.
        self._limits = httpx.Limits(max_connections=None, max_keepalive_connections=20)
        self._headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._client: httpx.AsyncClient | None = None

    @classmethod
    def from_settings(cls) -> OpenAICompatBackend:
        return cls(base_url=settings.OPENAI_BASE_URL, api_key=settings.OPENAI_API_KEY)

    def model_name(self, requested: str) -> str:
        return requested

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:  # made inside a running loop
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return self._client

    def _body(self, request: GenerationRequest) -> bytes:
        body: dict[str, Any] = {
            "model": request.model,
            "messages": [{"role": m.role, "content": m.content} for m in request.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": request.max_tokens,
        }
        for field in _OPENAI_SAMPLING:
            value = getattr(request, field)
            if value is not None:
                body[field] = value
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

    def _said(self, text: str) -> str:
        """`text` from the server as the log may keep it: ": <redacted text>", or "."."""
        text = upstream_text(text, secrets=(self._api_key,))
        return f": {text}" if text else "."

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        client = self._get_client()
        try:
            http_request = client.build_request(
                "POST", self._url, content=self._body(request), headers=self._headers
            )
            response = await client.send(http_request, stream=True)
        except httpx.TimeoutException:  # connect or pool
            yield upstream_timeout()
            return
        except (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.InvalidURL):
            yield upstream_unreachable(
                "Could not connect to the model server. Is it running, and is OPENAI_BASE_URL right?"
            )
            return
        except httpx.HTTPError:  # connected, but the peer hung up before answering
            yield upstream_dropped()
            return
        try:
            if not response.is_success:
                yield await self._status_error(response)
                return
            async for event in self._events(response, request):
                yield event
        finally:
            await response.aclose()

    async def _events(
        self, response: httpx.Response, request: GenerationRequest
    ) -> AsyncGenerator[Event, None]:
        sse = upstream_events(response)
        scrubber = Scrubber(self._secrets)  # our key, even echoed back, never reaches a visitor
        meta_sent = False
        usage: Usage | None = None
        ending: Event
        try:
            while True:
                try:
                    data = (await anext(sse)).data
                except StopAsyncIteration:
                    ending = upstream_dropped()
                    break
                if not data:
                    continue
                if data == "[DONE]":
                    if not meta_sent:
                        yield self._meta(response, request.model)
                    ending = Done()
                    await finish_body(sse)  # the connection goes back to the pool, for the next request
                    break
                try:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        ending = self._stream_error(chunk["error"])
                        break
                    if not meta_sent:
                        meta_sent = True
                        yield self._meta(response, chunk.get("model") or request.model)
                    choices = chunk.get("choices")
                    if choices:
                        delta = choices[0].get("delta")
                        content = delta.get("content") if delta else None
                        if content:
                            text = scrubber.feed(content)
                            if text:
                                yield Token(text)
                    counts = chunk.get("usage")
                    if counts:
                        usage = Usage(
                            int(counts.get("prompt_tokens") or 0), int(counts.get("completion_tokens") or 0)
                        )
                except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
                    ending = upstream_malformed()
                    break
        except SSEError:  # 2xx but not text/event-stream: a server ignoring "stream"
            ending = upstream_malformed()
        except httpx.HTTPError:  # the peer closed or reset the connection mid-stream
            ending = upstream_dropped()
        finally:
            await sse.aclose()
        tail = scrubber.flush()  # text held back in case it began a secret
        if tail:
            yield Token(tail)
        if usage is not None:
            yield usage
        yield ending

    def _meta(self, response: httpx.Response, model: str) -> Meta:
        kept = {
            name: scrub(value, self._secrets)
            for name, value in response.headers.items()
            if name.lower().startswith(UPSTREAM_HEADERS)
        }
        return Meta(model=str(model), headers=kept)

    async def _status_error(self, response: httpx.Response) -> Error:
        status = response.status_code
        detail = _error_detail(await read_error_body(response))
        error = upstream_status_error(status)
        if status in (401, 403):
            logger.warning(
                "openai upstream_auth: the model server refused our credentials (HTTP %s). "
                "Check OPENAI_API_KEY%s",
                status,
                self._said(detail),
            )
        else:
            logger.warning(
                "openai %s: the model server answered HTTP %s%s", error.code, status, self._said(detail)
            )
        return error

    def _stream_error(self, error: object) -> Error:
        logger.warning(
            "openai upstream_unavailable: the model server failed mid-stream%s",
            self._said(_message_of(error)),
        )
        return upstream_unavailable("The model service failed while writing the quote. Please try again.")


def _message_of(error: object) -> str:
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail")
        if message is not None:
            return message if isinstance(message, str) else json.dumps(message)
        return ""
    return error if isinstance(error, str) else ""


def _error_detail(raw: bytes) -> str:
    """The readable part of an error body: OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, Cloudflare's {"errors": [{"message"}]}, or the text itself."""
    text = raw.decode("utf-8", errors="replace")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if isinstance(body, dict):
        if "error" in body:
            return _message_of(body["error"]) or text
        if "detail" in body:
            return _message_of(body)
        errors = body.get("errors")
        if isinstance(errors, list) and errors:
            return _message_of(errors[0]) or text
    return text
