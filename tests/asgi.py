"""Drive the real ASGI application (config.asgi) the way a server would, including
`http.disconnect`, which django.test.AsyncClient can never send."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from asgiref.testing import ApplicationCommunicator

#: `<generation id>.<resume key>:<n>`, the `id:` of every event of a generation stream
EVENT_ID = re.compile(r"[0-9a-f-]{36}\.[0-9a-f]{16}:\d+")
STREAM_URL = "/api/quotes/stream"
CSRF = "a" * 32  # an unmasked secret: valid as both the cookie and the form token
FORM_URL = "/quotes/stream"  # the persona page's form (Django's CSRF); the JSON API takes no forms
#: The address tests' requests come from unless they say otherwise.
TEST_CLIENT = ("127.0.0.1", 50000)


@dataclass
class StreamedResponse:
    status: int
    headers: dict[str, str]
    chunks: list[bytes] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)


def http_scope(
    method: str,
    path: str,
    *,
    query: str = "",
    headers: dict[str, str] | None = None,
    client: tuple[str, int] | None = TEST_CLIENT,
) -> dict[str, Any]:
    raw_headers = [(b"host", b"testserver")]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": raw_headers,
        "client": client,
        "server": ("testserver", 80),
    }


class AsgiStream:
    """One request in flight against the app."""

    def __init__(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        query: str = "",
        headers: dict[str, str] | None = None,
        client: tuple[str, int] | None = TEST_CLIENT,
    ):
        from config.asgi import application

        self.communicator = ApplicationCommunicator(
            application, http_scope(method, path, query=query, headers=headers, client=client)
        )
        self.body = body
        self.sent = False
        self.response: StreamedResponse | None = None

    async def send(self) -> None:
        """Send the request without waiting for the response (`start` then waits for it)."""
        self.sent = True
        await self.communicator.send_input({"type": "http.request", "body": self.body, "more_body": False})

    async def start(self, timeout: float = 30) -> StreamedResponse:
        if not self.sent:
            await self.send()
        message = await self.communicator.receive_output(timeout)
        assert message["type"] == "http.response.start", message
        headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        self.response = StreamedResponse(status=message["status"], headers=headers)
        return self.response

    async def next_chunk(self, timeout: float = 30) -> tuple[bytes, bool]:
        """The next body chunk and whether more follow."""
        assert self.response is not None
        message = await self.communicator.receive_output(timeout)
        assert message["type"] == "http.response.body", message
        chunk = message.get("body", b"")
        if chunk:
            self.response.chunks.append(chunk)
            self.response.chunk_times.append(time.perf_counter())
        return chunk, message.get("more_body", False)

    async def read_all(self, timeout: float = 60) -> StreamedResponse:
        assert self.response is not None
        more = True
        while more:
            _, more = await self.next_chunk(timeout)
        await self.communicator.wait(timeout)
        return self.response

    async def disconnect(self, timeout: float = 10) -> None:
        await self.communicator.send_input({"type": "http.disconnect"})
        await self.communicator.wait(timeout)


async def request(method: str, path: str, *, json_body: Any = None, **kwargs: Any) -> StreamedResponse:
    headers = kwargs.pop("headers", {})
    body = kwargs.pop("body", b"")
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers = {"content-type": "application/json", **headers}
    stream = AsgiStream(method, path, body=body, headers=headers, **kwargs)
    await stream.start()
    return await stream.read_all()


def post_stream(
    body: dict[str, Any] | bytes | None = None,
    *,
    headers: dict[str, str] | None = None,
    client: tuple[str, int] | None = TEST_CLIENT,
) -> AsgiStream:
    """A POST to the stream endpoint, not sent yet: `body` as JSON (the test persona's quote by
    default, tests/conftest.py's `persona`), or as given if it is bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body or {"persona": "test-watts"}).encode()
    return AsgiStream(
        "POST",
        STREAM_URL,
        body=raw,
        headers={"content-type": "application/json", **(headers or {})},
        client=client,
    )


async def post_quote(body: dict[str, Any] | bytes | None = None, **kwargs: Any) -> StreamedResponse:
    """`post_stream`, sent and read to its end."""
    stream = post_stream(body, **kwargs)
    await stream.start()
    return await stream.read_all()


async def read_events(stream: AsgiStream, count: int) -> bytes:
    """Start the response (a 200) unless it has started, then read `count` body chunks (one SSE
    event each), the stream still open after each."""
    if stream.response is None:
        response = await stream.start()
        assert response.status == 200, response
    received = b""
    for _ in range(count):
        chunk, more = await stream.next_chunk()
        assert more
        received += chunk
    return received


async def htmx_form_post(
    fields: dict[str, str], *, csrf: str | None = CSRF, **headers: str
) -> StreamedResponse:
    """The page's htmx form posted with `fields` (and the CSRF token unless `csrf` is None)."""
    if csrf is not None:
        fields = {"csrfmiddlewaretoken": csrf, **fields}
    return await request(
        "POST",
        FORM_URL,
        body=urlencode(fields).encode(),
        headers={
            "content-type": "application/x-www-form-urlencoded",
            "hx-request": "true",
            "cookie": f"csrftoken={CSRF}",
            **headers,
        },
    )


def without_ids(body: bytes) -> bytes:
    """`body` without its `id:` lines: two generations of the same answer differ only there."""
    return re.sub(rb"(?m)^id: [0-9a-f-]{36}\.[0-9a-f]{16}:\d+\n", b"", body)


def parse_sse(body: bytes) -> list[dict[str, str]]:
    """Split a body into events (each {'event': name, 'data': data}); strict about LF framing,
    which is what this server sends."""
    text = body.decode()
    assert text.endswith("\n\n"), f"the body must end on an event boundary: {text[-40:]!r}"
    events = []
    for block in text[:-2].split("\n\n"):
        if block.startswith("retry: ") and "\ndata" not in block and not block.startswith("data"):
            continue  # a retry alone (EventSource's opening) is no event
        event = {"event": "message", "data": ""}
        lines = []
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            if name == "data":
                lines.append(value)
            elif name == "event":
                event["event"] = value
            elif name == "id":  # the resume id every event of a generation carries
                assert EVENT_ID.fullmatch(value), f"not an event id: {value!r}"
            elif name == "retry":
                assert value.isdigit(), f"not a retry: {value!r}"
            else:
                raise AssertionError(f"unexpected line {line!r}")
        event["data"] = "\n".join(lines)
        events.append(event)
    return events
