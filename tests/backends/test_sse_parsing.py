"""parse_events on streams cut at random byte offsets, fed through a real httpx.Response."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotes.ai.backends.workers_ai import parse_events
from quotes.ai.errors import upstream_dropped, upstream_malformed, upstream_timeout
from quotes.ai.events import Done, Event, Token, Usage

pytestmark = pytest.mark.unit

SSE = {"content-type": "text/event-stream"}


class ChunkStream(httpx.AsyncByteStream):
    """The body as the network would hand it over: these chunks, then `fail` (if any)."""

    def __init__(self, chunks: Sequence[bytes], fail: Exception | None = None) -> None:
        self.chunks = chunks
        self.fail = fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.fail is not None:
            raise self.fail


async def parse_async(
    chunks: Sequence[bytes], headers: dict[str, str] = SSE, fail: Exception | None = None
) -> list[Event]:
    response = httpx.Response(200, headers=headers, stream=ChunkStream(chunks, fail))
    return [event async for event in parse_events(response)]


def parse(chunks: Sequence[bytes], **kwargs: Any) -> list[Event]:
    return asyncio.run(parse_async(chunks, **kwargs))


def cut(body: bytes, offsets: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted(set(offsets)), len(body)]
    return [body[start:end] for start, end in itertools.pairwise(bounds) if end > start]


# -- a random stream in the Workers AI wire format, with the events it must decode to ----------------

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
# Multi-byte characters, and characters str.splitlines() would wrongly treat as line breaks.
_TRICKY = st.sampled_from(
    ["é", "日", "本", "🎉", "\u200d", "\u2028", "\x85", "\x0b", "\x0c", "\x1c", "\r", "\n", " ", "\\", '"']
)
_TEXT = st.text(st.one_of(st.characters(exclude_categories=("Cs",)), _TRICKY), max_size=8)
_COMMENT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\r\n"), max_size=12)
_PADDING = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789"), max_size=40)


@st.composite
def wire_events(draw: st.DrawFn) -> tuple[str, list[Event]]:
    """One SSE block (or a comment) and what it decodes to."""
    eol = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    kind = draw(st.sampled_from(["token", "token", "token", "number", "openai", "usage", "comment"]))
    if kind == "comment":
        return f":{draw(_COMMENT)}{eol}", []
    expected: list[Event] = []
    payload: dict[str, Any]
    if kind == "token":
        text = draw(_TEXT)
        payload = {"response": text}
        expected += [Token(text)] if text else []
    elif kind == "number":
        number = draw(st.integers(min_value=-(10**12), max_value=10**12))
        payload = {"response": number}
        expected.append(Token(str(number)))
    elif kind == "openai":
        text = draw(_TEXT)
        payload = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        expected += [Token(text)] if text else []
    else:
        payload = {"response": ""}
    if kind == "usage" or (draw(st.booleans()) and draw(st.booleans())):
        prompt, completion = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        payload["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        expected.append(Usage(prompt, completion))
    if draw(st.booleans()):
        payload["p"] = draw(_PADDING)
    data = _dumps(payload)
    if draw(st.integers(0, 4)) == 0:
        # JSON allows a line break after the first key's colon: send it as two data lines.
        head, _, tail = data.partition(":")
        lines = [f"data: {head}:", f"data:{tail}"]
    else:
        lines = [f"data:{draw(st.sampled_from(['', ' ']))}{data}"]
    if draw(st.integers(0, 5)) == 0:
        lines.insert(0, f":{draw(_COMMENT)}")
    if draw(st.integers(0, 5)) == 0:
        lines.insert(0, f"id: {draw(st.integers(0, 99))}")
    return "".join(line + eol for line in lines) + eol, expected


@st.composite
def wire_streams(draw: st.DrawFn) -> tuple[bytes, list[Event]]:
    blocks = draw(st.lists(wire_events(), max_size=12))
    body = "".join(block for block, _ in blocks)
    expected = [event for _, events in blocks for event in events]
    if draw(st.booleans()) or draw(st.booleans()):
        eol = draw(st.sampled_from(["\n", "\r\n", "\r"]))
        body += f"data: [DONE]{eol}{eol}"
        expected.append(Done())
        if draw(st.booleans()):
            body += 'data: {"response":"after done"}\n\n'
    else:
        expected.append(upstream_dropped())
    raw = body.encode()
    if draw(st.integers(0, 4)) == 0:
        raw = b"\xef\xbb\xbf" + raw  # one leading BOM, which the rules drop
    return raw, expected


@settings(max_examples=200, deadline=None)
@given(stream=wire_streams(), data=st.data())
def test_parse_events_decodes_any_split_like_the_whole(stream, data):
    body, expected = stream
    offsets = data.draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=max(0, len(body) - 1)))

    whole = parse([body])
    split = parse(cut(body, offsets))

    assert whole == expected
    assert split == expected


@settings(max_examples=50, deadline=None)
@given(stream=wire_streams())
def test_parse_events_decodes_a_stream_fed_byte_by_byte(stream):
    body, expected = stream

    assert parse([body[i : i + 1] for i in range(len(body))]) == expected


# -- the rules one by one ---------------------------------------------------------------------------------


def test_parse_events_reads_the_documented_example():
    body = (
        b'data: {"response":"New","p":"abcdefgh"}\n\n'
        b'data: {"response":" York"}\n\n'
        b'data: {"usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52},"response":""}\n\n'
        b"data: [DONE]\n\n"
    )

    assert parse([body]) == [Token("New"), Token(" York"), Usage(12, 40), Done()]


def test_parse_events_keeps_a_character_cut_between_reads_whole():
    body = 'data: {"response":"日本🎉"}\n\ndata: [DONE]\n\n'.encode()
    start = body.index("日".encode())

    for offset in range(start + 1, start + 10):
        assert parse(cut(body, [offset])) == [Token("日本🎉"), Done()]


def test_parse_events_treats_a_lone_cr_before_lf_in_the_next_read_as_one_line_break():
    # "\r" | "\n" across reads is one CRLF, not two line breaks (which would end the event early).
    body = b'data: {"response":\r\ndata: "a"}\r\n\r\ndata: [DONE]\r\n\r\n'
    offsets = [i + 1 for i, byte in enumerate(body) if byte == 13]

    assert parse(cut(body, offsets)) == [Token("a"), Done()]


def test_parse_events_takes_usage_from_an_event_without_response():
    body = b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\ndata: [DONE]\n\n'

    assert parse([body]) == [Usage(1, 2), Done()]


def test_parse_events_ignores_usage_it_cannot_read():
    body = b'data: {"response":"a","usage":{"prompt_tokens":"many"}}\n\ndata: {"response":"b","usage":null}\n\ndata: [DONE]\n\n'

    assert parse([body]) == [Token("a"), Token("b"), Done()]


def test_parse_events_prefers_response_over_choices():
    body = b'data: {"response":"r","choices":[{"delta":{"content":"c"}}]}\n\ndata: [DONE]\n\n'

    assert parse([body]) == [Token("r"), Done()]


def test_parse_events_ignores_openai_chunks_without_content():
    body = (
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
        b'data: {"choices":[{"delta":{"content":null},"finish_reason":"stop"}]}\n\n'
        b'data: {"choices":[]}\n\n'
        b"data: [DONE]\n\n"
    )

    assert parse([body]) == [Done()]


def test_parse_events_stops_at_malformed_json():
    body = b'data: {"response":"a"}\n\ndata: {not json\n\ndata: {"response":"b"}\n\ndata: [DONE]\n\n'

    assert parse([body]) == [Token("a"), upstream_malformed()]


def test_parse_events_drops_an_event_cut_off_by_the_end_of_the_stream():
    body = b'data: {"response":"a"}\n\ndata: {"response":"b"}\n'

    assert parse([body]) == [Token("a"), upstream_dropped()]


def test_parse_events_rejects_a_body_that_is_not_an_event_stream():
    body = b'{"result":{"response":"hi"},"success":true}'

    assert parse([body], headers={"content-type": "application/json"}) == [upstream_malformed()]
    assert parse([body], headers={}) == [upstream_malformed()]


def test_parse_events_accepts_an_event_stream_content_type_with_parameters():
    body = b'data: {"response":"a"}\n\ndata: [DONE]\n\n'

    assert parse([body], headers={"content-type": "text/event-stream; charset=utf-8"}) == [Token("a"), Done()]


@pytest.mark.parametrize(
    ("failure", "error"),
    [
        (
            httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
            upstream_dropped(),
        ),
        (httpx.ReadError("connection reset by peer"), upstream_dropped()),
        (httpx.ReadTimeout("timed out"), upstream_timeout()),
    ],
)
def test_parse_events_reports_a_network_failure_mid_stream(failure, error):
    body = b'data: {"response":"a"}\n\ndata: {"resp'

    assert parse([body], fail=failure) == [Token("a"), error]
