"""The WebSocket transport: the same quote stream as the HTTP endpoint, as JSON frames.

Client -> server:
    {"type": "start", "persona": slug, "topic": "...", "messages": [...], "fresh": false}
    {"type": "cancel"}
Server -> client:
    {"type": "meta", "model", "model_url", "cache_status", "id", "permalink"}  (may repeat)
    {"type": "token", "text": "..."}
    {"type": "done", "usage": {...} | null, "id", "permalink"}
    {"type": "error", "code", "message", "retry_after"}
    {"type": "cancelled"}   after a cancel that stopped a generation
    {"type": "reconnect", "last_event_id", "retry_ms"}   the process is restarting: the socket
        is then closed with code 1012 (service restart); resume on another connection

A `start` on a process that is restarting gets an error frame (`server_draining`), then the
socket is closed with code 1012, so the client reconnects (through nginx, to another process).
One generation at a time per socket: a `start` while one runs gets an error frame with code
`busy_socket` (cancel first). Every `start` counts against the client's rate limit, refused ones
included. A frame over QUOTES_MAX_FRAME_BYTES gets an error frame (`frame_too_large`), and the
socket is closed with code 1009. The generation runs in a task of its own, so a `cancel` or a
disconnect stops it at once (Channels handles one message at a time); the gateway then logs
the row as cancelled and closes the upstream or stops the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from contextlib import aclosing
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.urls import path

from .ai.errors import ErrorCode, QuoteError
from .ai.events import Error
from .ai.gateway import Client, refuse_if_full, stream_generation
from .security import count_refused_start, frame_too_large
from .transports import WebSocketEncoder, relay
from .views import QuoteInput, parse_quote_request


class QuoteConsumer(AsyncJsonWebsocketConsumer):
    # No channel layer: a socket streams its own generation and joins no group, so it need not
    # hold a Redis connection (and a receive loop) open for every visitor.
    channel_layer_alias = "quotes-none"
    task: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        self.task = None
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self._cancel()

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        if (too_large := frame_too_large(text_data, bytes_data)) is not None:
            await self._send_error(too_large)
            await self.close(code=1009)  # "message too big"
            return
        if text_data is None:
            await self._send_error(QuoteError(ErrorCode.INVALID_FRAME, "Send JSON text frames.", 400))
            return
        try:
            content = json.loads(text_data)
        except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
            await self._send_error(QuoteError(ErrorCode.INVALID_JSON, "The frame is not valid JSON.", 400))
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "start":
            await self._start(content)
        elif kind == "cancel":
            if await self._cancel():
                await self.send_json({"type": "cancelled"})
        else:
            await self._send_error(
                QuoteError(
                    ErrorCode.INVALID_FRAME,
                    'A frame must be {"type": "start", ...} or {"type": "cancel"}.',
                    400,
                )
            )

    async def _start(self, content: dict[str, Any]) -> None:
        # Every start counts against the rate limit: the gateway counts those it runs, and
        # count_refused_start those refused here.
        client = self._client()
        if self.task is not None and not self.task.done():
            busy = QuoteError(
                ErrorCode.BUSY_SOCKET, "A quote is already being written here. Cancel it first.", 409
            )
            await self._send_error(await count_refused_start(client.key) or busy)
            return
        full = await refuse_if_full(slug=content.get("persona"), client=client, transport="websocket")
        if full is not None:
            await self._send_error(full)
            if full.code is ErrorCode.SERVER_DRAINING:
                await self.close(code=1012)  # this process is restarting: reconnect to another
            return
        try:
            quote = await parse_quote_request(content)
        except QuoteError as exc:
            await self._send_error(await count_refused_start(client.key) or exc)
            return
        self.task = asyncio.create_task(self._run(quote, client))

    def _client(self) -> Client:
        ip = (self.scope.get("client") or ("",))[0] or ""
        user = self.scope.get("user")
        user_id = user.pk if user is not None and user.is_authenticated else None
        return Client.from_request(ip, user_id)

    async def _run(self, quote: QuoteInput, client: Client) -> None:
        events = stream_generation(
            persona=quote.persona,
            version=quote.version,
            topic=quote.topic,
            messages=quote.messages,
            client=client,
            bypass_cache=quote.fresh,
            transport="websocket",
        )
        # aclosing: a cancel closes the generation here, in this task, so its log row is
        # written before _cancel() returns.
        async with aclosing(relay(events, WebSocketEncoder())) as frames:
            async for frame in frames:
                await self.send_json(frame)
                if frame["type"] == "reconnect" or frame.get("code") == ErrorCode.SERVER_DRAINING:
                    # The process is draining: this socket ends so the client resumes on another.
                    await self.close(code=1012)  # "service restart"

    async def _cancel(self) -> bool:
        """Stop the running generation, if any, and wait until its log row is written."""
        task, self.task = self.task, None
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True

    async def _send_error(self, error: QuoteError | Error) -> None:
        await self.send_json(
            {
                "type": "error",
                "code": error.code,
                "message": error.message,
                "retry_after": getattr(error, "retry_after", None),
            }
        )


websocket_urlpatterns = [path("ws/quotes/", QuoteConsumer.as_asgi())]
