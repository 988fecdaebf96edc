"""A fake Cloudflare Workers AI upstream: a real HTTP/1.1 server on 127.0.0.1.

Written on raw `asyncio.start_server` so every byte on the wire is under the test's control:
chunk boundaries (mid-line, mid-UTF-8), line endings, stalls, dropped connections, error
envelopes. It runs its own event loop in a daemon thread, so sync tests, async tests (any
loop) and a daphne subprocess can all talk to it.

    fake = FakeWorkersAI().start()
    fake.script(Scenario(tokens=["café", " 日本"], split="random"), Scenario.out_of_capacity())
    ... point the app at it: backend_env(fake.api_base_url, account, token) ...
    fake.requests[0].json["messages"]
    fake.stop()

Standalone, for benchmarks: `python -m harness.workers_ai --port 8788 --tokens 64`.

KeepAliveUpstream, at the end, sends the same bodies on connections kept open.

Each response is sent with `Connection: close` and the connection is closed after it. Stream
bodies use chunked transfer encoding by default: every piece written is one HTTP chunk and is
drained at once, and since an HTTP client hands chunks on as they are decoded, the pieces reach
the client's SSE parser exactly as cut here (whatever TCP does with them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import ssl
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

import jsonschema

Split = None | int | Literal["random"] | Sequence[int]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

#: What Cloudflare's docs say of the models (scripts/refresh_catalog.py writes it from a checkout
#: of cloudflare/cloudflare-docs; `source` names the files and commits): each text-generation
#: model's input schema, verbatim, and the ids Cloudflare retired. Read here, never from the app.
CATALOG: dict[str, Any] = json.loads(Path(__file__).with_name("workers_ai_models.json").read_text())


@cache
def _validator(model: str) -> Any:
    schema = CATALOG["schemas"][model]
    return jsonschema.validators.validator_for(schema)(schema)


def schema_violation(model: str, body: object) -> str:
    """What the model's published input schema finds wrong with `body`, or "" (valid)."""
    return first_violation(_validator(model), body)


def first_violation(validator: Any, instance: object, limit: int = 200) -> str:
    """The most telling error `validator` finds in `instance`, in one line; "" when valid."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return ""
    where = "/" + "/".join(str(part) for part in error.absolute_path)
    return f"{error.validator} at '{where}' not met: {error.message[:limit]}"


#: Documented Workers AI error codes -> (HTTP status, message): the errors page of Cloudflare's docs
#: (src/content/docs/workers-ai/platform/errors.mdx); 5006, a body the schema refuses, is not in
#: it, and comes from what the API answers (cloudflare/ai#279: "AiError: Bad input: Error: ...").
ERROR_CODES: dict[int, tuple[int, str]] = {
    5007: (400, "No such model @cf/nope/nope or task"),
    5006: (400, "AiError: Bad input: Error: oneOf at '/' not met, 0 matches"),
    3003: (400, "Bad input: incomplete request"),
    5005: (405, "LoRA is not supported for this model"),
    5016: (403, "You must accept the model's terms of use before using it"),
    5018: (403, "This model is private"),
    3041: (403, "This model is private"),
    3023: (403, "Account blocked"),
    3042: (404, "Invalid model ID"),
    3006: (413, "Request is too large"),
    3007: (408, "Request timeout"),
    3008: (408, "Request aborted"),
    3036: (429, "Capacity limit: you have used up your daily free allocation of 10,000 neurons"),
    3040: (429, "No more data centers to forward the request to"),
}

#: Every documented Workers AI code -> (our code, our HTTP status). Written out, not read from the
#: backend, so a wrong mapping there fails (tests/backends/test_workers_ai_endpoint.py,
#: tests/faults/test_reliability.py).
EXPECTED_ERRORS: dict[int, tuple[str, int]] = {
    5007: ("model_not_found", 502),
    3042: ("model_not_found", 502),
    3003: ("upstream_bad_request", 502),
    5006: ("upstream_bad_request", 502),
    5005: ("lora_not_supported", 400),
    5016: ("upstream_forbidden", 403),
    5018: ("upstream_forbidden", 403),
    3041: ("upstream_forbidden", 403),
    3023: ("upstream_forbidden", 403),
    3006: ("request_too_large", 413),
    3007: ("upstream_timeout", 408),
    3008: ("upstream_timeout", 408),
    3036: ("upstream_quota_exceeded", 429),
    3040: ("upstream_capacity", 429),
}

#: The model a request names when a test or a benchmark has no reason to name another: one Workers AI
#: offers today (the site's default, quotes.backends.catalog.DEFAULT_MODEL, is not imported: the
#: fake knows nothing of the app).
DEFAULT_MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
_RUN_ROUTE = re.compile(r"^/client/v4/accounts/(?P<account>[^/]+)/ai/run/(?P<model>.+)$")
_GATEWAY_ROUTE = re.compile(r"^/gateway/v1/(?P<account>[^/]+)/(?P<gateway>[^/]+)/workers-ai/(?P<model>.+)$")
#: Workers AI's OpenAI-compatible endpoint: what AI_BACKEND=openai calls (the model is in the body).
_OPENAI_ROUTE = re.compile(r"^/client/v4/accounts/(?P<account>[^/]+)/ai/v1/chat/completions$")
_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Scenario:
    """How the fake answers one request. Defaults: a few tokens, usage, `[DONE]`."""

    #: the generated text, one event each; an int is sent as a JSON number ("response": 42)
    tokens: Sequence[str | int] = ("Stay", " hungry", ",", " stay", " foolish", ".")
    #: send OpenAI-style `{"choices":[{"delta":{"content":...}}]}` chunks instead of `response`
    openai_style: bool = False
    #: (prompt_tokens, completion_tokens) on a final `{"response":"","usage":...}` event; None: omit
    usage: tuple[int, int] | None = (12, 6)
    #: put `usage` on the last token's event instead of an event of its own
    usage_with_token: bool = False
    #: `finish_reason` on the usage event only, as streams carry it since 2026-02-17 (Workers AI
    #: release notes); "token": on the last token's event, as before; None: nowhere
    finish_reason: Literal["usage", "token"] | None = "usage"
    #: the model name an OpenAI-style chunk says answered (vLLM echoes its own, OpenAI a dated
    #: snapshot's); None: the model asked for
    served_model: str | None = None
    crlf: bool = False
    cr_only: bool = False
    #: a `"p":"<random letters>"` field on every event, as the real API sends
    padding: bool = False
    #: a `: keepalive` comment block before every event
    comments: bool = False
    #: None: one write per event; int: fixed-size pieces; "random": random cut points (mid-line,
    #: mid-UTF-8); a sequence: explicit cut offsets into the body bytes
    split: Split = None
    #: seeds the random split and padding (None: a fresh random seed)
    seed: int | None = None
    #: sleep between two pieces written (lets a split also show up as separate TCP reads)
    split_delay_s: float = 0.0
    token_delay_s: float = 0.0
    #: stall before the response headers / before the first byte of the body
    stall_before_headers_s: float = 0.0
    stall_before_s: float = 0.0
    #: stall for `stall_s` after this many token events
    stall_after_tokens: int | None = None
    stall_s: float = 0.0
    #: after `stall_after_tokens` token events, wait until this event is set (at most 30 s): a
    #: stall that ends when the test says, not after a time a slow machine may outrun
    hold: threading.Event | None = None
    #: abort the TCP connection (no [DONE], no chunked terminator) after this many token events
    drop_after_tokens: int | None = None
    send_done: bool = True
    #: a `data: {not json` event after this many token events
    malformed_after_tokens: int | None = None
    #: an extra token event this many characters long, sent first
    long_line: int = 0
    #: stream the request's headers back as the text, one `name: value\n` token per header
    echo_headers: bool = False
    #: error answers: the HTTP status, and an envelope code/message (None: no envelope)
    status: int = 200
    error_code: int | None = None
    error_message: str | None = None
    #: an HTML error page instead of the JSON envelope
    html: bool = False
    #: the body verbatim (a malformed stream, or any error body); still split as asked
    raw_body: bytes | None = None
    content_type: str | None = None
    #: extra response headers (cf-aig-cache-status, cf-aig-step, cf-aig-log-id, ...)
    headers: Mapping[str, str] = field(default_factory=dict)
    #: chunked transfer encoding (False: a close-delimited body)
    chunked: bool = True

    # -- constructors for the documented errors ---------------------------------------------

    @classmethod
    def error(cls, code: int, message: str | None = None, **overrides: Any) -> Scenario:
        """The v4 envelope for a documented code, with the HTTP status from workers-ai.md."""
        status, default_message = ERROR_CODES[code]
        fields: dict[str, Any] = {
            "status": status,
            "error_code": code,
            "error_message": default_message if message is None else message,
        }
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def model_not_found(cls) -> Scenario:
        return cls.error(5007)

    @classmethod
    def invalid_model_id(cls) -> Scenario:
        return cls.error(3042)

    @classmethod
    def incomplete_request(cls) -> Scenario:
        return cls.error(3003)

    @classmethod
    def lora_not_supported(cls) -> Scenario:
        return cls.error(5005)

    @classmethod
    def terms_not_accepted(cls) -> Scenario:
        return cls.error(5016)

    @classmethod
    def private_model(cls) -> Scenario:
        return cls.error(5018)

    @classmethod
    def account_blocked(cls) -> Scenario:
        return cls.error(3023)

    @classmethod
    def request_too_large(cls) -> Scenario:
        return cls.error(3006)

    @classmethod
    def upstream_timeout(cls) -> Scenario:
        return cls.error(3007)

    @classmethod
    def request_aborted(cls) -> Scenario:
        return cls.error(3008)

    @classmethod
    def quota_exceeded(cls) -> Scenario:
        return cls.error(3036)

    @classmethod
    def out_of_capacity(cls, retry_after: int | None = 1) -> Scenario:
        """3040: a 429 to retry after Retry-After (shared/reference/workers-ai.md)."""
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        return cls.error(3040, headers=headers)

    @classmethod
    def unauthorized(cls, message: str = "Authentication error") -> Scenario:
        """What Cloudflare answers a bad API token: 401 with its generic auth code 10000."""
        return cls(status=401, error_code=10000, error_message=message)

    @classmethod
    def forbidden(cls, message: str = "Authentication error") -> Scenario:
        return cls(status=403, error_code=10000, error_message=message)

    @classmethod
    def server_error(cls, status: int = 500, *, html: bool = False) -> Scenario:
        if html:
            return cls(status=status, html=True)
        return cls(status=status, error_code=7000 + status, error_message="Internal server error")


@dataclass
class RecordedRequest:
    method: str
    path: str
    #: header names lower-cased; a repeated header keeps its last value
    headers: dict[str, str]
    body: bytes
    #: the parsed JSON body, or None when it was not JSON
    json: Any
    #: time.monotonic() when the request was fully read
    received_at: float
    #: "run", "gateway", "openai" (the OpenAI-compatible endpoint) or "" (no route matched)
    route: str = ""
    account: str = ""
    gateway: str = ""
    model: str = ""
    #: set when the server noticed the client closed the connection before the response ended
    client_disconnected: threading.Event = field(default_factory=threading.Event)
    #: time.monotonic() of that moment
    disconnected_at: float | None = None
    #: set when the response was fully written (or deliberately dropped)
    finished: threading.Event = field(default_factory=threading.Event)
    #: how it was answered (a scripted Scenario, or the default)
    scenario: Scenario | None = None


class _Piece:
    """A run of body bytes and what to do after writing it."""

    __slots__ = ("after_s", "data", "drop", "hold")

    def __init__(
        self, data: bytes, after_s: float = 0.0, drop: bool = False, hold: threading.Event | None = None
    ) -> None:
        self.data = data
        self.after_s = after_s
        self.drop = drop
        self.hold = hold


class FakeWorkersAI:
    """The fake upstream. `start()` (or `with FakeWorkersAI() as fake:`) runs it in a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.default = Scenario()
        #: when set, requests whose Authorization is not `Bearer <expected_token>` get a 401
        self.expected_token: str | None = None
        self._lock = threading.Lock()
        self._script: deque[Scenario] = deque()
        self._requests: list[RecordedRequest] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._handlers: set[asyncio.Task[None]] = set()

    # -- public API ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_base_url(self) -> str:
        return f"{self.base_url}/client/v4"

    @property
    def gateway_base_url(self) -> str:
        return f"{self.base_url}/gateway/v1"

    def openai_base_url(self, account: str) -> str:
        """OPENAI_BASE_URL for Workers AI's OpenAI-compatible endpoint: the openai backend posts
        to `<this>/chat/completions`, and a 200 is answered in OpenAI's chunk format."""
        return f"{self.api_base_url}/accounts/{account}/ai/v1"

    def script(self, *scenarios: Scenario) -> None:
        """Queue scenarios, consumed one per request; `self.default` answers when none is left."""
        with self._lock:
            self._script.extend(scenarios)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def pending(self) -> int:
        """How many scripted scenarios no request has consumed yet."""
        with self._lock:
            return len(self._script)

    def reset(self) -> None:
        with self._lock:
            self._script.clear()
            self._requests.clear()
            self.default = Scenario()
            self.expected_token = None

    def wait_for_requests(self, count: int, timeout_s: float = 5.0) -> list[RecordedRequest]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            requests = self.requests
            if len(requests) >= count:
                return requests
            time.sleep(0.005)
        raise AssertionError(f"expected {count} requests, got {len(self.requests)}")

    def start(self) -> FakeWorkersAI:
        self._thread = threading.Thread(target=self._run_in_thread, name="fake-workers-ai", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake Workers AI server did not start")
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already stopped
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> FakeWorkersAI:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- server --------------------------------------------------------------------------------

    def _run_in_thread(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve_forever(ready=self._ready))
        finally:
            loop.close()

    async def _serve_forever(self, ready: threading.Event | None = None, announce: bool = False) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if ready is not None:
            ready.set()
        if announce:
            print(f"fake Workers AI on {self.api_base_url} (gateway: {self.gateway_base_url})", flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await self._server.serve_forever()

    async def _shutdown(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._handle_connection(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, path, _version = request_line.split(" ", 2)
        headers: dict[str, str] = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await _read_body(reader, headers)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        record = RecordedRequest(
            method=method,
            path=path,
            headers=headers,
            body=body,
            json=parsed,
            received_at=time.monotonic(),
        )
        if match := _RUN_ROUTE.match(path):
            record.route, record.account, record.model = "run", match["account"], match["model"]
        elif match := _GATEWAY_ROUTE.match(path):
            record.route, record.account, record.model = "gateway", match["account"], match["model"]
            record.gateway = match["gateway"]
        elif match := _OPENAI_ROUTE.match(path):
            model = parsed.get("model") if isinstance(parsed, dict) else None
            record.route, record.account, record.model = "openai", match["account"], str(model or "")

        with self._lock:
            self._requests.append(record)
            if record.route and method == "POST" and (refusal := _refusal(record)) is not None:
                scenario = refusal  # as Cloudflare answers before it runs anything: nothing scripted is used
            elif record.route and method == "POST":
                scenario = self._script.popleft() if self._script else self.default
                if record.route == "openai":
                    scenario = replace(scenario, openai_style=True)
            else:
                scenario = Scenario(status=404 if not record.route else 405, error_code=7003)
                scenario = replace(scenario, error_message="No route for that URI")
            if (
                self.expected_token is not None
                and record.route
                and headers.get("authorization") != f"Bearer {self.expected_token}"
            ):
                scenario = Scenario.unauthorized()
            record.scenario = scenario

        # Notice the client going away while we stall or stream: the request has been read in
        # full, so the next thing the client's side of the socket can tell us is EOF.
        respond = asyncio.create_task(self._respond(writer, scenario, record))
        watch = asyncio.create_task(reader.read(1))
        try:
            await asyncio.wait({respond, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not respond.done():
                record.disconnected_at = time.monotonic()
                record.client_disconnected.set()
                respond.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await respond
        finally:
            watch.cancel()
            respond.cancel()
            record.finished.set()

    async def _respond(
        self, writer: asyncio.StreamWriter, scenario: Scenario, record: RecordedRequest
    ) -> None:
        try:
            await self._write_response(writer, scenario, record)
        except ConnectionError:
            if record.disconnected_at is None:
                record.disconnected_at = time.monotonic()
                record.client_disconnected.set()

    async def _write_response(
        self, writer: asyncio.StreamWriter, scenario: Scenario, record: RecordedRequest
    ) -> None:
        if scenario.stall_before_headers_s:
            await asyncio.sleep(scenario.stall_before_headers_s)
        rng = random.Random(scenario.seed)
        if scenario.raw_body is not None:
            pieces = [_Piece(scenario.raw_body)]
            content_type = "text/event-stream" if scenario.status == 200 else "application/json"
        elif scenario.status != 200 or scenario.html:
            pieces = [_Piece(_error_body(scenario))]
            content_type = "text/html; charset=utf-8" if scenario.html else "application/json"
        else:
            pieces = _stream_pieces(scenario, record, rng)
            content_type = "text/event-stream"
        content_type = scenario.content_type or content_type
        pieces = _split(pieces, scenario.split, rng)

        streaming = scenario.status == 200 and scenario.chunked
        head = [
            f"HTTP/1.1 {scenario.status} {_REASONS.get(scenario.status, 'Unknown')}",
            f"Content-Type: {content_type}",
            "Connection: close",
            "Cache-Control: no-cache",
            "cf-ray: 0123456789abcdef-LHR",
        ]
        if streaming:
            head.append("Transfer-Encoding: chunked")
        elif scenario.status != 200:
            head.append(f"Content-Length: {sum(len(p.data) for p in pieces)}")
        head.extend(f"{name}: {value}" for name, value in scenario.headers.items())
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        if scenario.stall_before_s:
            await asyncio.sleep(scenario.stall_before_s)

        last = len(pieces) - 1
        for index, piece in enumerate(pieces):
            data = piece.data
            if streaming and data:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            if streaming and index == last and not piece.drop:
                data += b"0\r\n\r\n"  # the terminator rides with the last piece
            if data:
                writer.write(data)
                await writer.drain()
            if piece.drop:
                writer.transport.abort()
                return
            if piece.after_s:
                await asyncio.sleep(piece.after_s)
            if piece.hold is not None:
                await asyncio.to_thread(piece.hold.wait, 30)
        if streaming and not pieces:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return b"".join(parts)
            total += size
            if total > _MAX_REQUEST_BYTES:
                raise ValueError("request body too large")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    length = int(headers.get("content-length", "0") or 0)
    if length > _MAX_REQUEST_BYTES:
        raise ValueError("request body too large")
    return await reader.readexactly(length) if length else b""


def _refusal(record: RecordedRequest) -> Scenario | None:
    """What Workers AI answers before it runs a model: 5007 for a model it does not offer (unknown
    or retired), 5006 for a body the model's input schema refuses (the native route; the
    OpenAI-compatible one takes OpenAI's body)."""
    model = record.model
    if model not in CATALOG["schemas"] or model in CATALOG["retired"]:
        return Scenario.error(5007, f"No such model {model} or task")
    if record.route != "openai" and (violation := schema_violation(model, record.json)):
        return Scenario.error(5006, f"AiError: Bad input: Error: {violation}")
    return None


def backend_env(api_base_url: str, account_id: str, api_token: str) -> dict[str, str]:
    """The app's environment for its workers-ai backend to call the upstream at `api_base_url`."""
    return {
        "AI_BACKEND": "workers-ai",
        "CLOUDFLARE_ACCOUNT_ID": account_id,
        "CLOUDFLARE_API_TOKEN": api_token,
        "CLOUDFLARE_API_BASE_URL": api_base_url,
    }


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _error_body(scenario: Scenario) -> bytes:
    if scenario.html:
        reason = _REASONS.get(scenario.status, "Error")
        return (
            f"<!DOCTYPE html><html><head><title>{scenario.status} {reason}</title></head>"
            f"<body><h1>{scenario.status} {reason}</h1><p>cloudflare</p></body></html>"
        ).encode()
    errors = []
    if scenario.error_code is not None:
        errors.append({"code": scenario.error_code, "message": scenario.error_message or ""})
    return _json({"success": False, "errors": errors, "messages": [], "result": None})


def _stream_pieces(scenario: Scenario, record: RecordedRequest, rng: random.Random) -> list[_Piece]:
    eol = "\r" if scenario.cr_only else "\r\n" if scenario.crlf else "\n"
    model = scenario.served_model or record.model or DEFAULT_MODEL

    def event(payload: dict[str, Any]) -> bytes:
        if scenario.padding:
            payload["p"] = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=rng.randint(0, 40)))
        block = b"data: " + _json(payload) + (eol + eol).encode()
        if scenario.comments:
            block = f": keepalive{eol}{eol}".encode() + block
        return block

    def usage_fields() -> dict[str, int]:
        assert scenario.usage is not None
        prompt, completion = scenario.usage
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def token_payload(text: str | int, *, with_usage: bool, last: bool) -> dict[str, Any]:
        finish = "stop" if last and scenario.finish_reason == "token" else None
        if scenario.openai_style:
            payload: dict[str, Any] = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": model,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
            }
        else:
            payload = {"response": text}
            if finish:
                payload["finish_reason"] = finish
        if with_usage:
            payload["usage"] = usage_fields()
        return payload

    tokens: list[str | int] = list(scenario.tokens)
    if scenario.echo_headers:
        tokens = [f"{name}: {value}\n" for name, value in record.headers.items()]
    if scenario.long_line:
        tokens.insert(0, "L" * scenario.long_line)

    pieces: list[_Piece] = []
    for count, text in enumerate(tokens, start=1):
        with_usage = scenario.usage is not None and scenario.usage_with_token and count == len(tokens)
        payload = token_payload(text, with_usage=with_usage, last=count == len(tokens))
        piece = _Piece(event(payload), after_s=scenario.token_delay_s)
        pieces.append(piece)
        if count == scenario.malformed_after_tokens:
            pieces.append(_Piece(f"data: {{not json{eol}{eol}".encode()))
        if count == scenario.stall_after_tokens:
            piece.after_s += scenario.stall_s
            piece.hold = scenario.hold
        if count == scenario.drop_after_tokens:
            piece.drop = True
            return pieces
    if scenario.usage is not None and not scenario.usage_with_token:
        finish = "stop" if scenario.finish_reason == "usage" else None
        if scenario.openai_style:
            choices = [{"index": 0, "delta": {}, "finish_reason": finish}] if finish else []
            last: dict[str, Any] = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": model,
                "choices": choices,
                "usage": usage_fields(),
            }
        else:
            last = {"response": "", "usage": usage_fields()}
            if finish:
                last["finish_reason"] = finish
        pieces.append(_Piece(event(last)))
    if scenario.send_done:
        done = f"data: [DONE]{eol}{eol}".encode()
        if scenario.comments:
            done = f": keepalive{eol}{eol}".encode() + done
        pieces.append(_Piece(done))
    return pieces


def render_body(scenario: Scenario, *, model: str = DEFAULT_MODEL) -> bytes:
    """The stream body the fake sends for `scenario` (before chunked framing), e.g. to pick
    split offsets. Padding is random unless the scenario has a seed."""
    record = RecordedRequest("POST", "", {}, b"", None, 0.0, route="run", model=model)
    pieces = _stream_pieces(scenario, record, random.Random(scenario.seed))
    return b"".join(piece.data for piece in pieces)


def _split(pieces: list[_Piece], split: Split, rng: random.Random) -> list[_Piece]:
    """Re-cut the body. Cut points from `split` are added to the pieces' own boundaries, so a
    stall, delay or drop still happens right after the event it belongs to."""
    if split is None:
        return pieces
    body = b"".join(p.data for p in pieces)
    if isinstance(split, int):
        if split < 1:
            raise ValueError("split must be at least 1")
        cuts = set(range(split, len(body), split))
    elif split == "random":
        cuts = set(
            rng.sample(range(1, len(body)), k=min(len(body) - 1, rng.randint(1, max(1, len(body) // 3))))
        )
    else:
        cuts = {offset for offset in split if 0 < offset < len(body)}
    actions: dict[int, _Piece] = {}
    offset = 0
    for piece in pieces:
        offset += len(piece.data)
        if piece.after_s or piece.drop or piece.hold is not None:
            actions[offset] = piece
            cuts.add(offset)
    cuts.discard(len(body))
    result = []
    start = 0
    for end in [*sorted(cuts), len(body)]:
        action = actions.get(end)
        result.append(
            _Piece(
                body[start:end],
                after_s=action.after_s if action else 0.0,
                drop=action.drop if action else False,
                hold=action.hold if action else None,
            )
        )
        start = end
    return result


class KeepAliveUpstream:
    """The fake's stream for a scenario (`render_body`, one chunk per event, so the bytes on the
    wire are the fake's) on a connection kept open for the next request (HTTP/1.1 keep-alive),
    optionally over TLS: FakeWorkersAI closes every connection, which cannot show reuse. It runs
    on the caller's event loop (`serve`), for the benchmarks' upstream processes."""

    def __init__(self, scenario: Any, ssl_context: ssl.SSLContext | None = None) -> None:
        self.scenario = scenario
        self.ssl_context = ssl_context
        self.connections = 0
        self.requests = 0
        self.last: dict[str, Any] = {}
        self.port = 0

    async def serve(self, ready: threading.Event) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        await server.serve_forever()

    async def _handle(self, reader: Any, writer: Any) -> None:
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the fake Workers AI upstream in the foreground.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8788)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--padding", action="store_true", help='add "p" padding like the real API')
    args = parser.parse_args(argv)

    fake = FakeWorkersAI(args.host, args.port)
    fake.default = Scenario(
        tokens=tuple(f" word{i}" for i in range(args.tokens)),
        usage=(24, args.tokens),
        token_delay_s=args.token_delay,
        padding=args.padding,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(fake._serve_forever(announce=True))


if __name__ == "__main__":
    main()
