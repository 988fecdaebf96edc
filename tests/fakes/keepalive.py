"""A Workers-AI-shaped upstream that keeps connections open (HTTP/1.1 keep-alive), optionally
over TLS: the fake in workers_ai.py closes every connection, which cannot show reuse."""

from __future__ import annotations

import ssl
import threading
import time
from typing import Any


class KeepAliveUpstream:
    """A Workers-AI-shaped SSE upstream that, unlike tests/fakes/workers_ai.py, keeps each
    connection open for the next request (HTTP/1.1 keep-alive), optionally over TLS. It sends
    the fake's own body for the scenario (`render_body`), one chunk per event, so the bytes on
    the wire are the fake's; only the connection handling differs."""

    def __init__(self, scenario: Any, ssl_context: ssl.SSLContext | None = None) -> None:
        self.scenario = scenario
        self.ssl_context = ssl_context
        self.connections = 0
        self.requests = 0
        self.last: dict[str, Any] = {}
        self.port = 0

    async def serve(self, ready: threading.Event) -> None:
        import asyncio

        server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        await server.serve_forever()

    async def _handle(self, reader: Any, writer: Any) -> None:
        import asyncio

        from tests.fakes.workers_ai import render_body

        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                self.requests += 1
                self.last = {
                    "path": request_line.split(" ")[1],
                    "headers": headers,
                    "body": body,
                    "received_at": time.monotonic(),
                }
                scenario = self.scenario
                events = [e + b"\n\n" for e in render_body(scenario).split(b"\n\n") if e]
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                await writer.drain()
                for event in events:
                    writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                    await writer.drain()
                    if scenario.token_delay_s:
                        await asyncio.sleep(scenario.token_delay_s)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        finally:
            writer.close()
