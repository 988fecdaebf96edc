"""The stream machinery on its own (streaming/): a generation read by several readers from
offsets, its stop, grace and keep-alive, following it, and the retry, fallback and deadline
policy. Sources here are plain async generators: no socket, no database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from streaming import sse
from streaming.events import Done, Error, Event, Meta, Ping, Token, Usage, from_json, to_json
from streaming.generation import ABANDONED, Generation, Generations, replay
from streaming.policy import Policy, generate

pytestmark = pytest.mark.unit
STOP = Error("stopped", "The quote was stopped.", 409)


async def words(*texts: str, delay: float = 0.0, end: Event | None = None) -> AsyncGenerator[Event, None]:
    for text in texts:
        if delay:
            await asyncio.sleep(delay)
        yield Token(text)
    yield end or Done()


async def collect(reader: AsyncGenerator[Event, None]) -> list[Event]:
    return [event async for event in reader]


async def live(
    source: AsyncGenerator[Event, None], **options: float
) -> tuple[Generation, asyncio.Task[None]]:
    generation = Generation("g", **options)

    async def run() -> None:
        generation.close(await generation.run(source))

    return generation, asyncio.create_task(run())


async def test_readers_from_any_offset_get_the_same_events_and_one_end() -> None:
    generation, task = await live(words("a", "b", "c", delay=0.01))
    whole, late = await asyncio.gather(collect(generation.read(0)), collect(generation.read(2)))
    await task
    assert whole == [Token("a"), Token("b"), Token("c"), Done()]
    assert late == [Token("c"), Done()]
    assert await collect(generation.read(3)) == [Done()]  # resumed before the end
    assert await collect(generation.read(4)) == []  # resumed after it: nothing more


async def test_stop_cancels_the_source_at_once_and_readers_end_with_the_error() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncGenerator[Event, None]:
        try:
            while True:
                yield Token("tick")
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    generation, task = await live(endless())
    reader = generation.read(0)
    assert await anext(reader) == Token("tick")
    assert generation.stop(STOP)
    await asyncio.wait_for(closed.wait(), 0.1)
    assert (await collect(reader))[-1] == STOP
    await task
    assert generation.end == STOP and not generation.stop(STOP)


async def test_without_readers_it_runs_for_the_grace_then_is_abandoned() -> None:
    generation, task = await live(words(*"abcdefghij", delay=0.05), grace_s=0.2)
    reader = generation.read(0)
    await anext(reader)
    await reader.aclose()  # the connection dropped
    await asyncio.sleep(0.1)
    assert generation.stopped is None  # still in its grace
    again = generation.read(1)  # a resume within it
    await anext(again)
    await again.aclose()
    await task
    assert generation.end == ABANDONED and len(generation.events) < 10


async def test_a_follower_keeps_the_source_when_its_own_client_stops() -> None:
    generation, task = await live(words("a", "b", "c", delay=0.02))
    follower = generation.follow()
    mine = generation.read(0)
    await anext(mine)
    generation.stop(STOP)
    assert (await collect(mine))[-1] == STOP
    assert await collect(follower) == [Token("a"), Token("b"), Token("c"), Done()]
    await task
    assert generation.end == STOP


async def test_pings_after_each_quiet_keepalive_once_text_flows() -> None:
    generation, task = await live(words("a", "b", delay=0.35), keepalive_s=0.1)
    events = await collect(generation.read(0))
    await task
    assert events[0] == Token("a") and events[-2:] == [Token("b"), Done()]
    assert 2 <= events.count(Ping()) <= 4


async def test_a_failing_source_ends_with_an_internal_error() -> None:
    async def broken() -> AsyncGenerator[Event, None]:
        yield Token("a")
        raise RuntimeError("a bug")

    generation, task = await live(broken())
    events = await collect(generation.read(0))
    await task
    assert isinstance(events[-1], Error) and events[-1].code == "internal_error"


async def test_drain_waits_then_stops_what_is_left() -> None:
    registry = Generations()
    quick, quick_task = await live(words("a"))
    slow, slow_task = await live(words(*"abcdefghij", delay=0.1))
    registry.add(quick)
    registry.add(slow)
    quick_task.add_done_callback(lambda _: registry.ended(quick))
    slow_task.add_done_callback(lambda _: registry.ended(slow))
    cut = await registry.drain(0.2, Error("server_draining", "restarting", 503))
    assert cut == 1 and quick.end == Done() and isinstance(slow.end, Error) and registry.draining


async def test_replay_paces_tokens() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = [event async for event in replay([Token("a"), Token("b"), Token("c"), Done()], 0.05)]
    assert events[-1] == Done() and loop.time() - started >= 0.1


def test_answers_round_trip_through_json_and_nothing_else_is_read() -> None:
    answer = [Meta(model="m", headers={"cf-aig-log-id": "x"}, step=0), Token("a"), Usage(1, 2), Done()]
    assert from_json(to_json(answer)) == answer
    for bad in (
        {"meta": {"model": "m", "headers": {"set-cookie": "x"}, "step": 0}},
        "\ud800",
        {"exec": None},
    ):
        with pytest.raises(ValueError):
            from_json([bad])


def test_sse_framing_splits_lines_and_escapes_fragments() -> None:
    assert sse.event("a\nb", name="x") == b"event: x\ndata: a\ndata: b\n\n"
    assert sse.fragment("<i>") == b"data: &lt;i&gt;\n\n"
    assert sse.with_id(sse.DONE, "1") == b"id: 1\ndata: [DONE]\n\n"


# -- the policy --------------------------------------------------------------------------------


def scripted(*answers: list[Event] | float) -> tuple[list[str], object]:
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
UNAVAILABLE = Error("upstream_unavailable", "down", 502)


async def test_policy_retries_then_falls_back_and_names_the_model_that_answered() -> None:
    calls, attempt = scripted([UNAVAILABLE], [UNAVAILABLE], [Token("hi"), Done()])
    events = [e async for e in generate(attempt, ["m1", "m2"], FAST)]  # type: ignore[arg-type]
    assert calls == ["m1", "m1", "m2"]
    assert events == [Meta(model="m2", step=1), Token("hi"), Done()]


async def test_policy_never_retries_after_text_nor_falls_back_for_a_final_error() -> None:
    calls, attempt = scripted([Token("a"), UNAVAILABLE])
    assert [e async for e in generate(attempt, ["m1", "m2"], FAST)][-1] == UNAVAILABLE  # type: ignore[arg-type]
    assert calls == ["m1"]
    auth = Error("upstream_auth", "refused", 502)
    calls, attempt = scripted([auth])
    assert [e async for e in generate(attempt, ["m1", "m2"], FAST)][-1] == auth  # type: ignore[arg-type]
    assert calls == ["m1"]


async def test_policy_deadlines_first_token_and_idle() -> None:
    _, attempt = scripted(5.0, 5.0)
    events = [e async for e in generate(attempt, ["m1"], FAST)]  # type: ignore[arg-type]
    # The first-token deadline cut each 5 s wait (else the attempts would have ended on their own,
    # "ended without finishing"): no bound on the time taken, which a busy machine stretches.
    assert isinstance(events[-1], Error) and events[-1].code == "upstream_timeout"

    async def stalls_mid_quote(model: str) -> AsyncGenerator[Event, None]:
        yield Token("a")
        await asyncio.sleep(5)

    events = [e async for e in generate(stalls_mid_quote, ["m1"], FAST)]
    assert isinstance(events[-1], Error) and events[-1].code == "idle_timeout"


async def test_policy_passes_an_outside_cancellation_on() -> None:
    _, attempt = scripted(5.0)
    task = asyncio.create_task(collect(generate(attempt, ["m1"], FAST)))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
