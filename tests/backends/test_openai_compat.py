"""OpenAICompatBackend against a real server (llama.cpp's own, running Gemma 3 270M; fixtures
in tests/llama_server.py) and, for what that server cannot be made to do (usage chunks, broken
JSON, a stall), against the scripted OpenAI-compatible upstream (harness/openai.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from harness.openai import Reply, ScriptedUpstream
from harness.services import free_port
from quotes.ai.backends import get_backend, reset_backends
from quotes.ai.backends.openai_compat import OpenAICompatBackend
from quotes.ai.errors import upstream_auth
from quotes.ai.events import Done, Error, Event, GenerationRequest, Message, Meta, Token, Usage
from quotes.conf import OpenAICompatSettings, UpstreamHTTPSettings
from quotes.models import Persona
from tests.asgi import StreamedResponse, parse_sse, request
from tests.limits import configure
from tests.llama_server import LlamaServer

TIMEOUTS = UpstreamHTTPSettings(connect_timeout_s=2.0, max_connections=100)

QUOTE = GenerationRequest(
    model="gemma-3-270m",
    messages=(
        Message("system", "A collection of short quotes."),
        Message(
            "user",
            'Seneca, on time: "We suffer more often in imagination than in reality."\n'
            'Maya Angelou, on courage: "Courage is the most important of all the virtues."\n'
            'Alan Watts, on water: "',
        ),
    ),
    speaker="Alan Watts",
    topic="water",
    max_tokens=16,
    # Greedy decoding: the same 16 tokens every run, so "at least one token" is not luck.
    temperature=0,
    seed=7,
)


@pytest.fixture(autouse=True)
def _logging_configured() -> None:
    """The app's first import configures logging, which drops the handlers on the root logger,
    caplog's among them: do it before caplog attaches."""
    import config.asgi  # noqa: F401


async def collect(backend: OpenAICompatBackend, request: GenerationRequest = QUOTE) -> list[Event]:
    async with contextlib.aclosing(backend.stream(request)) as events:
        return [event async for event in events]


@pytest.fixture
async def llama_backend(llama_server: LlamaServer) -> AsyncIterator[OpenAICompatBackend]:
    backend = OpenAICompatBackend(base_url=llama_server.base_url, api_key=llama_server.api_key, http=TIMEOUTS)
    yield backend
    await backend.aclose()


# --- against the real llama.cpp server ----------------------------------------------------------


@pytest.mark.system
async def test_openai_compat_streams_a_quote_from_llama_cpp(llama_backend: OpenAICompatBackend) -> None:
    events = await collect(llama_backend)

    assert isinstance(events[0], Meta)
    assert events[0].model == "gemma-3-270m"  # the server's alias for the model it runs
    assert events[-1] == Done()
    tokens = [e for e in events if isinstance(e, Token)]
    # Each chunk is its own event: 16 tokens asked for, 16 (non-empty) pieces arrive.
    assert len(tokens) == 16
    assert all(t.text for t in tokens)
    # llama-cpp-python 0.3.36 ignores stream_options.include_usage: no usage chunk is sent.
    usages = [e for e in events if isinstance(e, Usage)]
    assert len(usages) <= 1
    assert all(u.prompt_tokens > 0 and u.completion_tokens > 0 for u in usages)
    assert not any(isinstance(e, Error) for e in events)


@pytest.mark.system
async def test_openai_compat_stopping_early_closes_the_stream(
    llama_server: LlamaServer, llama_backend: OpenAICompatBackend
) -> None:
    long = replace(QUOTE, max_tokens=900)  # about 12 s of writing, were it not stopped
    async with contextlib.aclosing(llama_backend.stream(long)) as events:
        seen = [event async for event in _until_first_token(events)]
    assert isinstance(seen[0], Meta)
    assert isinstance(seen[-1], Token)

    # The server saw the connection go and stopped generating: its one slot is idle again long
    # before 900 tokens could have been written.
    for _ in range(20):
        if not await _slot_busy(llama_server):
            break
        await asyncio.sleep(0.05)
    assert not await _slot_busy(llama_server)

    # The server (one model, one request at a time) is free again and answers in full.
    again = await collect(llama_backend)
    assert again[-1] == Done()
    assert sum(isinstance(e, Token) for e in again) == 16


@pytest.mark.system
async def test_openai_compat_cancelled_task_closes_the_stream(llama_backend: OpenAICompatBackend) -> None:
    first_token = asyncio.Event()

    async def consume() -> None:
        async with contextlib.aclosing(llama_backend.stream(QUOTE)) as events:
            async for event in events:
                if isinstance(event, Token):
                    first_token.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_token.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await collect(llama_backend))[-1] == Done()


@pytest.mark.integration
async def test_openai_compat_unreachable_port() -> None:
    backend = OpenAICompatBackend(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="", http=TIMEOUTS)
    try:
        events = await collect(backend)
    finally:
        await backend.aclose()
    assert len(events) == 1
    assert isinstance(events[0], Error)
    assert (events[0].code, events[0].status) == ("upstream_unreachable", 502)


@pytest.mark.system
async def test_openai_compat_wrong_api_key_is_upstream_auth(
    llama_server: LlamaServer, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "sk-wrong-" + llama_server.api_key[::-1]
    backend = OpenAICompatBackend(base_url=llama_server.base_url, api_key=wrong, http=TIMEOUTS)
    try:
        events = await collect(backend)
    finally:
        await backend.aclose()
    [error] = events
    assert isinstance(error, Error)
    assert error == upstream_auth()  # the visitor learns nothing about our credentials
    [logged] = [r for r in caplog.records if r.name == "quotes.ai.backends.openai_compat"]
    line = logged.getMessage()
    assert "HTTP 401" in line and "OPENAI_API_KEY" in line
    assert "invalid api key" in line.lower()  # the server's own error body, read and kept for the log
    assert wrong not in line


@pytest.mark.system
async def test_openai_compat_base_url_of_no_api_is_rejected_with_404(
    llama_server: LlamaServer, caplog: pytest.LogCaptureFixture
) -> None:
    root = llama_server.base_url.removesuffix("/v1") + "/api"  # a mistyped base URL
    backend = OpenAICompatBackend(base_url=root, api_key=llama_server.api_key, http=TIMEOUTS)
    try:
        [error] = await collect(backend)
    finally:
        await backend.aclose()
    assert isinstance(error, Error)
    assert (error.code, error.status) == ("upstream_rejected", 404)
    assert "HTTP 404" in error.message
    [logged] = [r.getMessage() for r in caplog.records if r.name == "quotes.ai.backends.openai_compat"]
    assert "Not Found" in logged  # what the server said: for the operator


@pytest.mark.system
async def test_openai_compat_prompt_over_the_context_window_is_rejected(
    llama_backend: OpenAICompatBackend, caplog: pytest.LogCaptureFixture
) -> None:
    # llama.cpp checks the prompt against the context before it streams: a 400 that names it.
    long = replace(QUOTE, messages=(Message("user", "word " * 3000),))
    [error] = await collect(llama_backend, long)
    assert isinstance(error, Error)
    assert (error.code, error.status) == ("upstream_rejected", 400)
    [logged] = [r.getMessage() for r in caplog.records if r.name == "quotes.ai.backends.openai_compat"]
    assert "context" in logged and "context" not in error.message


# --- against a scripted upstream ----------------------------------------------------------------


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def scripted_backend(upstream: ScriptedUpstream) -> AsyncIterator[OpenAICompatBackend]:
    backend = OpenAICompatBackend(base_url=upstream.url, api_key="sk-secret-123", http=TIMEOUTS)
    yield backend
    await backend.aclose()


def sse(data: object) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


def chunk(
    content: str | None = None, *, model: str = "served-model", usage: dict[str, int] | None = None
) -> bytes:
    body: dict[str, object] = {"model": model, "object": "chat.completion.chunk"}
    body["choices"] = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    if usage is not None:
        body["usage"] = usage
    return sse(body)


@pytest.mark.integration
async def test_openai_compat_sends_openai_request(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(pieces=[chunk("Hi"), sse("[DONE]")])
    request = replace(QUOTE, top_k=5, repetition_penalty=1.1, lora="x")
    await collect(scripted_backend, request)

    [(line, headers, raw)] = upstream.requests
    assert line == "POST /v1/chat/completions HTTP/1.1"
    assert headers["authorization"] == "Bearer sk-secret-123"
    assert headers["accept"] == "text/event-stream"
    body = json.loads(raw)
    assert body == {
        "model": "gemma-3-270m",
        "messages": [{"role": m.role, "content": m.content} for m in QUOTE.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 16,
        "temperature": 0,
        "seed": 7,
    }


@pytest.mark.integration
async def test_openai_compat_no_key_no_authorization_header(upstream: ScriptedUpstream) -> None:
    upstream.reply = Reply(pieces=[sse("[DONE]")])
    base_url = upstream.url
    backend = OpenAICompatBackend(base_url=base_url, api_key="", http=TIMEOUTS)
    try:
        events = await collect(backend)
    finally:
        await backend.aclose()
    assert "authorization" not in upstream.requests[0][1]
    assert events == [Meta(model="gemma-3-270m", headers={"x-request-id": "req-1"}), Done()]


@pytest.mark.integration
async def test_openai_compat_usage_in_final_chunk_with_empty_choices(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(
        pieces=[
            sse({"model": "served-model", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            chunk("Be "),
            chunk("water."),
            sse({"model": "served-model", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            chunk(usage={"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}),
            sse("[DONE]"),
        ]
    )
    events = await collect(scripted_backend)
    assert events == [
        Meta(model="served-model", headers={"x-request-id": "req-1"}),
        Token("Be "),
        Token("water."),
        Usage(prompt_tokens=12, completion_tokens=2),
        Done(),
    ]


@pytest.mark.integration
async def test_openai_compat_tokens_are_yielded_as_they_arrive(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    release = asyncio.Event()
    upstream.reply = Reply(pieces=[chunk("first"), release, chunk("second"), sse("[DONE]")])
    async with contextlib.aclosing(scripted_backend.stream(QUOTE)) as events:
        assert isinstance(await anext(events), Meta)
        # The upstream is holding the rest back: this token cannot have been buffered.
        assert await anext(events) == Token("first")
        release.set()
        assert [e async for e in events] == [Token("second"), Done()]


@pytest.mark.integration
async def test_openai_compat_stopping_early_closes_the_connection(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    never = asyncio.Event()
    upstream.reply = Reply(pieces=[chunk("only"), never])
    async with contextlib.aclosing(scripted_backend.stream(QUOTE)) as events:
        async for event in events:
            if isinstance(event, Token):
                break
    await asyncio.wait_for(upstream.client_gone.wait(), 2)


@pytest.mark.integration
async def test_openai_compat_stream_without_done_is_dropped(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(pieces=[chunk("half")])
    events = await collect(scripted_backend)
    assert isinstance(events[0], Meta)
    assert events[1] == Token("half")
    assert isinstance(events[-1], Error)
    assert (events[-1].code, events[-1].status) == ("upstream_dropped", 502)


@pytest.mark.integration
async def test_openai_compat_connection_cut_mid_body_is_dropped(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    upstream.reply = Reply(pieces=[chunk("half", usage=usage)], finish=False)
    events = await collect(scripted_backend)
    # Usage that did arrive is still reported (it was paid for), before the error.
    assert events[-2:] == [
        Usage(3, 1),
        Error(code="upstream_dropped", message=events[-1].message, status=502),  # type: ignore[union-attr]
    ]


@pytest.mark.integration
async def test_openai_compat_invalid_json_is_malformed(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(pieces=[chunk("ok"), b'data: {"choices": [\n\n', sse("[DONE]")])
    events = await collect(scripted_backend)
    assert events[1] == Token("ok")
    assert isinstance(events[-1], Error)
    assert (events[-1].code, events[-1].status) == ("upstream_malformed", 502)


@pytest.mark.integration
async def test_openai_compat_json_instead_of_event_stream_is_malformed(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(content_type="application/json", pieces=[b'{"choices": []}'])
    [error] = await collect(scripted_backend)
    assert isinstance(error, Error)
    assert error.code == "upstream_malformed"


@pytest.mark.integration
async def test_openai_compat_error_event_mid_stream(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.reply = Reply(pieces=[chunk("a"), sse({"error": {"message": "model crashed"}})])
    events = await collect(scripted_backend)
    assert isinstance(events[-1], Error)
    assert events[-1].code == "upstream_unavailable"
    assert "model crashed" not in events[-1].message
    [logged] = [r.getMessage() for r in caplog.records if r.name == "quotes.ai.backends.openai_compat"]
    assert "mid-stream: model crashed" in logged


@pytest.mark.integration
@pytest.mark.parametrize(
    ("status", "code", "answered"),
    [
        (400, "upstream_rejected", 400),
        (422, "upstream_rejected", 422),
        (429, "upstream_rejected", 429),
        (500, "upstream_unavailable", 502),
        (503, "upstream_unavailable", 502),
    ],
)
async def test_openai_compat_http_errors(
    upstream: ScriptedUpstream,
    scripted_backend: OpenAICompatBackend,
    caplog: pytest.LogCaptureFixture,
    status: int,
    code: str,
    answered: int,
) -> None:
    # An upstream that echoes the key (some do, in "incorrect API key" messages).
    body = json.dumps({"error": {"message": "Bad thing for key sk-secret-123", "type": "x"}}).encode()
    upstream.reply = Reply(status=status, content_type="application/json", pieces=[body])
    [error] = await collect(scripted_backend)
    assert isinstance(error, Error)
    assert (error.code, error.status) == (code, answered)
    assert "Bad thing" not in error.message  # issue 20: our words only, one message per kind
    [logged] = [r.getMessage() for r in caplog.records if r.name == "quotes.ai.backends.openai_compat"]
    assert f"HTTP {status}: Bad thing for key [redacted]" in logged
    assert "sk-secret-123" not in logged


@pytest.mark.integration
@pytest.mark.parametrize("status", [401, 403])
async def test_openai_compat_refused_credentials_reach_the_log_not_the_visitor(
    upstream: ScriptedUpstream,
    persona: Persona,
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    """Through the stream API: an anonymous visitor gets the neutral message the Workers AI
    backend gives; what the server said (scrubbed of the key) goes to the log."""
    settings.AI_BACKEND = "openai"
    settings.OPENAI_COMPAT = OpenAICompatSettings(base_url=upstream.url, api_key="sk-secret-123")
    await reset_backends()
    # An upstream that echoes the key, as OpenAI's "Incorrect API key provided" does.
    body = {
        "error": {"message": "Incorrect API key provided: sk-secret-123", "type": "invalid_request_error"}
    }
    upstream.reply = Reply(status=status, content_type="application/json", pieces=[json.dumps(body).encode()])
    try:
        response = await request("POST", "/api/quotes/stream", json_body={"persona": persona.slug})
    finally:
        await reset_backends()

    assert response.status == 502
    assert response.json() == {"error": {"code": "upstream_auth", "message": upstream_auth().message}}
    assert b"OPENAI_API_KEY" not in response.body and b"Incorrect API key" not in response.body
    [logged] = [r for r in caplog.records if r.name == "quotes.ai.backends.openai_compat"]
    line = logged.getMessage()
    assert f"HTTP {status}" in line and "OPENAI_API_KEY" in line and "Incorrect API key provided" in line
    assert "sk-secret-123" not in line


@pytest.mark.integration
async def test_openai_compat_huge_error_body_is_bounded(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(status=502, content_type="text/html", pieces=[b"<p>" + b"x" * 200_000])
    [error] = await collect(scripted_backend)
    assert isinstance(error, Error)
    assert error.code == "upstream_unavailable"
    assert len(error.message) < 400


# -- deadlines: the policy's, through the stream API (the backend keeps none) -----------------------


async def post_quote_to(
    upstream_url: str, settings: Any, persona: Persona, **gateway: Any
) -> StreamedResponse:
    settings.AI_BACKEND = "openai"
    settings.OPENAI_COMPAT = OpenAICompatSettings(base_url=upstream_url, api_key="")
    configure(settings, max_attempts=1, fallback_models=[], **gateway)
    await reset_backends()
    try:
        return await request("POST", "/api/quotes/stream", json_body={"persona": persona.slug})
    finally:
        await reset_backends()


def error_code_of(response: StreamedResponse) -> str:
    *_, error = parse_sse(response.body)
    assert error["event"] == "error", response.body
    return str(json.loads(error["data"])["error"]["code"])


@pytest.mark.integration
async def test_openai_compat_stall_before_the_first_token_is_504(
    upstream: ScriptedUpstream, persona: Persona, settings: Any
) -> None:
    upstream.reply = Reply(pieces=[asyncio.Event()])  # the headers, then silence

    response = await post_quote_to(upstream.url, settings, persona, ttft_timeout_s=0.3)

    assert response.status == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    await asyncio.wait_for(upstream.client_gone.wait(), 2)  # the abandoned response was closed


@pytest.mark.integration
async def test_openai_compat_stall_mid_stream_ends_with_idle_timeout(
    upstream: ScriptedUpstream, persona: Persona, settings: Any
) -> None:
    upstream.reply = Reply(pieces=[chunk("a"), asyncio.Event()])

    response = await post_quote_to(upstream.url, settings, persona, idle_timeout_s=0.3)

    assert response.status == 200
    assert b'"a"' in response.body
    assert error_code_of(response) == "idle_timeout"
    await asyncio.wait_for(upstream.client_gone.wait(), 2)


@pytest.mark.integration
async def test_openai_compat_total_deadline_covers_a_trickling_stream(
    upstream: ScriptedUpstream, persona: Persona, settings: Any
) -> None:
    # Every read is quick, but the whole answer would take 5 s: the 0.5 s deadline ends it.
    upstream.reply = Reply(pieces=[piece for _ in range(50) for piece in (chunk("."), 0.1)])
    loop = asyncio.get_running_loop()
    started = loop.time()

    response = await post_quote_to(upstream.url, settings, persona, idle_timeout_s=1.0, total_timeout_s=0.5)

    assert loop.time() - started < 2
    assert error_code_of(response) == "deadline_exceeded"
    assert 2 <= response.body.count(b'"."') < 50


@pytest.mark.integration
async def test_openai_compat_backend_takes_its_connect_timeout_from_ai_http(
    settings: Any, persona: Persona, unaccepting_port: int
) -> None:
    """The backend the app builds reads AI_HTTP (AI_CONNECT_TIMEOUT, ...), not Workers AI's
    settings, which hold no timeouts."""
    settings.AI_HTTP = replace(settings.AI_HTTP, connect_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()

    response = await post_quote_to(f"http://127.0.0.1:{unaccepting_port}/v1", settings, persona)

    assert loop.time() - started < 2  # the default connect timeout is 5 s
    assert response.status == 504
    assert response.json()["error"]["code"] == "upstream_timeout"


@pytest.mark.integration
async def test_openai_compat_backend_holds_at_most_ai_max_connections(
    settings: Any, upstream: ScriptedUpstream
) -> None:
    """AI_MAX_CONNECTIONS bounds this backend's pool too: with 1, a second stream waits for the
    first one's connection and, past the connect (pool) timeout, ends with upstream_timeout."""
    release = asyncio.Event()
    upstream.reply = Reply(pieces=[chunk("a"), release, sse("[DONE]")])
    settings.OPENAI_COMPAT = OpenAICompatSettings(base_url=upstream.url, api_key="")
    settings.AI_HTTP = replace(settings.AI_HTTP, max_connections=1, connect_timeout_s=0.3)
    await reset_backends()
    backend = get_backend("openai")
    first = backend.stream(QUOTE)
    try:
        async with asyncio.timeout(10):  # a guard: without the bound the second stream stalls
            assert isinstance(await anext(first), Meta)
            assert await anext(first) == Token("a")
            second = await collect(backend)
            release.set()
            rest = [event async for event in first]
    finally:
        await first.aclose()
        await reset_backends()
    assert len(upstream.requests) == 1
    assert len(second) == 1 and isinstance(second[0], Error) and second[0].code == "upstream_timeout"
    assert isinstance(rest[-1], Done)


@pytest.mark.integration
async def test_openai_compat_one_client_per_backend_and_aclose(
    upstream: ScriptedUpstream, scripted_backend: OpenAICompatBackend
) -> None:
    upstream.reply = Reply(pieces=[sse("[DONE]")])
    assert scripted_backend.model_name("@cf/meta/llama-3.1-8b-instruct") == "@cf/meta/llama-3.1-8b-instruct"
    await collect(scripted_backend)
    client = scripted_backend._client
    assert client is not None
    await collect(scripted_backend)
    assert scripted_backend._client is client
    await scripted_backend.aclose()
    assert client.is_closed
    assert scripted_backend._client is None


async def _until_first_token(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    async for event in events:
        yield event
        if isinstance(event, Token):
            return


async def _slot_busy(server: LlamaServer) -> bool:
    """Whether llama.cpp's server is still generating (its /slots endpoint)."""
    import httpx

    root = server.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{root}/slots", headers={"Authorization": f"Bearer {server.api_key}"})
    response.raise_for_status()
    return any(slot["is_processing"] for slot in response.json())
