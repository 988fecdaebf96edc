"""The embedded model backend, on the real Gemma 3 270M model (llama.cpp from the xllamacpp wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from quotes.ai.backends.local import (
    LocalBackend,
    clean_ending,
    completion_body,
    completion_prompt,
    persona_sketch,
    quote_lead,
)
from quotes.ai.events import Done, Error, Event, GenerationRequest, Message, Token, Usage
from tests.conftest import LONG_COMPLETION, slots_held

ROOT = Path(__file__).resolve().parents[2]


def quote_request(**overrides: object) -> GenerationRequest:
    fields: dict[str, object] = {
        "model": "@cf/meta/llama-3.1-8b-instruct",
        "messages": (),
        "speaker": "Lao Tzu",
        "topic": "letting go",
        "max_tokens": 24,
        "temperature": 0.0,
    }
    fields.update(overrides)
    return GenerationRequest(**fields)  # type: ignore[arg-type]


def persona_messages(system: str) -> tuple[Message, ...]:
    return (Message("system", system), Message("user", "Write 1 quote about {topic}"))


async def until_done(backend: LocalBackend, stats_index: int = -1, limit_s: float = 5.0) -> None:
    """Wait for a job's worker thread to return (it is stamped there: nothing to await)."""
    job = backend.jobs[stats_index]
    for _ in range(int(limit_s / 0.01)):
        if job.finished_at is not None:
            return
        await asyncio.sleep(0.01)


@pytest.mark.unit
async def test_local_backend_closed_answers_busy_and_keeps_no_job() -> None:
    """A request after the backend closed (a process going away) gets an error, and leaves no
    waiting count or live job behind (they were taken before the thread pool refused it)."""
    backend = LocalBackend.from_settings(replace(settings.LOCAL_MODEL, preload=False))
    await backend.aclose()
    events = [event async for event in backend.stream(quote_request())]
    assert [type(event) for event in events] == [Error]
    assert backend.waiting == 0
    assert backend.jobs == []


# --- the frame -------------------------------------------------------------------------------


@pytest.mark.unit
def test_local_prompt_is_a_few_shot_frame_ending_on_an_open_quote() -> None:
    prompt = completion_prompt(quote_request(topic='the "sea"'))
    assert prompt.endswith("Lao Tzu, on the 'sea': \"")
    assert prompt.count("\n") >= 4  # a header and example lines before the open line


@pytest.mark.unit
def test_local_prompt_credits_the_persona_with_its_description_and_system_prompt() -> None:
    request = quote_request(
        description="The old master of the Tao: soft water, hard stone.",
        messages=persona_messages(
            'You are Lao Tzu, author of the Tao Te Ching, speaking in "short" paradoxes.'
        ),
    )
    assert persona_sketch(request) == (
        "The old master of the Tao: soft water, hard stone; author of the Tao Te Ching, speaking in 'short' paradoxes"
    )
    assert completion_prompt(request).endswith(
        f'Lao Tzu ({persona_sketch(request)}), on letting go: "Letting go'
    )
    # A bare "You are <name>" adds nothing beyond the name.
    assert persona_sketch(quote_request(messages=persona_messages("You are Lao Tzu"))) == ""


@pytest.mark.unit
def test_local_prompt_continues_a_conversation() -> None:
    request = quote_request(
        messages=(
            Message("system", "You are Lao Tzu"),
            Message("user", "Write 1 quote about letting go"),
            Message("assistant", 'Open the hand and the "river" flows.'),
            Message("user", "What about\nholding on?"),
        )
    )
    prompt = completion_prompt(request)
    assert prompt.endswith(
        "Lao Tzu, on letting go: \"Open the hand and the 'river' flows.\"\n"
        'Asked "What about holding on?", Lao Tzu replied: "'
    )


@pytest.mark.unit
def test_local_body_reads_the_whole_frame_when_the_persona_fixes_a_seed() -> None:
    """Reusing a slot's cached frame changes the logits' last bits: fine for a sampled quote, but
    a persona with a seed asks for the same quote every time."""
    assert completion_body(quote_request(seed=7))["cache_prompt"] is False
    assert completion_body(quote_request())["cache_prompt"] is True
    assert completion_body(quote_request())["stop"] == ['"', "\u201d", "\n"]


# --- one stream --------------------------------------------------------------------------------


async def collect(backend: LocalBackend, request: GenerationRequest) -> list[Event]:
    async with contextlib.aclosing(backend.stream(request)) as events:
        return [event async for event in events]


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Token))


@pytest.mark.integration
async def test_local_stream_yields_tokens_usage_then_done(local_backend: LocalBackend) -> None:
    events = await collect(local_backend, quote_request())

    *tokens, usage, done = events
    assert isinstance(done, Done)
    assert isinstance(usage, Usage)
    assert tokens and all(isinstance(t, Token) and t.text for t in tokens)
    text = text_of(events)
    assert text == text.lstrip()  # the quote starts at its first word
    assert '"' not in text and "\n" not in text  # the frame's closing quote is not part of the quote
    assert 0 < usage.completion_tokens == local_backend.jobs[-1].generated_tokens <= 24
    assert usage.prompt_tokens > 50  # the whole frame was read


@pytest.mark.integration
async def test_local_quote_opens_with_its_topic_sent_with_the_models_first_piece(
    local_backend: LocalBackend,
) -> None:
    """A short topic's words open the quote: the frame ends on them, and they reach the stream
    joined to the model's first piece (never ahead of it: the first token is the model's)."""
    request = quote_request(topic="old friends", max_tokens=8)
    assert completion_prompt(request).endswith(', on old friends: "Old friends')

    events = await collect(local_backend, request)

    pieces = [e.text for e in events if isinstance(e, Token)]
    assert pieces[0].startswith("Old friends") and len(pieces[0]) > len("Old friends"), pieces
    assert text_of(events).count("Old friends") == 1


@pytest.mark.integration
async def test_local_quote_closed_right_after_its_lead_is_asked_again_without_it(
    local_backend: LocalBackend,
) -> None:
    """A model that closes the quote on its lead (the topic, nothing said of it) is asked once
    more without the lead: the visitor gets a quote, never the topic alone or nothing."""
    body = {
        "prompt": 'Words: "apple" "pear" "plum" "fig',  # greedy, the model closes "fig" at once
        "max_tokens": 8,
        "stream": True,
        "temperature": 0.0,
        "stop": ['"', "\n"],
    }
    async with contextlib.aclosing(local_backend.stream_completion(body)) as events:
        assert text_of([event async for event in events]) == ""  # as the model closes it

    async with contextlib.aclosing(local_backend.stream_completion(body, lead="fig")) as events:
        got = [event async for event in events]
    assert isinstance(got[-1], Done)
    text = text_of(got)
    assert text.strip(" .") and not text.startswith("fig"), text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("topic", "lead"),
    [
        ("rain", "Rain"),
        ("the sea", "The sea"),
        ("don't panic", "Don't panic"),
        ("the obstacle in the way", "The obstacle in the way"),
        ("the year 1999", ""),  # not plain words
        ("how to stay calm at work", ""),  # more than five words: a question, not a subject
        ("rain?", ""),
        ("", ""),
    ],
)
def test_local_quote_lead_is_a_short_plain_topic(topic: str, lead: str) -> None:
    assert quote_lead(quote_request(topic=topic)) == lead


@pytest.mark.unit
def test_local_quote_lead_is_left_out_of_a_conversations_answer() -> None:
    request = quote_request(
        topic="rain",
        messages=(
            *persona_messages("You are Lao Tzu"),
            Message("assistant", "Rain falls."),
            Message("user", "And?"),
        ),
    )
    assert request.conversation and quote_lead(request) == ""
    assert completion_prompt(request).endswith('replied: "')


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "cut_short", "ending"),
    [
        ("It ends.", False, ""),
        ("It ends?", True, ""),
        ("It ends (as it began.)", False, ""),
        ("It stops", False, "."),
        ("It was cut", True, "\u2026"),
        ("", False, ""),
    ],
)
def test_local_clean_ending(text: str, cut_short: bool, ending: str) -> None:
    assert clean_ending(text, cut_short=cut_short) == ending


@pytest.mark.integration
async def test_local_quote_never_ends_on_a_comma(local_backend: LocalBackend) -> None:
    """A comma (or semicolon, or dash) waits for the text after it; a quote that stops there ends
    on a full stop instead, and one the token budget cuts short on an ellipsis."""
    counting = {
        "prompt": 'Counting: "one, two, three, four, five',
        "max_tokens": 20,
        "stream": True,
        "temperature": 0.0,
        "stop": [" eight", '"', "\n"],  # the model writes ", six, seven, eight": it stops on a comma
    }
    async with contextlib.aclosing(local_backend.stream_completion(counting)) as events:
        text = text_of([event async for event in events])
    assert text == ", six, seven."

    cut = {"prompt": 'A long sentence: "The', "max_tokens": 3, "stream": True, "temperature": 0.0}
    async with contextlib.aclosing(local_backend.stream_completion(cut)) as events:
        text = text_of([event async for event in events])
    assert local_backend.jobs[-1].stop_reason == "max_tokens"
    assert text.endswith("\u2026") and text.count("\u2026") == 1 and "," not in text[-2:]


@pytest.mark.integration
async def test_local_persona_words_steer_the_model(local_backend: LocalBackend) -> None:
    """What an admin writes in the system prompt reaches the model: greedy decoding, same seed,
    two system prompts, two different quotes."""
    sailor = quote_request(
        messages=persona_messages("You are Lao Tzu, an old sailor who loves storms"), seed=3
    )
    baker = quote_request(
        messages=persona_messages("You are Lao Tzu, a baker who thinks about bread"), seed=3
    )

    first, second = await collect(local_backend, sailor), await collect(local_backend, baker)

    assert isinstance(first[-1], Done) and isinstance(second[-1], Done)
    assert text_of(first) and text_of(second)
    assert text_of(first) != text_of(second)
    # ... and the same words give the same quote, so the difference is the prompt's doing.
    assert text_of(await collect(local_backend, sailor)) == text_of(first)


@pytest.mark.integration
async def test_local_characters_split_across_tokens_arrive_whole(local_backend: LocalBackend) -> None:
    """U+1D518, U+A66E and U+10348 are byte-fallback tokens in Gemma's vocabulary (several tokens per character).
    A conversation that repeats them makes the greedy model write them, and each piece that
    reaches the stream is whole text."""
    line = "Mañana 𝔘 ꙮ 𐍈 naïve 𝔘 ꙮ 𐍈"
    messages = persona_messages("You are Lao Tzu")
    for _ in range(3):
        messages += (Message("assistant", line), Message("user", "Again?"))

    events = await collect(local_backend, quote_request(messages=messages, max_tokens=24, seed=1))

    pieces = [e.text for e in events if isinstance(e, Token)]
    usage = next(e for e in events if isinstance(e, Usage))
    assert "\ufffd" not in "".join(pieces)
    assert {"𝔘", "ꙮ", "𐍈"} <= set("".join(pieces))
    # More tokens were generated than pieces arrived: split characters were joined, not dropped.
    assert usage.completion_tokens > len(pieces)


@pytest.mark.integration
async def test_local_stop_ends_generation_within_one_token(local_backend: LocalBackend) -> None:
    stream = local_backend.stream(quote_request(max_tokens=200, topic="the long road home"))
    received = 0
    async for event in stream:
        if isinstance(event, Token):
            received += 1
            if received == 2:
                break
    await stream.aclose()
    await until_done(local_backend)
    job = local_backend.jobs[-1]
    assert job.stop_reason == "stopped"
    # Within one token of the stop request (the slot may have run ahead of the reader).
    assert job.generated_at_stop is not None and job.generated_at_stop >= received
    assert job.generated_tokens <= job.generated_at_stop + 1
    # llama.cpp itself let go of the slot: nothing is generating any more.
    for _ in range(100):
        if not any(slot["is_processing"] for slot in await local_backend.server_slots()):
            break
        await asyncio.sleep(0.01)
    assert not any(slot["is_processing"] for slot in await local_backend.server_slots())


# --- several at once ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def opened(
    backend: LocalBackend, request: GenerationRequest
) -> AsyncIterator[AsyncGenerator[Event, None]]:
    """A stream that has its slot and has written its first token."""
    stream = backend.stream(request)
    try:
        assert isinstance(await anext(stream), Token)
        yield stream
    finally:
        await stream.aclose()


@pytest.mark.integration
async def test_local_streams_share_the_model_in_parallel_slots(local_backend: LocalBackend) -> None:
    topics = ["rivers", "mountains", "bread", "lanterns"]
    assert local_backend.slots >= len(topics)

    results = await asyncio.gather(
        *(collect(local_backend, quote_request(topic=topic, max_tokens=12)) for topic in topics)
    )

    for events in results:
        assert isinstance(events[-1], Done)
        assert text_of(events)
    jobs = local_backend.jobs[-len(topics) :]
    # All four were writing at once: each started before any of them finished.
    assert max(j.started_at for j in jobs if j.started_at) < min(j.finished_at for j in jobs if j.finished_at)


@pytest.mark.integration
async def test_local_cancelling_one_stream_leaves_the_others_whole(local_backend: LocalBackend) -> None:
    async def leave_early() -> None:
        async with opened(local_backend, quote_request(topic="waves", max_tokens=200)):
            pass

    others = [collect(local_backend, quote_request(topic=topic, max_tokens=16)) for topic in ("dust", "salt")]
    results = await asyncio.gather(leave_early(), *others)

    for events in results[1:]:
        assert isinstance(events, list) and isinstance(events[-1], Done)
        assert 0 < next(e for e in events if isinstance(e, Usage)).completion_tokens <= 16
    stopped = [job for job in local_backend.jobs[-3:] if job.stop_reason == "stopped"]
    assert len(stopped) == 1


@pytest.mark.integration
async def test_local_waits_only_when_every_slot_is_taken(local_backend: LocalBackend) -> None:
    local_backend.queue_timeout_s = 0.2
    async with slots_held(local_backend, local_backend.slots - 1):
        # One slot is still free: the next request gets it at once.
        last = local_backend.stream_completion(LONG_COMPLETION)
        assert isinstance(await anext(last), Token)
        # Now all are taken: a request waits its queue timeout, then hears "busy".
        events = await collect(local_backend, quote_request())
        assert [(e.code, e.status) for e in events if isinstance(e, Error)] == [("busy", 503)]
        assert len(events) == 1
        # A slot that frees up is taken by the next request.
        await last.aclose()
        local_backend.queue_timeout_s = 20
        assert isinstance((await collect(local_backend, quote_request(max_tokens=4)))[-1], Done)


@pytest.mark.integration
async def test_local_too_many_waiting_is_busy_at_once(local_backend: LocalBackend) -> None:
    max_waiting = local_backend.max_waiting
    local_backend.max_waiting = 0
    try:
        events = await collect(local_backend, quote_request())
    finally:
        local_backend.max_waiting = max_waiting
    assert [(e.code, e.status) for e in events if isinstance(e, Error)] == [("busy", 503)]


# --- closed to others, and safe on any host ----------------------------------------------------


@pytest.mark.integration
async def test_local_model_listener_is_loopback_only_and_needs_its_key(local_backend: LocalBackend) -> None:
    await collect(local_backend, quote_request(max_tokens=2))  # loaded
    address = local_backend.listening_address
    assert address is not None and address.startswith("http://127.0.0.1:")
    body = {"prompt": "Hello", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=10) as client:
        anonymous = await client.post(f"{address}/v1/completions", json=body)
        guessed = await client.post(
            f"{address}/v1/completions", json=body, headers={"Authorization": "Bearer guessed"}
        )
    assert (anonymous.status_code, guessed.status_code) == (401, 401)


@pytest.mark.system
def test_local_model_writes_a_quote_in_a_fresh_process() -> None:
    """The crash this runtime replaced: a native llama.cpp build segfaulted in decode on some
    x86-64 hosts and took the whole server down. In a subprocess, a crash is a signal to report
    here, not the end of pytest. The run also checks that loading the model leaves the process's
    own SIGTERM handling alone (llama.cpp's server installs handlers in some builds)."""
    script = textwrap.dedent(
        """
        import asyncio, signal, django
        django.setup()
        from quotes.ai.backends import get_backend
        from quotes.ai.events import GenerationRequest, Token

        async def main():
            request = GenerationRequest(model="x", messages=(), speaker="Alan Watts", topic="rain",
                                        max_tokens=12, temperature=0.0)
            text = "".join([e.text async for e in get_backend("local").stream(request) if isinstance(e, Token)])
            print("QUOTE:", text, flush=True)

        asyncio.run(main())
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM handled by Python", flush=True))
        signal.raise_signal(signal.SIGTERM)
        """
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(ROOT)}
    env["LOCAL_MODEL_PATH"] = str(settings.LOCAL_MODEL.path)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode < 0:
        pytest.fail(
            f"the model process died of {signal.Signals(-done.returncode).name}:\n{done.stderr[-2000:]}"
        )
    assert done.returncode == 0, done.stderr[-2000:]
    quote = next(line for line in done.stdout.splitlines() if line.startswith("QUOTE:"))
    assert quote.removeprefix("QUOTE:").strip()
    assert "SIGTERM handled by Python" in done.stdout


@pytest.mark.integration
async def test_local_closing_the_backend_stops_its_generations() -> None:
    """A process that shuts down (or a test that resets backends) does not wait for every open
    quote to be written to its end."""
    backend = LocalBackend.from_settings(replace(settings.LOCAL_MODEL, slots=1))
    stream = backend.stream_completion(LONG_COMPLETION)
    assert isinstance(await anext(stream), Token)

    await backend.aclose()

    job = backend.jobs[-1]
    assert job.finished_at is not None
    assert job.stop_reason == "stopped"
    assert job.generated_tokens < LONG_COMPLETION["max_tokens"]
    assert not backend.loaded
    await stream.aclose()
