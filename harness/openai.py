"""A scripted OpenAI-compatible upstream: a real HTTP/1.1 server on 127.0.0.1, written on raw
asyncio so the test decides every byte (status, headers, body pieces as HTTP chunks, stalls, a
connection closed mid-body), for what a real server (llama.cpp's, tests/llama_server.py) cannot
be made to do. It runs on the test's own event loop.

    upstream = ScriptedUpstream()
    await upstream.start()   # its base URL, ending in /v1
    upstream.reply = Reply(pieces=[b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
    ... upstream.requests, upstream.client_gone ...
    await upstream.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class Reply:
    """What the scripted upstream answers: a status, headers, then body pieces sent as HTTP
    chunks. A piece may be an asyncio.Event (wait for it) or a float (sleep that long)."""

    status: int = 200
    content_type: str = "text/event-stream"
    pieces: list[bytes | asyncio.Event | float] = field(default_factory=list)
    finish: bool = True  # False: close the connection mid-body (no terminating chunk)


class ScriptedUpstream:
    def __init__(self) -> None:
        self.reply = Reply()
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.client_gone = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Requests one after another on the connection, as HTTP/1.1 keeps it alive: a client that
        read a whole body sends its next request here."""
        self._writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while await self._exchange(reader, writer):
                pass
        except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its reply; False when the connection is done with."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed its idle connection
            self.client_gone.set()
            return False
        line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append((line, headers, body))
        watcher = asyncio.create_task(self._watch_eof(reader))  # a client that leaves mid-reply
        reply = self.reply
        try:
            writer.write(
                f"HTTP/1.1 {reply.status} X\r\ncontent-type: {reply.content_type}\r\n"
                "transfer-encoding: chunked\r\nx-request-id: req-1\r\n\r\n".encode()
            )
            for piece in reply.pieces:
                if watcher.done():
                    return False
                if isinstance(piece, asyncio.Event):
                    await piece.wait()
                elif isinstance(piece, float):
                    await asyncio.sleep(piece)
                else:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
            if not reply.finish:
                return False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return not watcher.done()
        finally:
            watcher.cancel()

    async def _watch_eof(self, reader: asyncio.StreamReader) -> None:
        """Set `client_gone` when the client closes the connection during a reply (a client
        sends nothing more until the reply ends: it pipelines no request)."""
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass
        self.client_gone.set()
