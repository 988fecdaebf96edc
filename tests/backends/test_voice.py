"""Voice examples: the field and its versions, their way into every backend's request (the chat's
few-shot turns, the embedded model's frame), and the rule that a quote never copies one."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from streaming import Done, Event, Token, Usage

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.backends.base import Message, VoiceExample
from quotes.backends.local import FRAME_HEADER, LocalBackend, completion_prompt
from quotes.backends.voice import (
    COPY_RUN_WORDS,
    MAX_EXAMPLES,
    CopyGuard,
    guard_copies,
    longest_copied_run,
    parse_examples,
)
from quotes.models import Generation, Persona
from quotes.services import persona_rollback, persona_save
from tests.asgi import parse_sse, post_quote

EXAMPLES = """\
# Notes are left out: Collected Sayings (1901).
water: Nothing under heaven is softer than water, yet it wears away the hardest stone.
on the moon: "The moon does not hurry, and every night it arrives."
A line with no topic at all, and a comma.
"""


def sage(**overrides: Any) -> Persona:
    prompts = {"system_prompt": "You are the Sage", "user_prompt_template": "One line about {topic}"}
    fields = {"slug": "sage", "name": "The Sage", "description": "Keeper of short sayings.", **prompts}
    options = {"default_topic": "tea", "voice_examples": EXAMPLES, "max_tokens": 16, "temperature": 0.0}
    return Persona(**{**fields, **options, **overrides})


# --- the field -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_examples_parse_topics_notes_and_quote_marks() -> None:
    assert parse_examples(EXAMPLES) == (
        VoiceExample(
            "water", "Nothing under heaven is softer than water, yet it wears away the hardest stone."
        ),
        VoiceExample("the moon", "The moon does not hurry, and every night it arrives."),
        VoiceExample("", "A line with no topic at all, and a comma."),
    )
    assert parse_examples("") == ()
    # A colon after more than a few words, or after a sentence's punctuation, is part of the line.
    long_lead = "The one thing I would say to anyone at all: breathe."
    assert parse_examples(long_lead) == (VoiceExample("", long_lead),)
    assert parse_examples("Wait. Then: go.") == (VoiceExample("", "Wait. Then: go."),)


@pytest.mark.unit
def test_examples_beyond_the_frame_limits_are_refused_on_the_field() -> None:
    too_many = "\n".join(f"t{i}: line {i}" for i in range(MAX_EXAMPLES + 1))
    for text, message in [
        (too_many, f"At most {MAX_EXAMPLES} examples"),
        ("water: " + "drop " * 100, "Example 1 is longer than 400 characters"),
    ]:
        with pytest.raises(ValidationError) as caught:
            sage(voice_examples=text).full_clean(validate_unique=False)
        assert message in " ".join(caught.value.message_dict["voice_examples"])


@pytest.mark.integration
@pytest.mark.django_db
def test_seeded_personas_have_examples_naming_their_source_in_a_version_of_their_own() -> None:
    sources = {"marcus-aurelius": "George Long", "lao-tzu": "James Legge", "mark-twain": "Pudd'nhead Wilson"}
    sources |= {"ada-lovelace": "1843", "emily-dickinson": "Poems (1890)", "alan-watts": "original"}
    for slug, source in sources.items():
        persona = Persona.objects.get(slug=slug)
        notes = [line for line in persona.voice_examples.splitlines() if line.startswith("#")]
        assert source in " ".join(notes), slug
        examples = persona.examples()
        assert 6 <= len(examples) <= MAX_EXAMPLES and all(e.topic and e.text for e in examples)
        latest = persona.versions.order_by("-number").first()
        assert latest is not None and latest.config["voice_examples"] == persona.voice_examples
        assert (latest.number, latest.note) == (2, "voice examples (issue 23)")


@pytest.mark.integration
@pytest.mark.django_db
def test_examples_are_versioned_and_rolled_back_even_to_before_they_existed() -> None:
    persona = Persona.objects.get(slug="lao-tzu")
    seeded = persona.versions.get(number=2)
    persona.voice_examples = "rivers: The river does not argue with the stone.\n" + persona.voice_examples
    changed = persona_save(persona=persona, note="a river")
    assert changed is not None and changed.number == 3
    assert changed.config["voice_examples"] == persona.voice_examples

    rolled = persona_rollback(persona=persona, version=seeded, user=None)
    assert rolled is not None and rolled.config == seeded.config
    persona.refresh_from_db()
    assert persona.voice_examples == seeded.config["voice_examples"]

    first = persona.versions.get(number=1)
    assert "voice_examples" not in first.config  # recorded before the field existed
    rolled = persona_rollback(persona=persona, version=first, user=None)
    assert rolled is not None and rolled.config["voice_examples"] == ""
    persona.refresh_from_db()
    assert persona.examples() == ()


# --- what each backend is sent ---------------------------------------------------------------------


@pytest.mark.unit
def test_frame_shows_the_personas_own_examples_credited_to_it_on_their_topics() -> None:
    lines = completion_prompt(sage().build_request(topic='the "rain"')).splitlines()
    assert lines[0].startswith("Sayings of The Sage (Keeper of short sayings")
    assert lines[-4:] == [
        'The Sage, on water: "Nothing under heaven is softer than water, yet it wears away the hardest stone."',
        'The Sage, on the moon: "The moon does not hurry, and every night it arrives."',
        'The Sage: "A line with no topic at all, and a comma."',
        "The Sage, on the 'rain': \"",
    ]
    assert "Mary Oliver" not in "\n".join(lines) and "Collected Sayings" not in "\n".join(lines)
    request = sage().build_request(
        topic="rain", messages=(Message("assistant", "Rain falls."), Message("user", "And?"))
    )
    assert completion_prompt(request).endswith(
        'The Sage, on rain: "Rain falls."\nAsked "And?", The Sage replied: "'
    )
    no_examples = completion_prompt(sage(voice_examples="").build_request(topic="rain"))
    assert no_examples == FRAME_HEADER + 'The Sage (Keeper of short sayings), on rain: "Rain'


@pytest.mark.unit
def test_chat_request_carries_the_examples_as_earlier_answers() -> None:
    request = sage().build_request(topic="rain", messages=(Message("user", "More?"),))

    water, moon, untopical = parse_examples(EXAMPLES)
    assert request.messages == (
        Message("system", "You are the Sage"),
        *(Message("user", "One line about water"), Message("assistant", water.text)),
        *(Message("user", "One line about the moon"), Message("assistant", moon.text)),
        *(Message("user", "One line about anything at all"), Message("assistant", untopical.text)),
        Message("user", "One line about rain"),
        Message("user", "More?"),
    )
    assert request.conversation == (Message("user", "More?"),)


@pytest.mark.integration
async def test_workers_ai_gets_the_examples_as_few_shot_turns_and_a_copy_is_cut(
    fake: FakeWorkersAI, transactional_db: None
) -> None:
    """Through the stream endpoint: an answer that would repeat eight words of an example ends
    before the eighth."""
    persona = sage()
    await persona.asave()
    fake.script(
        Scenario(tokens=["The", " moon", " does", " not", " hurry,", " and", " every", " night", " it", "."])
    )

    response = await post_quote({"persona": "sage", "topic": "rain"})

    assert response.status == 200, response.body
    events = parse_sse(response.body)
    assert events[-1]["data"] == "[DONE]"
    text = "".join(json.loads(e["data"]).get("response", "") for e in events[:-1])
    assert text == "The moon does not hurry, and every"
    sent = fake.requests[-1].json["messages"]
    assert sent[1:3] == [
        {"role": "user", "content": "One line about water"},
        {"role": "assistant", "content": persona.examples()[0].text},
    ]
    assert sent[-1] == {"role": "user", "content": "One line about rain"}
    row = await Generation.objects.aget()
    assert (row.text, row.status) == (text, "ok")


# --- the copy rule -------------------------------------------------------------------------------

EXAMPLE = [VoiceExample("time", "Time is like a river made up of the events which happen.")]


def stream_through(guard: CopyGuard, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stop = guard.feed(piece)
        out.append(text)
        if stop:
            return "".join(out), True
    return "".join(out) + guard.finish(), False


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pieces", "expected", "stopped"),
    [
        # The eighth word in common is never sent, nor the space or comma before it.
        ("Time| is| like| a| riv|er| made| up|,| of| stones", "Time is like a river made up", True),
        # Seven in common, then a word of its own: all of it goes out.
        (
            "Time| is| like| a| riv|er| made| up|, and| flows|.",
            "Time is like a river made up, and flows.",
            False,
        ),
        # Case and punctuation do not hide a copy; it may start mid-quote.
        ("So: A| RIVER| made up| of the| events,| which| sings", "So: A RIVER made up of the events", True),
        # The last word counts once the stream ends.
        ("a river made up of the events which hap|pen", "a river made up of the events", True),
    ],
)
def test_copy_guard_ends_a_quote_before_its_eighth_copied_word(
    pieces: str, expected: str, stopped: bool
) -> None:
    text, stop = stream_through(CopyGuard(EXAMPLE), pieces.split("|"))

    assert (text, stop) == (expected, stopped)
    assert longest_copied_run(text, EXAMPLE) == COPY_RUN_WORDS - 1


_WORDS = [*EXAMPLE[0].text.rstrip(".").split(), "time", "don't", "n't", "riv", "er"]
_PIECE_TEXT = st.lists(
    st.sampled_from([*_WORDS, "7" * 40, " ", ", ", "'", "\u2019", "-", "."]), max_size=40
).map("".join)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(text=_PIECE_TEXT, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=20))
def test_copy_guard_says_the_same_however_the_stream_is_cut(text: str, cuts: list[int]) -> None:
    points = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)]

    assert stream_through(CopyGuard(EXAMPLE), pieces) == stream_through(CopyGuard(EXAMPLE), [text])
    assert longest_copied_run(stream_through(CopyGuard(EXAMPLE), pieces)[0], EXAMPLE) < COPY_RUN_WORDS


@pytest.mark.unit
async def test_guard_copies_closes_the_backend_stream_when_it_cuts() -> None:
    closed = []

    async def backend() -> AsyncGenerator[Event, None]:
        try:
            for word in ["Time", "is", "like", "a", "river", "made", "up", "of", "the", "events"]:
                yield Token(word + " ")
            yield Usage(prompt_tokens=1, completion_tokens=10)
            yield Done()
        finally:
            closed.append(True)

    async with aclosing(guard_copies(backend(), EXAMPLE)) as events:
        got = [event async for event in events]

    assert "".join(e.text for e in got if isinstance(e, Token)) == "Time is like a river made up"
    assert got[-1] == Done() and not any(isinstance(e, Usage) for e in got)
    assert closed == [True]


# --- the embedded model ---------------------------------------------------------------------------


@pytest.mark.integration
async def test_local_quote_ends_after_its_last_allowed_sentence(local_backend: LocalBackend) -> None:
    body = {
        "prompt": 'Short sentences, one after another: "I walk. You run. We stop. They sing. She',
        "max_tokens": 40,
        "stream": True,
        "temperature": 0.0,
        "stop": ['"', "\n"],
        "return_progress": True,  # as the app's body: the prompt's size is known before it ends
    }
    async with aclosing(local_backend.stream_completion(body, max_sentences=1)) as events:
        *got, usage, done = [event async for event in events]

    text = "".join(e.text for e in got if isinstance(e, Token))
    assert text.endswith(".") and text.count(".") == 1, text
    assert local_backend.jobs[-1].stop_reason == "sentences"
    assert isinstance(done, Done) and isinstance(usage, Usage) and usage.prompt_tokens > 10


SHADES = (("rivers", "long"), ("stones", "slow"), ("salt", "white"), ("moss", "green"))


@pytest.mark.integration
async def test_local_frames_are_reused_from_slots_and_from_the_prompt_cache(
    local_backend: LocalBackend,
) -> None:
    """A persona's frame is read once: a later request of the same persona reuses it, from its slot
    or, once more personas than slots have pushed it out, from the host-memory cache."""

    def frame(name: str) -> Persona:
        lines = [
            f"{t}: {name} says {t} is a {shade} thing, and every {t} comes back again." for t, shade in SHADES
        ]
        return sage(name=name, voice_examples="\n".join(lines))

    frames = {name: frame(name) for name in ("Ana", "Bo", "Cy", "Di", "Ed", "Flo")}

    async def cached(name: str, topic: str) -> int:
        request = replace(frames[name].build_request(topic=topic), max_tokens=2)
        async with aclosing(local_backend.stream(request)) as events:
            assert isinstance([e async for e in events][-1], Done)
        assert local_backend.jobs[-1].prompt_tokens > 100
        return local_backend.jobs[-1].cached_tokens

    await cached("Ana", "rain")
    assert await cached("Ana", "snow") > 100  # from its slot: all but the topic
    for name in ("Bo", "Cy", "Di", "Ed", "Flo"):  # more frames than the model has slots
        await cached(name, "rain")
    assert await cached("Ana", "hail") > 100  # from the prompt cache
