"""The client's SSE reader, for the tests and the benchmarks: the app's streams (and the fake's)
as events, each `{"event": name, "data": data}` (data lines joined by a line feed; an event
without data is no event; ids and comments dropped). tests/asgi.py's `parse_sse` is stricter: it
checks the app's framing line by line, which is what those tests test.

`WebSocket`: a WebSocket client small enough to read (RFC 6455: the handshake, masked text
frames out, unfragmented frames in), for the tests that talk to a real daphne or nginx."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import struct
from collections.abc import Iterable
from typing import Any


def events_of(lines: Iterable[str]) -> list[dict[str, str]]:
    """The events of a stream's lines (httpx's `iter_lines`, or a body split at its line ends)."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                events.append({"event": "message", **current, "data": "\n".join(data)})
            current, data = {}, []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field != "id":  # every event's resume id (issue 14)
                current[field] = value
    return events


def parse(body: bytes) -> list[dict[str, str]]:
    """The whole events of `body` (CRLF, CR or LF line ends)."""
    text = body.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return events_of(text.split("\n"))


class Reader:
    """Incremental: `feed` each chunk as it arrives, get the events it completed (LF line ends,
    as the app and the fake send)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, str]]:
        self._buffer += chunk
        end = self._buffer.rfind(b"\n\n")
        if end < 0:
            return []
        whole, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
        return events_of(whole.decode(errors="replace").split("\n"))


def text_of(events: list[dict[str, str]], *, html: bool = False) -> str:
    """The quote's text: from Workers AI's JSON events, or htmx's text fragments."""
    messages = [e["data"] for e in events if e["event"] == "message" and e["data"] != "[DONE]"]
    return "".join(messages if html else [json.loads(data)["response"] for data in messages])


class WebSocket:
    def __init__(self, host: str, port: int, path: str, *, origin: str = "", cookie: str = "") -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        self.reader = self.sock.makefile("rb")
        key = base64.b64encode(os.urandom(16)).decode()
        extra = f"Cookie: {cookie}\r\n" if cookie else ""
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Origin: {origin or f'http://{host}:{port}'}\r\n{extra}\r\n".encode()
        )
        self.status_line = self.reader.readline().decode(errors="replace").strip()
        while self.reader.readline() not in (b"\r\n", b""):
            pass

    @property
    def upgraded(self) -> bool:
        return " 101 " in self.status_line + " "

    def send_json(self, value: object) -> None:
        data, mask = json.dumps(value).encode(), os.urandom(4)
        length = (
            bytes([0x80 | len(data)])
            if len(data) < 126
            else bytes([0x80 | 126]) + struct.pack("!H", len(data))
        )
        self.sock.sendall(bytes([0x81]) + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def receive(self) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame from the server."""
        head = self.reader.read(2)
        if len(head) < 2:
            raise ConnectionError("the connection closed without a close frame")
        length = head[1] & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self.reader.read(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self.reader.read(8))
        return head[0] & 0x0F, self.reader.read(length)

    def receive_json(self) -> Any:
        """The next text frame's JSON (pings skipped); ConnectionError on a close frame."""
        while True:
            opcode, payload = self.receive()
            if opcode == 0x1:
                return json.loads(payload)
            if opcode == 0x8:
                raise ConnectionError(f"closed: {struct.unpack('!H', payload[:2])[0] if payload else None}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(bytes([0x88, 0x80]) + os.urandom(4))
        self.reader.close()
        self.sock.close()
