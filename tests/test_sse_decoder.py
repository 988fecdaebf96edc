"""quotes.ai.sse.SSEDecoder, the hand-written incremental decoder on the upstream read path, held
to a plain reading of the WHATWG event-stream rules (`reference` below: the whole body decoded at
once, then split into lines) on random streams cut at random byte offsets."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from quotes.ai.sse import ServerSentEvent, SSEDecoder


def reference(body: bytes) -> list[ServerSentEvent]:
    """https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation,
    step by step, on the whole body."""
    text = body.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    *lines, _unfinished = re.split("\r\n|\r|\n", text)
    events: list[ServerSentEvent] = []
    data, event_type, last_id, retry = "", "", "", None
    for line in lines:
        if line == "":
            if data == "":
                event_type = ""
                continue
            events.append(
                ServerSentEvent(data=data[:-1], event=event_type or "message", id=last_id, retry=retry)
            )
            data, event_type = "", ""
            continue
        if line.startswith(":"):
            continue
        if ":" in line:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
        else:
            field, value = line, ""
        if field == "event":
            event_type = value
        elif field == "data":
            data += value + "\n"
        elif field == "id":
            if "\0" not in value:
                last_id = value
        elif field == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return events


def decode(chunks: Sequence[bytes]) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    return [event for chunk in chunks for event in decoder.feed(chunk)]


def cut(body: bytes, offsets: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted(set(offsets)), len(body)]
    return [body[start:end] for start, end in itertools.pairwise(bounds)]


_VALUE = st.text(
    st.one_of(
        st.characters(exclude_categories=("Cs",), exclude_characters="\r\n"),
        st.sampled_from(["é", "日", "🎉", "\u2028", "\x85", ":", " ", "\0", "\ufeff", "0", "7"]),
    ),
    max_size=10,
)
_FIELD = st.sampled_from(["data", "data", "data", "event", "id", "retry", "", "dat", "Data", "comment"])


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["field", "field", "field", "blank", "blank", "comment", "bare", "bytes"]))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    if kind == "blank":
        return eol
    if kind == "comment":
        return b":" + draw(_VALUE).encode() + eol
    if kind == "bare":  # a field name with no colon: its value is ""
        return draw(_FIELD).encode() + eol
    if kind == "bytes":  # anything at all, invalid UTF-8 included (but no line break)
        raw = draw(st.binary(max_size=8)).replace(b"\r", b"").replace(b"\n", b"")
        return raw + eol
    space = draw(st.sampled_from([b"", b" ", b"  "]))
    return draw(_FIELD).encode() + b":" + space + draw(_VALUE).encode() + eol


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    body = b"".join(draw(st.lists(lines(), max_size=25)))
    if draw(st.integers(0, 4)) == 0:
        body = b"\xef\xbb\xbf" + body
    if draw(st.booleans()):  # end mid-line (mid-character, even): that event is never dispatched
        body += draw(st.binary(max_size=4)).replace(b"\r", b"").replace(b"\n", b"")
    return body


@settings(max_examples=400, deadline=None)
@given(body=bodies(), data=st.data())
def test_sse_decoder_matches_the_reference_however_the_body_is_cut(body: bytes, data: st.DataObject) -> None:
    offsets = data.draw(st.lists(st.integers(0, len(body)), max_size=len(body) + 1))

    assert decode([body]) == reference(body)
    assert decode(cut(body, offsets)) == reference(body)


@settings(max_examples=150, deadline=None)
@given(body=bodies())
def test_sse_decoder_matches_the_reference_byte_by_byte(body: bytes) -> None:
    assert decode([body[i : i + 1] for i in range(len(body))]) == reference(body)


def test_sse_decoder_reads_the_workers_ai_stream() -> None:
    body = b'data: {"response":"a"}\n\ndata: {"response":"b","p":"xyz"}\n\ndata: [DONE]\n\n'

    assert [e.data for e in decode([body])] == ['{"response":"a"}', '{"response":"b","p":"xyz"}', "[DONE]"]


def test_sse_decoder_keeps_a_crlf_cut_between_reads_as_one_line_end() -> None:
    body = b"data: a\r\ndata: b\r\n\r\n"

    for offset in range(len(body) + 1):
        assert decode(cut(body, [offset])) == [ServerSentEvent(data="a\nb")]


def test_sse_decoder_drops_one_leading_bom_however_it_is_cut() -> None:
    body = b"\xef\xbb\xbfdata: x\n\n"
    twice = b"\xef\xbb\xbf" + body  # the second BOM is part of the first field's name

    for offset in range(len(body) + 1):
        assert decode(cut(body, [offset])) == [ServerSentEvent(data="x")]
        assert decode(cut(twice, [offset])) == []


def test_sse_decoder_named_events_ids_and_retry() -> None:
    body = b"event: done\nid: 7\nretry: 1500\ndata: {}\n\nretry: soon\ndata: next\n\n"

    assert decode([body]) == [
        ServerSentEvent(data="{}", event="done", id="7", retry=1500),
        ServerSentEvent(data="next", event="message", id="7", retry=1500),
    ]
