"""The embedded model backend: its completion frame, and the real Gemma 3 270M model run by
llama.cpp (the xllamacpp wheel), one quote and several at once, stopped, busy and closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import httpx
import pytest
from django.conf import settings
from streaming import Done, Error, Event, Meta, Token, Usage

from quotes.backends.base import GenerationRequest, Message
from quotes.backends.local import (
    LocalBackend,
    clean_ending,
    completion_body,
    completion_prompt,
    persona_sketch,
    quote_lead,
)
from tests.conftest import LONG_COMPLETION, slots_held


def quote_request(**overrides: object) -> GenerationRequest:
    fields = {"model": "x", "messages": (), "speaker": "Lao Tzu", "topic": "letting go", "max_tokens": 24}
    return GenerationRequest(**{**fields, "temperature": 0.0, **overrides})  # type: ignore[arg-type]


def persona_messages(system: str) -> tuple[Message, ...]:
    return (Message("system", system), Message("user", "Write 1 quote about {topic}"))


async def collect(stream: AsyncGenerator[Event, None]) -> list[Event]:
    async with contextlib.aclosing(stream) as events:
        return [event async for event in events]


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Token))


def busy_errors(events: list[Event]) -> list[tuple[str, int]]:
    return [(e.code, e.status) for e in events if isinstance(e, Error)]


# --- the frame ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_frame_is_a_few_shot_collection_ending_on_an_open_quote_credited_to_the_persona() -> None:
    prompt = completion_prompt(quote_request(topic='the "sea"'))
    assert prompt.endswith("Lao Tzu, on the 'sea': \"") and prompt.count("\n") >= 4

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
    assert persona_sketch(quote_request(messages=persona_messages("You are Lao Tzu"))) == ""


@pytest.mark.unit
def test_frame_continues_a_conversation_without_a_lead_and_a_lead_is_a_short_plain_topic() -> None:
    turns = (
        Message("assistant", 'Open the hand and the "river" flows.'),
        Message("user", "What about\nholding on?"),
    )
    request = quote_request(topic="rain", messages=(*persona_messages("You are Lao Tzu"), *turns))

    assert request.conversation and quote_lead(request) == ""
    assert completion_prompt(request).endswith(
        "Lao Tzu, on rain: \"Open the hand and the 'river' flows.\"\n"
        'Asked "What about holding on?", Lao Tzu replied: "'
    )
    assert quote_lead(quote_request(topic="the obstacle in the way")) == "The obstacle in the way"
    assert quote_lead(quote_request(topic="don't panic")) == "Don't panic"
    # Not plain words, or more than five (a question, not a subject): no lead.
    assert quote_lead(quote_request(topic="the year 1999")) == quote_lead(quote_request(topic="")) == ""
    assert quote_lead(quote_request(topic="how to stay calm at work")) == ""


@pytest.mark.unit
def test_body_reads_the_whole_frame_for_a_fixed_seed_and_a_quote_ends_cleanly() -> None:
    """Reusing a slot's cached frame changes the logits' last bits: fine for a sampled quote, but a
    persona with a seed asks for the same quote every time."""
    assert completion_body(quote_request(seed=7))["cache_prompt"] is False
    assert completion_body(quote_request())["cache_prompt"] is True
    assert completion_body(quote_request())["stop"] == ['"', "\u201d", "\n"]
    assert (
        clean_ending("It ends.", cut_short=False)
        == clean_ending("It ends (as it began.)", cut_short=False)
        == ""
    )
    assert (clean_ending("It stops", cut_short=False), clean_ending("It was cut", cut_short=True)) == (
        ".",
        "\u2026",
    )


@pytest.mark.unit
async def test_a_closed_backend_answers_busy_and_keeps_no_job() -> None:
    """A request after the backend closed (a process going away) gets an error, and leaves no
    waiting count or live job behind."""
    backend = LocalBackend(path=settings.LOCAL_MODEL_PATH)
    await backend.aclose()

    events = await collect(backend.stream(quote_request()))

    assert events[0] == Meta(model="gemma-3-270m") and busy_errors(events[1:]) == [("busy", 503)]
    assert (backend.waiting, backend.jobs) == (0, [])


# --- one quote on the real model -------------------------------------------------------------------


@pytest.mark.integration
async def test_a_quote_is_meta_tokens_usage_then_done_and_opens_on_its_topic(
    local_backend: LocalBackend,
) -> None:
    """A short topic's words open the quote: the frame ends on them, and they reach the stream
    joined to the model's first piece (never ahead of it: the first token is the model's)."""
    request = quote_request(topic="old friends", max_tokens=12)
    assert completion_prompt(request).endswith(', on old friends: "Old friends')

    meta, *tokens, usage, done = await collect(local_backend.stream(request))

    assert (meta, done) == (Meta(model="gemma-3-270m"), Done())
    assert tokens and all(isinstance(t, Token) and t.text for t in tokens)
    text = text_of(tokens)
    assert tokens[0].text.startswith("Old friends") and len(tokens[0].text) > len("Old friends"), tokens  # type: ignore[union-attr]
    assert text.count("Old friends") == 1
    assert '"' not in text and "\n" not in text  # the frame's closing quote is not the quote's
    assert (
        isinstance(usage, Usage)
        and 0 < usage.completion_tokens == local_backend.jobs[-1].generated_tokens <= 12
    )
    assert usage.prompt_tokens > 50  # the whole frame was read


@pytest.mark.integration
async def test_a_quote_ends_cleanly_never_on_a_comma_nor_on_its_lead_alone(
    local_backend: LocalBackend,
) -> None:
    """A comma (or semicolon, or dash) waits for the text after it; a quote that stops there ends on
    a full stop, and one the token budget cuts short on an ellipsis. A model that closes the quote
    right after its lead (the topic, nothing said of it) is asked once more without it."""
    greedy = {"stream": True, "temperature": 0.0}
    # The model writes ", six, seven, eight": it stops on a comma.
    counting = {
        **greedy,
        "prompt": 'Counting: "one, two, three, four, five',
        "max_tokens": 20,
        "stop": [" eight", '"'],
    }
    assert text_of(await collect(local_backend.stream_completion(counting))) == ", six, seven."

    cut = {**greedy, "prompt": 'A long sentence: "The', "max_tokens": 3}
    text = text_of(await collect(local_backend.stream_completion(cut)))
    assert local_backend.jobs[-1].stop_reason == "max_tokens"
    assert text.endswith("\u2026") and text.count("\u2026") == 1 and "," not in text[-2:]

    # Greedy, the model closes "fig" at once: asked again, it writes a quote, not the lead alone.
    fig = {**greedy, "prompt": 'Words: "apple" "pear" "plum" "fig', "max_tokens": 8, "stop": ['"', "\n"]}
    assert text_of(await collect(local_backend.stream_completion(fig))) == ""
    got = await collect(local_backend.stream_completion(fig, lead="fig"))
    assert isinstance(got[-1], Done)
    assert text_of(got).strip(" .") and not text_of(got).startswith("fig"), got


@pytest.mark.integration
async def test_characters_split_across_tokens_arrive_whole(local_backend: LocalBackend) -> None:
    """U+1D518, U+A66E and U+10348 take several byte-fallback tokens each in Gemma's vocabulary; a
    conversation repeating them makes the greedy model write them, and every piece is whole text."""
    line = "Mañana 𝔘 ꙮ 𐍈 naïve 𝔘 ꙮ 𐍈"
    messages = persona_messages("You are Lao Tzu")
    for _ in range(3):
        messages += (Message("assistant", line), Message("user", "Again?"))

    events = await collect(local_backend.stream(quote_request(messages=messages, seed=1)))

    pieces = [e.text for e in events if isinstance(e, Token)]
    usage = next(e for e in events if isinstance(e, Usage))
    assert "\ufffd" not in "".join(pieces) and {"𝔘", "ꙮ", "𐍈"} <= set("".join(pieces))
    assert usage.completion_tokens > len(pieces)  # split characters were joined, not dropped


@pytest.mark.integration
async def test_a_stop_ends_the_generation_within_one_token_and_frees_the_slot(
    local_backend: LocalBackend,
) -> None:
    received, stream = 0, local_backend.stream(quote_request(max_tokens=200, topic="the long road home"))
    async with contextlib.aclosing(stream) as events:
        async for event in events:
            received += isinstance(event, Token)
            if received == 2:
                break
    for _ in range(500):  # the job is stamped on its worker thread as it returns
        if local_backend.jobs[-1].finished_at is None:
            await asyncio.sleep(0.01)

    job = local_backend.jobs[-1]
    assert job.stop_reason == "stopped"
    # Within one token of the stop request (the slot may have run ahead of the reader).
    assert job.generated_at_stop is not None and job.generated_at_stop >= received
    assert job.generated_tokens <= job.generated_at_stop + 1
    assert job.stop_requested_at is not None and job.finished_at is not None
    assert job.finished_at - job.stop_requested_at < 1.0
    for _ in range(100):  # llama.cpp itself let go of the slot
        if not any(slot["is_processing"] for slot in await local_backend.server_slots()):
            break
        await asyncio.sleep(0.01)
    assert not any(slot["is_processing"] for slot in await local_backend.server_slots())


# --- several at once ---------------------------------------------------------------------------


@pytest.mark.integration
async def test_several_visitors_share_the_model_at_once_and_one_leaving_spares_the_others(
    local_backend: LocalBackend,
) -> None:
    assert local_backend.slots >= 4

    async def leave_after_the_first_token() -> None:
        async with contextlib.aclosing(
            local_backend.stream(quote_request(topic="waves", max_tokens=200))
        ) as stream:
            while not isinstance(await anext(stream), Token):
                pass

    topics = ["rivers", "mountains", "bread"]
    results = await asyncio.gather(
        leave_after_the_first_token(),
        *(collect(local_backend.stream(quote_request(topic=topic, max_tokens=12))) for topic in topics),
    )

    for events in results[1:]:
        assert isinstance(events, list) and isinstance(events[-1], Done) and text_of(events)
        assert 0 < next(e for e in events if isinstance(e, Usage)).completion_tokens <= 12
    jobs = local_backend.jobs[-4:]
    assert [job.stop_reason for job in jobs].count("stopped") == 1
    # All four were writing at once: each started before any of them finished.
    assert max(j.started_at for j in jobs if j.started_at) < min(j.finished_at for j in jobs if j.finished_at)


@pytest.mark.integration
async def test_a_request_waits_only_when_every_slot_is_taken_then_hears_busy(
    local_backend: LocalBackend,
) -> None:
    local_backend.queue_timeout_s = 0.2
    async with slots_held(local_backend, local_backend.slots - 1):
        # One slot is still free: the next request gets it at once.
        last = local_backend.stream_completion(LONG_COMPLETION)
        assert isinstance(await anext(last), Token)
        # Now all are taken: a request waits its queue timeout, then hears "busy".
        events = await collect(local_backend.stream(quote_request()))
        assert len(events) == 2 and busy_errors(events) == [("busy", 503)]
        # A slot that frees up is taken by the next request.
        await last.aclose()
        local_backend.queue_timeout_s = 20
        assert isinstance((await collect(local_backend.stream(quote_request(max_tokens=4))))[-1], Done)

    local_backend.max_waiting, max_waiting = 0, local_backend.max_waiting
    try:  # too many waiting already: busy at once
        assert busy_errors(await collect(local_backend.stream(quote_request()))) == [("busy", 503)]
    finally:
        local_backend.max_waiting = max_waiting


@pytest.mark.integration
async def test_closing_the_backend_stops_its_generations() -> None:
    """A process that shuts down (or a test that resets backends) does not wait for every open quote
    to be written to its end."""
    backend = LocalBackend(path=settings.LOCAL_MODEL_PATH, slots=1)
    stream = backend.stream_completion(LONG_COMPLETION)
    assert isinstance(await anext(stream), Token)

    await backend.aclose()

    job = backend.jobs[-1]
    assert job.finished_at is not None and job.stop_reason == "stopped"
    assert job.generated_tokens < LONG_COMPLETION["max_tokens"]
    assert not backend.loaded
    await stream.aclose()


# --- closed to others, and safe on any host ----------------------------------------------------


@pytest.mark.integration
async def test_the_models_listener_is_loopback_only_and_needs_its_key(local_backend: LocalBackend) -> None:
    await collect(local_backend.stream(quote_request(max_tokens=2)))  # loaded
    address = local_backend.listening_address
    assert address is not None and address.startswith("http://127.0.0.1:")
    body = {"prompt": "Hello", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=10) as client:
        anonymous = await client.post(f"{address}/v1/completions", json=body)
        guessed = await client.post(
            f"{address}/v1/completions", json=body, headers={"Authorization": "Bearer guessed"}
        )
    assert (anonymous.status_code, guessed.status_code) == (401, 401)
