"""OpenAICompatBackend against a real server (llama.cpp's own, running Gemma 3 270M; fixtures in
tests/llama_server.py) and, for what that server cannot be made to do (usage chunks, broken JSON,
a stall, a cut connection), against the scripted OpenAI-compatible upstream (harness/openai.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from streaming import Done, Error, Event, Meta, Policy, Token, Usage

from harness.openai import Reply, ScriptedUpstream
from harness.workers_ai import KeepAliveUpstream, Scenario
from quotes.backends import reset_backends
from quotes.backends.base import GenerationRequest, Message
from quotes.backends.openai_compat import OpenAICompatBackend
from quotes.errors import upstream_auth
from quotes.models import Generation, Persona
from tests.asgi import StreamedResponse, parse_sse, post_quote
from tests.llama_server import LlamaServer

LOGGER = "quotes.backends.openai_compat"
Upstream, Compat = ScriptedUpstream, OpenAICompatBackend
FRAME = (
    'Seneca, on time: "We suffer more often in imagination than in reality."\n'
    'Maya Angelou, on courage: "Courage is the most important of all the virtues."\nAlan Watts, on water: "'
)
#: greedy: the same 16 tokens every run, so "16 tokens" is not luck
QUOTE = GenerationRequest(
    "gemma-3-270m",
    (Message("system", "A collection of short quotes."), Message("user", FRAME)),
    "Alan Watts",
    "water",
    max_tokens=16,
    temperature=0,
    seed=7,
)


@pytest.fixture(autouse=True)
def _logging_configured() -> None:
    """Django's set-up (on the app's first import) configures logging, which drops caplog's handler
    from the root logger: have it happen before caplog attaches."""
    import config.asgi  # noqa: F401


async def collect(backend: OpenAICompatBackend, request: GenerationRequest = QUOTE) -> list[Event]:
    async with contextlib.aclosing(backend.stream(request)) as events:
        return [event async for event in events]


def logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == LOGGER)


@contextlib.asynccontextmanager
async def backend_at(base_url: str, api_key: str = "") -> AsyncIterator[OpenAICompatBackend]:
    backend = OpenAICompatBackend(base_url=base_url, api_key=api_key, connect_timeout_s=2.0)
    try:
        yield backend
    finally:
        await backend.aclose()


@pytest.fixture
async def llama_backend(llama_server: LlamaServer) -> AsyncIterator[OpenAICompatBackend]:
    async with backend_at(llama_server.base_url, llama_server.api_key) as backend:
        yield backend


async def slot_busy(server: LlamaServer) -> bool:
    """Whether llama.cpp's server is still generating (its /slots endpoint)."""
    root = server.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{root}/slots", headers={"Authorization": f"Bearer {server.api_key}"})
    response.raise_for_status()
    return any(slot["is_processing"] for slot in response.json())


# --- against the real llama.cpp server ----------------------------------------------------------


@pytest.mark.system
async def test_stopping_early_frees_the_servers_slot_for_the_next_quote(
    llama_server: LlamaServer, llama_backend: Compat
) -> None:
    async with contextlib.aclosing(llama_backend.stream(replace(QUOTE, max_tokens=900))) as events:
        async for event in events:  # about 12 s of writing, were it not stopped
            if isinstance(event, Token):
                break

    # The server saw the connection go and stopped: its one slot is idle long before 900 tokens.
    for _ in range(40):
        if not await slot_busy(llama_server):
            break
        await asyncio.sleep(0.05)
    assert not await slot_busy(llama_server)

    # The server is free again: a whole quote, each chunk its own event.
    events = await collect(llama_backend)
    assert events[0] == Meta(model="gemma-3-270m")  # the server's name for the model it runs
    assert events[-1] == Done()
    tokens = [e for e in events if isinstance(e, Token)]
    assert len(tokens) == 16 and all(t.text for t in tokens)
    usages = [e for e in events if isinstance(e, Usage)]
    assert len(usages) <= 1 and all(u.prompt_tokens > 0 and u.completion_tokens == 16 for u in usages)


@pytest.mark.system
async def test_llama_cpp_refusals_are_answered_in_our_words_and_logged_in_its_own(
    llama_server: LlamaServer, llama_backend: Compat, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "sk-wrong-" + llama_server.api_key[::-1]
    async with backend_at(llama_server.base_url, wrong) as backend:
        [refused] = await collect(backend)
    async with backend_at(
        llama_server.base_url.removesuffix("/v1") + "/api", llama_server.api_key
    ) as backend:
        [not_found] = await collect(backend)  # a mistyped base URL
    # llama.cpp checks the prompt against its context before it streams: a 400 that names it.
    [too_long] = await collect(llama_backend, replace(QUOTE, messages=(Message("user", "word " * 3000),)))

    assert refused == upstream_auth()  # the visitor learns nothing about our credentials
    assert isinstance(not_found, Error) and (not_found.code, not_found.status) == ("upstream_rejected", 404)
    assert isinstance(too_long, Error) and (too_long.code, too_long.status) == ("upstream_rejected", 400)
    assert "context" not in too_long.message
    log = logged(caplog)
    assert "HTTP 401" in log and "OPENAI_API_KEY" in log and wrong not in log
    assert "invalid api key" in log.lower()  # the server's own words, for the operator
    assert "Not Found" in log and "context" in log


@pytest.mark.system
async def test_the_stream_api_serves_a_quote_from_llama_cpp(
    persona: Persona, settings: Any, llama_server: LlamaServer
) -> None:
    settings.AI_BACKEND = "openai"
    settings.OPENAI_BASE_URL, settings.OPENAI_API_KEY = llama_server.base_url, llama_server.api_key
    await reset_backends()
    try:
        response = await post_quote({"persona": persona.slug})
    finally:
        await reset_backends()

    assert (response.status, response.headers["content-type"]) == (200, "text/event-stream")
    events = parse_sse(response.body)
    assert events[-1] == {"event": "message", "data": "[DONE]"}
    payloads = [json.loads(e["data"]) for e in events[:-1]]
    text = "".join(p["response"] for p in payloads)
    assert text.strip() and all(set(p) in ({"response"}, {"response", "usage"}) for p in payloads)
    row = await Generation.objects.aget()
    assert (row.backend, row.status, row.text) == ("openai", "ok", text)


@pytest.mark.integration
async def test_a_port_nobody_listens_on_is_unreachable(closed_port: int) -> None:
    async with backend_at(f"http://127.0.0.1:{closed_port}/v1") as backend:
        [error] = await collect(backend)

    assert isinstance(error, Error) and (error.code, error.status) == ("upstream_unreachable", 502)


# --- against a scripted upstream ----------------------------------------------------------------


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def scripted(upstream: ScriptedUpstream) -> AsyncIterator[OpenAICompatBackend]:
    async with backend_at(upstream.url, "sk-secret-123") as backend:
        yield backend


def sse(data: object) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def chunk(content: str | None = None, *, usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, object] = {"model": "served-model", "object": "chat.completion.chunk"}
    body["choices"] = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    if usage is not None:
        body["usage"] = usage
    return sse(body)


@pytest.mark.integration
async def test_sends_only_the_openai_sampling_fields(upstream: Upstream, scripted: Compat) -> None:
    upstream.reply = Reply(pieces=[sse("[DONE]")])
    await collect(scripted, replace(QUOTE, top_k=5, repetition_penalty=1.1, lora="x"))
    async with backend_at(upstream.url) as keyless:
        events = await collect(keyless)

    [(line, headers, raw), (_, keyless_headers, _)] = upstream.requests
    assert line == "POST /v1/chat/completions HTTP/1.1"
    assert (headers["authorization"], headers["accept"]) == ("Bearer sk-secret-123", "text/event-stream")
    assert json.loads(raw) == {
        "model": "gemma-3-270m",
        "messages": [{"role": m.role, "content": m.content} for m in QUOTE.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 16,
        "temperature": 0,
        "seed": 7,
    }
    assert "authorization" not in keyless_headers
    assert events == [Meta(model="gemma-3-270m", headers={"x-request-id": "req-1"}), Done()]


@pytest.mark.integration
async def test_tokens_stream_as_sent_and_a_stop_closes(upstream: Upstream, scripted: Compat) -> None:
    release = asyncio.Event()
    role = sse({"model": "served-model", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    stop = sse({"model": "served-model", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = chunk(usage={"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14})
    upstream.reply = Reply(pieces=[role, chunk("Be "), release, chunk("water."), stop, usage, sse("[DONE]")])
    async with contextlib.aclosing(scripted.stream(QUOTE)) as events:
        assert await anext(events) == Meta(model="served-model", headers={"x-request-id": "req-1"})
        assert await anext(events) == Token("Be ")  # the upstream holds the rest back: not buffered
        release.set()
        assert [e async for e in events] == [Token("water."), Usage(12, 2), Done()]
    assert not upstream.client_gone.is_set()

    upstream.reply = Reply(pieces=[chunk("only"), asyncio.Event()])  # then nothing, ever
    async with contextlib.aclosing(scripted.stream(QUOTE)) as events:
        while not isinstance(await anext(events), Token):
            pass
    await asyncio.wait_for(upstream.client_gone.wait(), 2)


BROKEN = [
    (Reply(pieces=[chunk("half")]), [Token("half")], "upstream_dropped"),
    # Usage that did arrive is still reported (it was paid for), before the error.
    (
        Reply(pieces=[chunk("half", usage={"prompt_tokens": 3, "completion_tokens": 1})], finish=False),
        [Token("half"), Usage(3, 1)],
        "upstream_dropped",
    ),
    (
        Reply(pieces=[chunk("ok"), b'data: {"choices": [\n\n', sse("[DONE]")]),
        [Token("ok")],
        "upstream_malformed",
    ),
    (Reply(content_type="application/json", pieces=[b'{"choices": []}']), None, "upstream_malformed"),
    (
        Reply(pieces=[chunk("a"), sse({"error": {"message": "model crashed"}})]),
        [Token("a")],
        "upstream_unavailable",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("reply", "before", "code"), BROKEN)
async def test_a_broken_stream_ends_with_its_error(
    upstream: Upstream,
    scripted: Compat,
    caplog: pytest.LogCaptureFixture,
    reply: Reply,
    before: list[Event] | None,
    code: str,
) -> None:
    upstream.reply = reply

    events = await collect(scripted)

    if before is not None:
        assert events[0] == Meta(model="served-model", headers={"x-request-id": "req-1"})
        assert events[1:-1] == before
    assert isinstance(events[-1], Error) and (events[-1].code, events[-1].status) == (code, 502)
    if code == "upstream_unavailable":
        assert "model crashed" not in events[-1].message and "mid-stream: model crashed" in logged(caplog)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("status", "code", "answered"),
    [
        (400, "upstream_rejected", 400),
        (429, "upstream_rejected", 429),
        (503, "upstream_unavailable", 502),
        (502, "upstream_unavailable", 502),
    ],
)
async def test_an_http_error_is_answered_in_our_words_and_logged_without_the_key(
    upstream: Upstream,
    scripted: Compat,
    caplog: pytest.LogCaptureFixture,
    status: int,
    code: str,
    answered: int,
) -> None:
    # An upstream that echoes the key (some do, in "incorrect API key" messages); a 200 KB page.
    body = json.dumps({"error": {"message": "Bad thing for key sk-secret-123", "type": "x"}}).encode()
    upstream.reply = Reply(status=status, content_type="application/json", pieces=[body])
    if status == 502:
        upstream.reply = Reply(
            status=502,
            content_type="text/html",
            pieces=[b"<p>Bad thing for key sk-secret-123 " + b"x" * 200_000],
        )

    [error] = await collect(scripted)

    assert isinstance(error, Error) and (error.code, error.status) == (code, answered)
    assert "Bad thing" not in error.message
    assert f"HTTP {status}: Bad thing for key [redacted]" in logged(caplog)
    assert "sk-secret-123" not in logged(caplog)


# --- through the stream API ------------------------------------------------------------------------


async def quote_from(
    upstream: Upstream, settings: Any, persona: Persona, **policy: float
) -> StreamedResponse:
    settings.AI_BACKEND = "openai"
    settings.OPENAI_BASE_URL, settings.OPENAI_API_KEY = upstream.url, "sk-secret-123"
    settings.QUOTES_POLICY = Policy(**{"max_attempts": 1, "ttft_timeout_s": 5.0, **policy})
    settings.QUOTES_FALLBACK_MODELS = []
    await reset_backends()
    try:
        return await post_quote({"persona": persona.slug})
    finally:
        await reset_backends()


@pytest.mark.integration
async def test_a_stall_before_the_first_token_is_504_and_closes_the_connection(
    upstream: ScriptedUpstream, persona: Persona, settings: Any
) -> None:
    """The backend keeps no deadline: the policy's cancels it, and the response is closed."""
    upstream.reply = Reply(pieces=[asyncio.Event()])  # the headers, then silence

    response = await quote_from(upstream, settings, persona, ttft_timeout_s=0.3)

    assert (response.status, response.json()["error"]["code"]) == (504, "upstream_timeout")
    await asyncio.wait_for(upstream.client_gone.wait(), 2)


@pytest.mark.integration
async def test_one_upstream_connection_serves_request_after_request() -> None:
    """The body's end is read after [DONE] (its chunked terminator), so httpx pools the connection:
    one for three requests (it opened one per request, about 1.5 ms each: issue 41)."""
    upstream = KeepAliveUpstream(Scenario(tokens=["One", " line."], openai_style=True))
    ready = threading.Event()
    threading.Thread(target=lambda: asyncio.run(upstream.serve(ready)), daemon=True).start()
    assert ready.wait(10)
    backend = OpenAICompatBackend(base_url=f"http://127.0.0.1:{upstream.port}/v1", api_key="")
    try:
        for _ in range(3):
            events = await collect(backend)
            assert (
                "".join(e.text for e in events if isinstance(e, Token)) == "One line."
                and events[-1] == Done()
            )
    finally:
        await backend.aclose()
    assert (upstream.requests, upstream.connections) == (3, 1)
