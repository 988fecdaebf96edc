"""The WebSocket transport: the same quote stream as the HTTP endpoint, as JSON frames (README.md,
"WebSocket", says which).

One generation at a time per socket (`busy_socket`), read in a task of its own (Channels handles
one message at a time, and a cancel must get through); it runs on for QUOTES_RESUME_GRACE_S after
its socket drops. Every start and every refused frame counts against the client's rate limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.urls import path

from .ai.errors import ErrorCode, QuoteError
from .ai.events import Error, Meta
from .ai.gateway import admission, runs
from .ai.gateway.generation import Client, refuse_if_full
from .quote_request import count_refused, events_for, parse_quote_request, resume_quote
from .security import frame_too_large
from .transports import WebSocketEncoder, encode_stream

BUSY = QuoteError(ErrorCode.BUSY_SOCKET, "A quote is already being written here. Cancel it first.", 409)
FRAMES = '{"type": "start", ...}, {"type": "resume", ...} or {"type": "cancel"}'
UNKNOWN_FRAME = QuoteError(ErrorCode.INVALID_FRAME, f"A frame must be {FRAMES}.", 400)


class QuoteConsumer(AsyncJsonWebsocketConsumer):
    # No channel layer: a socket streams its own generation and joins no group, so it need not
    # hold a Redis connection (and a receive loop) open for every visitor.
    channel_layer_alias = "quotes-none"
    task: asyncio.Task[None] | None = None
    #: the generation this socket reads (its id, from its first frame that has it): a cancel stops it
    generation_id: str | None = None

    async def disconnect(self, code: int) -> None:
        # Gone, not stopped: the generation runs on for the resume grace.
        await self._cancel(stop=False)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        if (too_large := frame_too_large(text_data, bytes_data)) is not None:
            await self._refuse(too_large)
            await self.close(code=1009)  # "message too big"
        elif text_data is None:
            await self._refuse(QuoteError(ErrorCode.INVALID_FRAME, "Send JSON text frames.", 400))
        else:
            try:
                content = json.loads(text_data)
            except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
                await self._refuse(QuoteError(ErrorCode.INVALID_JSON, "The frame is not valid JSON.", 400))
                return
            await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind in ("start", "resume") and self.task is not None and not self.task.done():
            await self._refuse(BUSY)
        elif kind == "start":
            await self._start(content)
        elif kind == "resume":
            await self._resume(content.get("last_event_id"))
        elif kind == "cancel":
            if await self._cancel(stop=True):
                await self.send_json({"type": "cancelled"})
        else:
            await self._refuse(UNKNOWN_FRAME)

    async def _resume(self, last_event_id: object) -> None:
        try:
            resumed = await resume_quote(last_event_id, self._client())
        except QuoteError as exc:
            await self._refuse(exc)
            return
        if isinstance(resumed, Error):
            await self._send_error(resumed)  # refused (too many streams, at the cap, draining)
            return
        self.generation_id = resumed.meta.generation_id
        frames = encode_stream(resumed.events, WebSocketEncoder(), resumed.meta, resumed.after, resumed=True)
        self.task = asyncio.create_task(self._send_frames(frames))

    async def _start(self, content: dict[str, Any]) -> None:
        client = self._client()
        admitted = admission.enter(settings.QUOTES_GATEWAY)  # decided once, here: passed on as it is
        full = await refuse_if_full(
            admitted, slug=content.get("persona"), client=client, transport="websocket"
        )
        if full is not None:
            await self._send_error(full)
            if full.code is ErrorCode.SERVER_DRAINING:
                await self.close(code=1012)  # this process is restarting: reconnect to another
            return
        try:
            quote = await parse_quote_request(content)
        except QuoteError as exc:
            if isinstance(admitted, admission.Entry):
                admitted.close()
            await self._refuse(exc)
            return
        events = events_for(quote, client, "websocket", admitted)
        self.task = asyncio.create_task(self._send_frames(encode_stream(events, WebSocketEncoder())))
        if isinstance(admitted, admission.Entry):  # given back if cancelled before its generation opens it
            self.task.add_done_callback(lambda _: admitted.close())

    def _client(self) -> Client:
        ip = (self.scope.get("client") or ("",))[0] or ""
        user = self.scope.get("user")
        user_id = user.pk if user is not None and user.is_authenticated else None
        return Client.from_request(ip, user_id)

    async def _send_frames(self, frames: AsyncGenerator[dict[str, Any], None]) -> None:
        # aclosing: a cancelled task closes the generation's reader here, in this task.
        async with aclosing(frames):
            async for frame in frames:
                if frame["type"] == "meta" and self.generation_id is None:
                    self.generation_id = frame["id"]
                await self.send_json(frame)
                if frame["type"] == "reconnect" or frame.get("code") == ErrorCode.SERVER_DRAINING:
                    # The process is draining: this socket ends so the client resumes on another.
                    await self.close(code=1012)  # "service restart"

    async def _cancel(self, *, stop: bool) -> bool:
        """Stop reading the running generation, if any; with `stop`, stop the generation too
        and wait until its log row is written."""
        task, self.task = self.task, None
        generation_id, self.generation_id = self.generation_id, None
        if task is None or task.done():
            return False
        stopping = None
        if stop and generation_id is not None:
            # Wherever it runs (a resume may read another process's): the row says stopped.
            stopping = asyncio.ensure_future(runs.stop(generation_id, self._client().key))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if stopping is not None:
            await asyncio.shield(stopping)
        return True

    async def _refuse(self, error: QuoteError) -> None:
        error = await count_refused(self._client()) or error
        await self._send_error(error.as_event())

    async def _send_error(self, error: Error) -> None:
        await self.send_json(WebSocketEncoder().error_answer(error, Meta()))


websocket_urlpatterns = [path("ws/quotes/", QuoteConsumer.as_asgi())]
