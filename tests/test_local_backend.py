"""The embedded model backend, on the real Gemma 3 270M model."""

from __future__ import annotations

import asyncio
import itertools

from quotes.ai.backends.local import LocalBackend, completion_prompt, text_decoder
from quotes.ai.events import Done, GenerationRequest, Token, Usage


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


def test_local_prompt_is_a_few_shot_frame_ending_on_an_open_quote() -> None:
    prompt = completion_prompt(quote_request(topic='the "sea"'))
    assert prompt.endswith("Lao Tzu, on the 'sea': \"")
    assert prompt.count("\n") >= 4  # a header and example lines before the open line


def test_local_decodes_characters_split_across_tokens(local_backend: LocalBackend) -> None:
    text = "Mañana 𝔘 ꙮ 𐍈 naïve"  # the middle three are byte-fallback tokens in Gemma's vocabulary
    llm = local_backend._load()
    tokens = llm.tokenize(text.encode(), add_bos=False)
    pieces = [llm.detokenize([token]) for token in tokens]
    # The vocabulary really does split some characters over several tokens ...
    assert any(_invalid_utf8(piece) for piece in pieces)
    # ... and decoding piece by piece, as the backend does, gives them back whole.
    decoder = text_decoder()
    assert "".join(decoder.decode(piece) for piece in pieces) + decoder.decode(b"", final=True) == text


def _invalid_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return True
    return False


async def test_local_stream_yields_tokens_usage_then_done(local_backend: LocalBackend) -> None:
    events = [event async for event in local_backend.stream(quote_request())]

    *tokens, usage, done = events
    assert isinstance(done, Done)
    assert isinstance(usage, Usage)
    assert tokens and all(isinstance(t, Token) and t.text for t in tokens)
    text = "".join(t.text for t in tokens)  # type: ignore[union-attr]
    assert '"' not in text and "\n" not in text  # the frame's closing quote is not part of the quote
    assert usage.completion_tokens == local_backend.jobs[-1].generated_tokens <= 24


async def test_local_stop_ends_generation_within_one_token(local_backend: LocalBackend) -> None:
    stream = local_backend.stream(quote_request(max_tokens=200))
    received = 0
    async for event in stream:
        if isinstance(event, Token):
            received += 1
            if received == 2:
                break
    await stream.aclose()
    job = local_backend.jobs[-1]
    for _ in range(100):
        if job.finished_at is not None:
            break
        await asyncio.sleep(0.02)
    assert job.stop_reason == "stopped"
    # Within one token of the stop request (the thread may have run ahead of the reader).
    assert job.generated_at_stop is not None and job.generated_at_stop >= received
    assert job.generated_tokens <= job.generated_at_stop + 1


async def test_local_generations_take_turns_and_all_complete(local_backend: LocalBackend) -> None:
    async def one(topic: str) -> list[object]:
        return [event async for event in local_backend.stream(quote_request(topic=topic, max_tokens=12))]

    results = await asyncio.gather(one("rivers"), one("mountains"), one("bread"))

    for events in results:
        assert isinstance(events[-1], Done)
    jobs = local_backend.jobs[-3:]
    # One at a time on the model thread: no two jobs overlap.
    spans = sorted((j.started_at, j.finished_at) for j in jobs)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end is not None and start is not None and end <= start


async def test_local_waiting_too_long_for_a_turn_answers_busy(local_backend: LocalBackend) -> None:
    first = local_backend.stream(quote_request(max_tokens=40))
    assert isinstance(await anext(first), Token)  # it has the model now
    local_backend.queue_timeout_s = 0.01

    events = [event async for event in local_backend.stream(quote_request())]

    assert [(e.code, e.status) for e in events] == [("busy", 503)]  # type: ignore[union-attr]
    await first.aclose()


def test_local_prompt_continues_a_conversation() -> None:
    from quotes.ai.events import Message

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
