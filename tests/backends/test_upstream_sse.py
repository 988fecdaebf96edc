"""quotes.ai.backends.upstream_sse.upstream_events, the one SSE decoder on the upstream read path
(httpx-sse with two gaps closed), held to a plain reading of the WHATWG event-stream rules
(`reference` below: the whole body decoded at once, then split into lines) on random streams cut
at random byte offsets, read through a real httpx.Response.

Both backends skip events whose data is empty, so events are compared by their data, type and
id where the data is not empty: httpx-sse also dispatches events that carry no data at all
(`event: x` or `id: 3` then a blank line), which the rules say to drop, and its `retry` is per
event rather than per stream.

The two gaps in bare httpx-sse 0.4.3 are pinned at the end: when a release closes them, those
tests fail, and upstream_sse.py's workarounds can go.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st

from quotes.ai.backends.upstream_sse import upstream_events

pytestmark = pytest.mark.unit

#: (data, event type, last event id) of one dispatched event
Seen = tuple[str, str, str]


def reference(body: bytes) -> list[Seen]:
    """https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation,
    step by step, on the whole body."""
    text = body.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    *lines, _unfinished = re.split("\r\n|\r|\n", text)
    events: list[Seen] = []
    data, event_type, last_id = "", "", ""
    for line in lines:
        if line == "":
            if data == "":
                event_type = ""
                continue
            events.append((data[:-1], event_type or "message", last_id))
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
        elif field == "id" and "\0" not in value:
            last_id = value
    return [event for event in events if event[0]]


class Reads(httpx.AsyncByteStream):
    """A response body handing over exactly these reads. `seen_at_read[n]`: how many events the
    reader had been handed when it asked for read n (a decoder that holds an event back until
    the next read shows up there)."""

    def __init__(self, chunks: Sequence[bytes], seen: list[Seen]) -> None:
        self.chunks = chunks
        self.seen = seen
        self.seen_at_read: list[int] = []

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.seen_at_read.append(len(self.seen))
            yield chunk


def read(chunks: Sequence[bytes], *, bare: bool = False) -> tuple[list[Seen], list[int]]:
    """The events with data, and `Reads.seen_at_read`, read with upstream_events (or with bare
    httpx-sse)."""

    async def run() -> tuple[list[Seen], list[int]]:
        seen: list[Seen] = []
        body = Reads(chunks, seen)
        response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)
        events = EventSource(response).aiter_sse() if bare else upstream_events(response)
        async for event in events:
            if event.data:
                seen.append((event.data, event.event, event.id))
        return seen, body.seen_at_read

    return asyncio.run(run())


def decode(chunks: Sequence[bytes], *, bare: bool = False) -> list[Seen]:
    return read(chunks, bare=bare)[0]


def cut(body: bytes, offsets: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted(set(offsets)), len(body)]
    return [body[start:end] for start, end in itertools.pairwise(bounds) if end > start]


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
def test_upstream_events_match_the_reference_however_the_body_is_cut(
    body: bytes, data: st.DataObject
) -> None:
    offsets = data.draw(st.lists(st.integers(0, len(body)), max_size=len(body) + 1))

    assert decode([body]) == reference(body)
    assert decode(cut(body, offsets)) == reference(body)


@settings(max_examples=150, deadline=None)
@given(body=bodies())
def test_upstream_events_match_the_reference_byte_by_byte(body: bytes) -> None:
    assert decode([body[i : i + 1] for i in range(len(body))]) == reference(body)


def test_upstream_events_read_the_workers_ai_stream() -> None:
    body = b'data: {"response":"a"}\n\ndata: {"response":"b","p":"xyz"}\n\ndata: [DONE]\n\n'

    assert [data for data, _, _ in decode([body])] == [
        '{"response":"a"}',
        '{"response":"b","p":"xyz"}',
        "[DONE]",
    ]


def test_upstream_events_keep_a_crlf_cut_between_reads_as_one_line_end() -> None:
    body = b"data: a\r\ndata: b\r\n\r\n"

    for offset in range(len(body) + 1):
        assert decode(cut(body, [offset])) == [("a\nb", "message", "")]
    # An empty read between the CR and the LF changes nothing.
    assert decode([b"data: a\r", b"", b"\ndata: b\r\n\r\n"]) == [("a\nb", "message", "")]


def test_upstream_events_drop_one_leading_bom_however_it_is_cut() -> None:
    body = b"\xef\xbb\xbfdata: x\n\n"
    twice = b"\xef\xbb\xbf" + body  # the second BOM is part of the first field's name

    for offset in range(len(body) + 1):
        assert decode(cut(body, [offset])) == [("x", "message", "")]
        assert decode(cut(twice, [offset])) == []


def test_upstream_events_named_events_and_ids() -> None:
    body = b"event: error\nid: 7\ndata: {}\n\n: a comment\ndata: next\n\n"

    assert decode([body]) == [("{}", "error", "7"), ("next", "message", "7")]


def test_upstream_events_decode_utf8_as_utf8_whatever_charset_the_header_names() -> None:
    async def run() -> list[str]:
        response = httpx.Response(
            200,
            headers={"content-type": "text/event-stream; charset=iso-8859-1"},
            stream=Reads(["data: café 日本\n\n".encode()], []),
        )
        return [event.data async for event in upstream_events(response)]

    assert asyncio.run(run()) == ["café 日本"]


def test_upstream_events_hand_over_an_event_before_the_next_read_whatever_the_line_ends() -> None:
    for eol in (b"\n", b"\r\n", b"\r"):
        chunks = [b"data: a" + eol + eol, b"data: b" + eol + eol, b"data: [DONE]" + eol + eol]

        seen, seen_at_read = read(chunks)

        assert [data for data, _, _ in seen] == ["a", "b", "[DONE]"]
        assert seen_at_read == [0, 1, 2], eol


def test_upstream_events_drop_an_event_cut_off_by_the_end_of_the_body() -> None:
    for end in (b"data: b", b"data: b\n", b"data: b\r", b"data: b\r\n"):
        assert decode([b"data: a\n\n" + end]) == [("a", "message", "")]


# -- the gaps in bare httpx-sse 0.4.3 that upstream_events closes --------------------------------------


def test_bare_httpx_sse_still_loses_the_first_event_after_a_bom() -> None:
    assert decode([b"\xef\xbb\xbfdata: x\n\ndata: y\n\n"], bare=True) == [("y", "message", "")]


def test_bare_httpx_sse_still_holds_a_cr_ended_event_until_the_next_read() -> None:
    seen, seen_at_read = read([b"data: a\r\r", b"data: b\r\r"], bare=True)

    assert [data for data, _, _ in seen] == ["a", "b"]
    assert seen_at_read == [0, 0]  # "a" was handed over only after the second read
