"""The package on its own: a stream read by several readers from offsets, its stop, grace,
keep-alive and `on_end`, following it, the registry and its drain, the retry, fallback and
deadline policy, answers as JSON, SSE framing, and the README's example on bare ASGI. Sources are
plain async generators: no socket, no web framework."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from streaming import (
    Done,
    Endings,
    Error,
    Event,
    Meta,
    Outcomes,
    Ping,
    Policy,
    Stream,
    Streams,
    Token,
    Usage,
    from_json,
    generate,
    replay,
    sse,
    to_json,
)

ENDINGS = Endings(
    abandoned=Error("abandoned", "nobody came back", 410),
    ended_early=Error("ended_early", "the source ended early", 500),
    failed=Error("failed", "the source failed", 500),
)
STOP = Error("stopped", "stopped", 409)


async def words(*texts: str, delay: float = 0.0, end: Event | None = None) -> AsyncGenerator[Event, None]:
    for text in texts:
        if delay:
            await asyncio.sleep(delay)
        yield Token(text)
    yield end or Done()


async def collect(reader: AsyncGenerator[Event, None]) -> list[Event]:
    return [event async for event in reader]


def started(source: AsyncGenerator[Event, None], *, grace_s: float = 0, keepalive_s: float = 15) -> Stream:
    stream = Streams(ENDINGS).open("s", grace_s=grace_s, keepalive_s=keepalive_s)
    stream.start(source)
    return stream


async def test_readers_from_any_offset_get_the_same_events_and_one_end() -> None:
    stream = started(words("a", "b", "c", delay=0.01))
    whole, late = await asyncio.gather(collect(stream.read(0)), collect(stream.read(2)))
    assert whole == [Token("a"), Token("b"), Token("c"), Done()]
    assert late == [Token("c"), Done()]
    assert await stream.closed == Done()
    assert await collect(stream.read(3)) == [Done()]  # resumed before the end
    assert await collect(stream.read(4)) == []  # resumed after it: nothing more


async def test_the_first_token_of_a_burst_reaches_a_reader_before_the_rest_is_published() -> None:
    """A source whose events are all ready at once (a fast model, one read holding many events):
    the first reaches the reader before the source has published the rest; the rest come
    together, as they came (one write for the lot, not one per event)."""
    stream = started(words(*(f"w{n}" for n in range(200))))
    reader = stream.read(0)
    assert await anext(reader) == Token("w0")
    assert len(stream.events) < 5
    assert await anext(reader) == Token("w1")
    assert len(stream.events) == 200  # the burst's rest, published before the reader ran again
    assert len(await collect(reader)) == 199  # w2 to w199, then Done


async def test_stop_cancels_the_source_at_once_and_readers_end_with_the_error() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncGenerator[Event, None]:
        try:
            while True:
                yield Token("tick")
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    stream = started(endless())
    reader = stream.read(0)
    assert await anext(reader) == Token("tick")
    assert stream.stop(STOP)
    await asyncio.wait_for(closed.wait(), 1)
    assert (await collect(reader))[-1] == STOP
    assert await stream.closed == STOP and not stream.stop(STOP)


async def test_without_readers_it_runs_for_the_grace_then_is_abandoned() -> None:
    stream = started(words(*"abcdefghij", delay=0.05), grace_s=0.2)
    reader = stream.read(0)
    await anext(reader)
    await reader.aclose()  # the connection dropped
    await asyncio.sleep(0.1)
    assert stream.stopped is None  # still in its grace
    again = stream.read(1)  # a resume within it
    await anext(again)
    await again.aclose()
    assert await stream.closed == ENDINGS.abandoned and len(stream.events) < 10


async def test_a_follower_keeps_the_source_when_its_own_client_stops() -> None:
    stream = started(words("a", "b", "c", delay=0.02))
    follower = stream.follow()
    mine = stream.read(0)
    await anext(mine)
    stream.stop(STOP)
    assert (await collect(mine))[-1] == STOP
    assert await collect(follower) == [Token("a"), Token("b"), Token("c"), Done()]
    assert await stream.closed == STOP


async def test_pings_after_each_quiet_keepalive_once_text_flows() -> None:
    stream = started(words("a", "b", delay=0.35), keepalive_s=0.1)
    events = await collect(stream.read(0))
    assert events[0] == Token("a") and events[-2:] == [Token("b"), Done()]
    assert Ping() in events


async def test_a_failing_source_ends_with_its_failed_ending() -> None:
    async def broken() -> AsyncGenerator[Event, None]:
        yield Token("a")
        raise RuntimeError("a bug")

    assert (await collect(started(broken()).read(0)))[-1] == ENDINGS.failed
    assert (await collect(started(words("a", end=Token("b"))).read(0)))[-1] == ENDINGS.ended_early


async def test_on_end_runs_before_readers_see_the_end_and_its_failure_ends_the_stream_all_same() -> None:
    seen: list[tuple[int, Done | Error, bool]] = []

    async def record(stream: Stream, end: Done | Error) -> None:
        await asyncio.sleep(0.05)  # a slow write
        seen.append((len(stream.events), end, stream.closed.done()))

    async def fails(stream: Stream, end: Done | Error) -> None:
        raise RuntimeError("the record could not be written")

    streams = Streams(ENDINGS)
    recorded, failing = streams.open("a", key="k"), streams.open("b")
    recorded.start(words("x", "y"), record)
    failing.start(words("x"), fails)
    assert streams.joinable("k") is recorded
    assert await collect(recorded.read(0)) == [Token("x"), Token("y"), Done()]
    assert seen == [(2, Done(), False)]  # recorded before the end was told
    assert await collect(failing.read(0)) == [Token("x"), Done()]
    assert streams.live == set() and streams.joinable("k") is None and streams.get("a") is recorded


async def test_drain_waits_then_stops_what_is_left() -> None:
    streams = Streams(ENDINGS)
    quick, slow = streams.open("quick"), streams.open("slow")
    quick.start(words("a"))
    slow.start(words(*"abcdefghij", delay=0.1))
    cut = await streams.drain(0.2, Error("draining", "restarting", 503))
    assert cut == 1 and await quick.closed == Done() and isinstance(await slow.closed, Error)


async def test_ended_streams_are_found_by_id_for_keep_s_then_forgotten() -> None:
    streams = Streams(ENDINGS, keep=2, keep_s=60)
    for name in ("a", "b", "c"):
        stream = streams.open(name)
        stream.start(words(name))
        await stream.closed
    assert [streams.get(name) is not None for name in ("a", "b", "c")] == [False, True, True]


async def test_replay_paces_tokens() -> None:
    loop = asyncio.get_running_loop()
    begun = loop.time()
    events = [event async for event in replay([Token("a"), Token("b"), Token("c"), Done()], 0.05)]
    assert events[-1] == Done() and loop.time() - begun >= 0.1


def test_answers_round_trip_through_json_and_nothing_else_is_read() -> None:
    answer: list[Event] = [
        Meta(model="m", headers={"x-request-id": "x"}, step=0),
        Token("a"),
        Usage(1, 2),
        Done(),
    ]
    assert from_json(to_json(answer)) == answer
    for bad in (
        {"meta": {"model": "m", "headers": {"bad name": "x"}, "step": 0}},
        "\ud800",
        {"exec": None},
    ):
        with pytest.raises(ValueError):
            from_json([bad])


def test_sse_framing_splits_lines() -> None:
    assert sse.event("a\nb", name="x") == b"event: x\ndata: a\ndata: b\n\n"
    assert sse.with_id(sse.data({"a": "é"}), "1") == 'id: 1\ndata: {"a":"é"}\n\n'.encode()
    assert sse.named("end", {}) == b"event: end\ndata: {}\n\n" and sse.retry(1000) == b"retry: 1000\n\n"


# -- the policy --------------------------------------------------------------------------------

Attempt = Callable[[str], AsyncGenerator[Event, None]]


def scripted(*answers: list[Event] | float) -> tuple[list[str], Attempt]:
    """An attempt function answering each call with the next script: events, or a stall (s)."""
    calls: list[str] = []
    queue = list(answers)

    async def attempt(model: str) -> AsyncGenerator[Event, None]:
        calls.append(model)
        answer = queue.pop(0)
        if isinstance(answer, float):
            await asyncio.sleep(answer)
            return
        for event in answer:
            yield event

    return calls, attempt


FAST = Policy(
    max_attempts=2, retry_delay_s=0.001, ttft_timeout_s=0.4, idle_timeout_s=0.2, total_timeout_s=2.0
)
UNAVAILABLE = Error("unavailable", "down", 502)
AUTH = Error("auth", "refused", 502)
OUTCOMES = Outcomes(
    retryable=frozenset({"unavailable"}),
    final=frozenset({"auth"}),
    first_token_timeout=Error("first_token_timeout", "slow to start", 504),
    idle_timeout=Error("idle_timeout", "stalled", 504),
    deadline=Error("deadline", "too long", 504),
    ended_early=Error("ended_early", "ended early", 500),
)


async def run(attempt: Attempt, models: list[str]) -> list[Event]:
    return [event async for event in generate(attempt, models, FAST, OUTCOMES)]


async def test_policy_retries_then_falls_back_and_names_the_model_that_answered() -> None:
    calls, attempt = scripted([UNAVAILABLE], [UNAVAILABLE], [Token("hi"), Done()])
    assert await run(attempt, ["m1", "m2"]) == [Meta(model="m2", step=1), Token("hi"), Done()]
    assert calls == ["m1", "m1", "m2"]


async def test_policy_waits_for_the_upstreams_retry_after_or_falls_back_past_the_deadline() -> None:
    busy = Error("unavailable", "busy", 429, retry_after=1)
    calls, attempt = scripted([busy], [Token("hi"), Done()])
    assert (await run(attempt, ["m1", "m2"]))[0] == Meta(model="m2", step=1)  # 1 s: past the 0.4 s
    assert calls == ["m1", "m2"]


async def test_policy_never_retries_after_text_nor_falls_back_for_a_final_error() -> None:
    calls, attempt = scripted([Token("a"), UNAVAILABLE])
    assert (await run(attempt, ["m1", "m2"]))[-1] == UNAVAILABLE
    assert calls == ["m1"]
    calls, attempt = scripted([AUTH])
    assert (await run(attempt, ["m1", "m2"]))[-1] == AUTH
    assert calls == ["m1"]


async def test_policy_deadlines_first_token_and_idle() -> None:
    _, attempt = scripted(5.0, 5.0)
    # The first-token deadline cut each 5 s wait (else the attempts would have ended on their own:
    # ended_early); no bound on the time taken, which a busy machine stretches.
    assert (await run(attempt, ["m1"]))[-1] == OUTCOMES.first_token_timeout

    async def stalls_mid_quote(model: str) -> AsyncGenerator[Event, None]:
        yield Token("a")
        await asyncio.sleep(5)

    assert (await run(stalls_mid_quote, ["m1"]))[-1] == OUTCOMES.idle_timeout


async def test_policy_passes_an_outside_cancellation_on() -> None:
    _, attempt = scripted(5.0)
    task = asyncio.create_task(run(attempt, ["m1"]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- the README's example ----------------------------------------------------------------------


async def test_the_readmes_example_streams_and_resumes_on_bare_asgi() -> None:
    path = Path(__file__).parents[1] / "examples" / "quote.py"
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert path.read_text() in readme.replace("```python\n", "").replace("```\n", "")
    spec = importlib.util.spec_from_file_location("quote_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    app: Callable[[dict[str, Any], Any, Any], Coroutine[Any, Any, None]] = example.app

    async def get(query: bytes, until: int = 0) -> list[bytes]:
        sent: list[bytes] = []
        stop = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b""))
            if until and sum(b"data:" in body for body in sent) >= until:
                stop.set()

        task = asyncio.create_task(app({"type": "http", "query_string": query}, None, send))
        if until:
            await stop.wait()
            task.cancel()  # the connection drops
        else:
            await task
        return [body for body in sent if body]

    head = await get(b"", until=3)
    stream_id, number = head[-1].split(b"\n")[0].removeprefix(b"id: ").decode().split(":")
    rest = await get(f"id={stream_id}&after={number}".encode())
    texts = [json.loads(body.split(b"data: ")[1])["text"] for body in head + rest if b'"text"' in body]
    assert "".join(texts) == "A stream outlives the connection that reads it. "
    assert rest[-1].endswith(b"event: end\ndata: {}\n\n")
