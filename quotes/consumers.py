"""The WebSocket transport: a thin one over the same streams as the HTTP one, as JSON frames. A
start is admitted and counted exactly like an HTTP stream; one stream is read at a
time, in a task of its own (Channels handles one message at a time, and a cancel must get
through). A client holds at most QUOTES_MAX_SOCKETS sockets here (its network six times that);
a socket that starts nothing for QUOTES_SOCKET_IDLE_S, or keeps sending refused frames, is
closed. Close codes are the application's own (4000-4999): daphne sends no other."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.urls import path
from streaming import Meta, Stream, merged

from . import rows, streams
from .clients import Client
from .encoders import WebSocketEncoder, encode
from .errors import ErrorCode, QuoteError
from .rate_limits import count_stream
from .security import frame_too_large
from .sockets import close_socket, open_socket

CLOSE_POLICY = 4008  # too many refused frames, idle, too many sockets
CLOSE_TOO_BIG = 4009
CLOSE_RESTART = 4012  # the process is restarting: reconnect (to another)
#: Refused frames in a row after which the socket is closed.
MAX_REFUSED = 5
BUSY = QuoteError(ErrorCode.BUSY_SOCKET, "A quote is already being written here. Cancel it first.", 409)
UNKNOWN_FRAME = QuoteError(
    ErrorCode.INVALID_FRAME, 'A frame must be {"type": "start"|"resume"|"cancel", ...}.', 400
)


class QuoteConsumer(AsyncJsonWebsocketConsumer):
    channel_layer_alias = "none"  # a socket streams its own stream: no channel layer
    task: asyncio.Task[None] | None = None
    stream: Stream | None = None
    client: Client | None = None
    idle: asyncio.TimerHandle | None = None
    refusals = 0

    async def connect(self) -> None:
        user = self.scope.get("user")
        user_id = user.pk if user is not None and user.is_authenticated else None
        cookie = self.scope.get("cookies", {}).get(settings.CSRF_COOKIE_NAME, "")
        client = Client.of((self.scope.get("client") or ("",))[0] or "", user_id, cookie)
        if not open_socket(client):
            await self.close(code=CLOSE_POLICY)  # before accept: the handshake gets a 403
            return
        self.client = client
        await self.accept()
        self._idle_from_now()

    async def disconnect(self, code: int) -> None:
        if self.idle is not None:
            self.idle.cancel()
        if self.client is not None:
            close_socket(self.client)
        await self._stop_reading()  # gone, not stopped: the stream runs on for its grace

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        if (too_large := frame_too_large(text_data, bytes_data)) is not None:
            await self._refuse(too_large)
            await self.close(code=CLOSE_TOO_BIG)
            return
        try:
            content = json.loads(text_data) if text_data is not None else None
        except (ValueError, RecursionError):
            content = None
        kind = content.get("type") if isinstance(content, dict) else None
        try:
            if kind in ("start", "resume") and self.task is not None and not self.task.done():
                raise BUSY
            if kind == "start":
                await self._start(content)  # type: ignore[arg-type]
            elif kind == "resume":
                await count_stream(self._client())
                stream, after = streams.find(content.get("last_event_id"))  # type: ignore[union-attr]
                self._read(stream, after)
            elif kind == "cancel":
                if await self._stop_reading(stop=True):
                    await self.send_json({"type": "cancelled"})
            else:
                raise UNKNOWN_FRAME
        except QuoteError as exc:
            await self._refuse(exc, content.get("persona") if isinstance(content, dict) else None)

    async def _start(self, content: dict[str, Any]) -> None:
        stream = await streams.begin(self._client(), transport="websocket", params=content)
        self._read(stream, 0)

    def _read(self, stream: Stream, after: int) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.refusals = 0
        self.stream = stream
        meta = merged(stream.events[:after]) if after else Meta()
        frames = encode(stream.read(after), WebSocketEncoder(), stream.id, meta, after, resumed=bool(after))
        self.task = asyncio.create_task(self._send(frames))

    async def _send(self, frames: Any) -> None:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                await self.send_json(frame)
                if frame["type"] == "reconnect" or frame.get("code") == ErrorCode.SERVER_DRAINING:
                    await self.close(code=CLOSE_RESTART)
        self._idle_from_now()

    async def _stop_reading(self, *, stop: bool = False) -> bool:
        """Stop reading the stream; with `stop`, stop it too and wait for its row."""
        task, stream = self.task, self.stream
        self.task = self.stream = None
        if task is None or task.done():
            return False
        if stop and stream is not None:
            await streams.stop(stream.id, self._client())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._idle_from_now()
        return True

    def _client(self) -> Client:
        assert self.client is not None
        return self.client

    def _idle_from_now(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        loop = asyncio.get_running_loop()
        self.idle = loop.call_later(
            settings.QUOTES_SOCKET_IDLE_S, lambda: asyncio.ensure_future(self._close_idle())
        )

    async def _close_idle(self) -> None:
        if self.task is None or self.task.done():
            await self.close(code=CLOSE_POLICY)

    async def _refuse(self, error: QuoteError, slug: object = None) -> None:
        """An error frame; MAX_REFUSED in a row close the socket (a start is counted against
        the client's rate limit by its admission; a refused frame costs it nothing more)."""
        rows.refused(error, slug, "websocket")
        await self.send_json(WebSocketEncoder().error_answer(error.as_event(), Meta()))
        if error.code == ErrorCode.SERVER_DRAINING:
            await self.close(code=CLOSE_RESTART)
            return
        self.refusals += 1
        if self.refusals >= MAX_REFUSED:
            await self.close(code=CLOSE_POLICY)


websocket_urlpatterns = [path("ws/quotes/", QuoteConsumer.as_asgi())]
