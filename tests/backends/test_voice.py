"""Voice examples (issue 23): the field, its versions, its way into every backend's request, the
embedded model's frame, the rule that a quote never copies an example, and the voice benchmark."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.test import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.backends.local import FRAME_HEADER, LocalBackend, completion_prompt
from quotes.ai.events import Done, Event, Message, Token, Usage, VoiceExample
from quotes.ai.voice import (
    COPY_RUN_WORDS,
    MAX_EXAMPLES,
    CopyGuard,
    guard_copies,
    longest_copied_run,
    parse_examples,
)
from quotes.models import Generation, Persona
from quotes.selectors import version_history
from quotes.services import persona_rollback, persona_save
from tests.admin.test_admin import form_data, preview_body, staff_headers
from tests.asgi import parse_sse, request

__all__ = ["staff_headers"]  # a fixture of test_admin's, used here too

ROOT = Path(__file__).resolve().parents[2]
SEEDED = {"alan-watts", "marcus-aurelius", "ada-lovelace", "mark-twain", "emily-dickinson", "lao-tzu"}

EXAMPLES = """\
# Notes are left out: Collected Sayings (1901).
water: Nothing under heaven is softer than water, yet it wears away the hardest stone.
on the moon: "The moon does not hurry, and every night it arrives."
A line with no topic at all, and a comma.
"""


def persona_with_examples(**overrides: Any) -> Persona:
    fields: dict[str, Any] = {
        "slug": "sage",
        "name": "The Sage",
        "description": "Keeper of short sayings.",
        "system_prompt": "You are the Sage",
        "user_prompt_template": "One line about {topic}",
        "default_topic": "tea",
        "voice_examples": EXAMPLES,
        "max_tokens": 16,
        "temperature": 0.0,
    }
    fields.update(overrides)
    return Persona(**fields)


# --- the field -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_voice_examples_parse_topics_notes_and_quote_marks() -> None:
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
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("\n".join(f"t{i}: line {i}" for i in range(MAX_EXAMPLES + 1)), f"At most {MAX_EXAMPLES} examples"),
        ("water: " + "drop " * 100, "Example 1 is longer than 400 characters"),
    ],
)
def test_voice_examples_beyond_the_frame_limits_are_refused_on_the_field(text: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        persona_with_examples(voice_examples=text).full_clean(validate_unique=False)
    assert message in " ".join(caught.value.message_dict["voice_examples"])


@pytest.mark.integration
@pytest.mark.django_db
def test_seeded_personas_have_examples_naming_their_source_and_a_version_recording_them() -> None:
    sources = {
        "marcus-aurelius": "George Long",
        "lao-tzu": "James Legge",
        "mark-twain": "Pudd'nhead Wilson",
        "ada-lovelace": "1843",
        "emily-dickinson": "Poems (1890)",
        "alan-watts": "original",
    }
    for slug, source in sources.items():
        persona = Persona.objects.get(slug=slug)
        notes = [line for line in persona.voice_examples.splitlines() if line.startswith("#")]
        assert source in " ".join(notes), slug
        examples = persona.examples()
        assert 6 <= len(examples) <= MAX_EXAMPLES and all(e.topic and e.text for e in examples)
        latest = persona.versions.order_by("-number").first()
        assert latest is not None and latest.config["voice_examples"] == persona.voice_examples
        assert latest.number == 2 and latest.note == "voice examples (issue 23)"


@pytest.mark.integration
@pytest.mark.django_db
def test_voice_examples_are_versioned_diffed_and_rolled_back() -> None:
    persona = Persona.objects.get(slug="lao-tzu")
    seeded = persona.versions.order_by("-number").first()
    assert seeded is not None
    persona.voice_examples = "rivers: The river does not argue with the stone.\n" + persona.voice_examples
    changed = persona_save(persona=persona, note="a river")
    assert changed is not None and changed.number == seeded.number + 1

    newest = version_history(persona)[0]
    lines = {(d.name, line.kind, line.text) for d in newest.diffs for line in d.lines}
    assert ("voice_examples", "add", "rivers: The river does not argue with the stone.") in lines
    assert all(d.name == "voice_examples" for d in newest.diffs)

    rolled = persona_rollback(persona=persona, version=seeded, user=None)
    assert rolled is not None and rolled.config == seeded.config
    persona.refresh_from_db()
    assert persona.voice_examples == seeded.config["voice_examples"]
    assert persona.examples()[-1].topic == "knowing oneself"


@pytest.mark.integration
@pytest.mark.django_db
def test_admin_edits_voice_examples_as_a_new_version_and_crlf_is_no_change(admin_client: Client) -> None:
    persona = Persona.objects.get(slug="emily-dickinson")
    url = f"/admin/quotes/persona/{persona.pk}/change/"
    assert 'name="voice_examples"' in admin_client.get(url).content.decode()
    before = persona.versions.count()

    # A browser posts the textarea with CRLF line ends: the same examples, no new version.
    same = persona.voice_examples.replace("\n", "\r\n")
    assert admin_client.post(url, form_data(persona, voice_examples=same)).status_code == 302
    assert persona.versions.count() == before

    added = persona.voice_examples + "\r\nbees: To make a prairie it takes a clover and one bee."
    assert admin_client.post(url, form_data(persona, voice_examples=added)).status_code == 302
    assert persona.versions.count() == before + 1
    persona.refresh_from_db()
    assert persona.examples()[-1] == VoiceExample("bees", "To make a prairie it takes a clover and one bee.")
    page = admin_client.get(f"/admin/quotes/persona/{persona.pk}/history-versions/").content.decode()
    assert "bees: To make a prairie it takes a clover and one bee." in page

    too_many = "\n".join(f"t{i}: line {i}" for i in range(MAX_EXAMPLES + 1))
    response = admin_client.post(url, form_data(persona, voice_examples=too_many))
    assert response.status_code == 200 and f"At most {MAX_EXAMPLES} examples" in response.content.decode()


@pytest.mark.integration
async def test_preview_shows_the_model_the_unsaved_examples(
    persona: Persona, staff_headers: dict[str, str]
) -> None:
    """The live preview runs the form's examples, unsaved: greedy and seeded, other examples
    give another quote, and the preview row's request carries them."""
    url = f"/admin/quotes/persona/{persona.pk}/preview/"

    async def preview_text(examples: str) -> str:
        body = preview_body(persona, max_tokens=16, temperature=0, seed=5, voice_examples=examples)
        response = await request("POST", url, json_body=body, headers=staff_headers)
        assert response.status == 200, response.body
        events = parse_sse(response.body)
        assert events[-1]["data"] == "[DONE]"
        return "".join(json.loads(e["data"]).get("response", "") for e in events[:-1])

    sailor = "storms: The sea keeps its own counsel, and the gale keeps none.\nships: A hull is a promise."
    baker = "bread: Flour remembers the field.\novens: An oven is patient heat."
    assert await preview_text(sailor) == await preview_text(sailor)
    assert await preview_text(baker) != await preview_text(sailor)
    rows = [row async for row in Generation.objects.filter(is_preview=True).order_by("id")]
    assert [row.request["examples"][0]["topic"] for row in rows] == ["storms", "storms", "bread", "storms"]
    assert (await Persona.objects.aget(pk=persona.pk)).voice_examples == ""


@pytest.mark.integration
@pytest.mark.django_db
def test_rollback_to_a_version_from_before_voice_examples_leaves_none() -> None:
    persona = Persona.objects.get(slug="mark-twain")
    first = persona.versions.get(number=1)
    assert "voice_examples" not in first.config  # recorded before the field existed
    rolled = persona_rollback(persona=persona, version=first, user=None)
    assert rolled is not None and rolled.config["voice_examples"] == ""
    persona.refresh_from_db()
    assert persona.voice_examples == "" and persona.examples() == ()
    assert {k: v for k, v in rolled.config.items() if k in first.config} == first.config


@pytest.mark.integration
@pytest.mark.django_db
def test_voice_examples_survive_an_export_and_import(tmp_path: Path) -> None:
    path = tmp_path / "personas.json"
    call_command("export_personas", output=str(path), stdout=StringIO())
    exported = {p["slug"]: p for p in json.loads(path.read_text())}
    twain = Persona.objects.get(slug="mark-twain")
    assert exported["mark-twain"]["voice_examples"] == twain.voice_examples

    twain.voice_examples = "weather: Everybody talks about it."
    persona_save(persona=twain)
    out = StringIO()
    call_command("import_personas", str(path), stdout=out, stderr=StringIO())
    assert "1 updated" in out.getvalue()
    twain.refresh_from_db()
    assert twain.voice_examples == exported["mark-twain"]["voice_examples"]
    latest = twain.versions.order_by("-number").first()
    assert latest is not None and latest.config["voice_examples"] == twain.voice_examples


# --- what each backend is sent ---------------------------------------------------------------------


@pytest.mark.unit
def test_frame_shows_the_personas_own_examples_credited_to_it_on_their_topics() -> None:
    persona = persona_with_examples()
    prompt = completion_prompt(persona.build_request(topic='the "rain"'))
    lines = prompt.splitlines()
    assert lines[0].startswith("Sayings of The Sage (Keeper of short sayings")
    assert lines[-4:] == [
        'The Sage, on water: "Nothing under heaven is softer than water, yet it wears away the hardest stone."',
        'The Sage, on the moon: "The moon does not hurry, and every night it arrives."',
        'The Sage: "A line with no topic at all, and a comma."',
        "The Sage, on the 'rain': \"",
    ]
    assert "Mary Oliver" not in prompt and "Collected Sayings" not in prompt


@pytest.mark.unit
def test_frame_without_examples_is_the_shared_one() -> None:
    prompt = completion_prompt(persona_with_examples(voice_examples="").build_request(topic="rain"))
    assert prompt == FRAME_HEADER + 'The Sage (Keeper of short sayings), on rain: "Rain'


@pytest.mark.unit
def test_frame_continues_a_conversation_after_the_examples() -> None:
    persona = persona_with_examples()
    request = persona.build_request(
        topic="rain", messages=(Message("assistant", "Rain falls."), Message("user", "And then?"))
    )
    assert request.conversation == (Message("assistant", "Rain falls."), Message("user", "And then?"))
    assert completion_prompt(request).endswith(
        'The Sage, on rain: "Rain falls."\nAsked "And then?", The Sage replied: "'
    )


@pytest.mark.unit
def test_chat_request_carries_the_examples_as_earlier_answers() -> None:
    request = persona_with_examples().build_request(topic="rain", messages=(Message("user", "More?"),))
    assert request.messages == (
        Message("system", "You are the Sage"),
        Message("user", "One line about water"),
        Message(
            "assistant", "Nothing under heaven is softer than water, yet it wears away the hardest stone."
        ),
        Message("user", "One line about the moon"),
        Message("assistant", "The moon does not hurry, and every night it arrives."),
        Message("user", "One line about anything at all"),
        Message("assistant", "A line with no topic at all, and a comma."),
        Message("user", "One line about rain"),
        Message("user", "More?"),
    )


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    """The workers-ai backend against the fake; its httpx client is closed on the test's loop."""
    yield fake_workers_ai
    await reset_backends()


@pytest.mark.integration
async def test_workers_ai_gets_the_examples_as_few_shot_turns_and_copies_are_cut(
    fake: FakeWorkersAI, transactional_db: None
) -> None:
    """Through the stream endpoint to the fake upstream: the chat carries the examples, and an
    answer that would repeat eight words of one ends before the eighth."""
    persona = persona_with_examples()
    await persona.asave()
    copied = ["The", " moon", " does", " not", " hurry,", " and", " every", " night", " it", " arrives", "."]
    fake.script(Scenario(tokens=copied))

    response = await request("POST", "/api/quotes/stream", json_body={"persona": "sage", "topic": "rain"})

    assert response.status == 200, response.body
    events = parse_sse(response.body)
    assert events[-1]["data"] == "[DONE]"
    text = "".join(json.loads(e["data"]).get("response", "") for e in events[:-1])
    assert text == "The moon does not hurry, and every"
    assert longest_copied_run(text, persona.examples()) == COPY_RUN_WORDS - 1
    sent = fake.requests[-1].json["messages"]
    assert sent[1:3] == [
        {"role": "user", "content": "One line about water"},
        {"role": "assistant", "content": persona.examples()[0].text},
    ]
    assert sent[-1] == {"role": "user", "content": "One line about rain"}
    row = await Generation.objects.aget()
    assert row.text == text and row.status == "ok"


# --- the copy rule -------------------------------------------------------------------------------


def stream_through(guard: CopyGuard, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stop = guard.feed(piece)
        out.append(text)
        if stop:
            return "".join(out), True
    return "".join(out) + guard.finish(), False


EXAMPLE = [VoiceExample("time", "Time is like a river made up of the events which happen.")]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pieces", "expected", "stopped"),
    [
        # The eighth word in common is never sent, nor the space or comma before it.
        (
            ["Time", " is", " like", " a", " riv", "er", " made", " up", ",", " of", " stones"],
            "Time is like a river made up",
            True,
        ),
        # Seven in common, then a word of its own: all of it goes out.
        (
            ["Time", " is", " like", " a", " riv", "er", " made", " up", ", and", " flows", "."],
            "Time is like a river made up, and flows.",
            False,
        ),
        # Case and punctuation do not hide a copy; it may start mid-quote.
        (
            ["So: A", " RIVER", " made up", " of the", " events,", " which", " sings"],
            "So: A RIVER made up of the events",
            True,
        ),
        # The last word counts once the stream ends.
        (["a river made up of the events which hap", "pen"], "a river made up of the events", True),
        (["Nothing", " like", " it."], "Nothing like it.", False),
    ],
)
def test_copy_guard_ends_a_quote_before_its_eighth_copied_word(
    pieces: list[str], expected: str, stopped: bool
) -> None:
    text, stop = stream_through(CopyGuard(EXAMPLE), pieces)
    assert (text, stop) == (expected, stopped)
    assert longest_copied_run(text, EXAMPLE) < COPY_RUN_WORDS


_PIECE_TEXT = st.lists(
    st.sampled_from(
        [
            *("time", "Time", "is", "like", "a", "river", "made", "up", "of", "the", "events"),
            *("which", "happen", "don't", "n't", "7" * 40, "riv", "er", " ", ", ", "'", "\u2019", "-", "."),
        ]
    ),
    max_size=40,
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
@pytest.mark.parametrize("piece", ["1732456789012345678", " word", "-"])
def test_copy_guard_keeps_little_of_a_long_stream(piece: str) -> None:
    # A model that writes one endless word (digits, no space) or many words: each piece costs
    # its own length, because the guard keeps only what it has not yet sent or counted.
    guard = CopyGuard(EXAMPLE)
    sent = [guard.feed(piece)[0] for _ in range(2000)]
    assert "".join(sent) + guard.finish() == piece * 2000
    assert len(guard._text) <= 2 * len(piece)


@pytest.mark.integration
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
        got = [event async for event in events]
    text = "".join(e.text for e in got if isinstance(e, Token))
    assert text.endswith(".") and text.count(".") == 1, text
    assert local_backend.jobs[-1].stop_reason == "sentences"
    *_, usage, done = got
    assert isinstance(done, Done) and isinstance(usage, Usage) and usage.prompt_tokens > 10


@pytest.mark.integration
async def test_local_frames_are_reused_from_slots_and_from_the_prompt_cache(
    local_backend: LocalBackend,
) -> None:
    """A persona's frame is read once: a later request of the same persona reuses it, from its
    slot or, once more personas than slots have pushed it out, from the host-memory cache."""
    frames = {
        name: persona_with_examples(
            name=name,
            voice_examples="\n".join(
                f"{topic}: {name} says {topic} is a {shade} thing, and every {topic} comes back again."
                for topic, shade in (
                    ("rivers", "long"),
                    ("stones", "slow"),
                    ("salt", "white"),
                    ("moss", "green"),
                )
            ),
        )
        for name in ("Ana", "Bo", "Cy", "Di", "Ed", "Flo")
    }

    async def cached(name: str, topic: str) -> int:
        request = frames[name].build_request(topic=topic)
        async with aclosing(local_backend.stream(replace(request, max_tokens=2))) as events:
            assert isinstance([e async for e in events][-1], Done)
        stats = local_backend.jobs[-1]
        assert stats.prompt_tokens > 100
        return stats.cached_tokens

    await cached("Ana", "rain")
    assert await cached("Ana", "snow") > 100  # from its slot: all but the topic
    for name in ("Bo", "Cy", "Di", "Ed", "Flo"):  # more frames than the model has slots
        await cached(name, "rain")
    assert await cached("Ana", "hail") > 100  # from the prompt cache


# --- the benchmark ---------------------------------------------------------------------------------


@pytest.mark.system
def test_voice_bench_tiny_run_prints_sane_figures_and_a_blind_sheet(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.voice",
            "--per-persona",
            "1",
            "--topics",
            "rain",
            "--max-tokens",
            "8",
            "--timing",
            "1",
            "--quiet",
            "--json",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["quotes"] == 6 and summary["errors"] == 0 and summary["personas"] == 6
    for name in ("on_topic", "ends_cleanly", "lexical_attribution", "distinct_2_across_personas"):
        assert 0 <= summary[name] <= 1, name
    assert 0 < summary["mean_words"] <= 8 + 1  # the budget, and the lead ("Rain"), read from the frame
    assert summary["longest_copied_run"] < COPY_RUN_WORDS
    assert summary["chance"] == pytest.approx(1 / 6)
    assert summary["frame_tokens_p50"] > 100 and summary["ttft_warm_ms_p50"] > 0
    sheet = (tmp_path / "sheet.md").read_text()
    key = json.loads((tmp_path / "key.json").read_text())
    numbered = [line for line in sheet.splitlines() if line[:1].isdigit()]
    assert len(numbered) == 6 and sorted(key) == [str(n) for n in range(1, 7)]
    assert set(key.values()) == SEEDED  # one quote each, and who wrote which only in the key
    assert all(f"{n}. *rain*: " in sheet for n in range(1, 7))
    assert len((tmp_path / "quotes.jsonl").read_text().splitlines()) == 6

    # A blind coherence sheet of two runs (this one, and a copy of it under another name),
    # and readers' verdicts scored back per run.
    other = tmp_path / "other"
    other.mkdir()
    (other / "quotes.jsonl").write_text((tmp_path / "quotes.jsonl").read_text())
    out = tmp_path / "coherence"
    bench = [sys.executable, "-m", "bench.voice"]
    made = subprocess.run(
        [*bench, "--coherence-sheet", str(out), str(tmp_path), str(other)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    coherence_sheet = (out / "coherence-sheet.md").read_text()
    coherence_key = json.loads((out / "coherence-key.json").read_text())
    assert "coherent and on topic" in coherence_sheet and "persona" not in coherence_sheet.lower()
    assert len([line for line in coherence_sheet.splitlines() if line[:1].isdigit()]) == 12
    first = {tmp_path.name: "y", "other": "n"}
    (out / "r1.txt").write_text("".join(f"{n} {first[row['run']]}\n" for n, row in coherence_key.items()))
    (out / "r2.txt").write_text("".join(f"{n} {'y' if int(n) % 2 else 'n'}\n" for n in coherence_key))
    scored = subprocess.run(
        [*bench, "--coherence-score", str(out), str(out / "r1.txt"), str(out / "r2.txt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scored.returncode == 0, scored.stderr
    rows = {line.split("|")[1].strip(): line for line in scored.stdout.splitlines() if line.startswith("| ")}
    assert "| 6 of 6 (100%)" in rows[tmp_path.name] and "| 0 of 6 (0%)" in rows["other"]
    agree = sum(first[row["run"]] == ("y" if int(n) % 2 else "n") for n, row in coherence_key.items())
    assert f"readers agree on {agree} of 12 ({agree / 12:.0%})" in scored.stdout
