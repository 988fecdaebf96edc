"""The upstream SSE decode per token: httpx-sse vs a hand-written decoder, side by side (issue 19).

    .venv/bin/python -m bench.sse_decode                # about 30 s
    .venv/bin/python -m bench.sse_decode --help

Every path reads the same Workers AI stream (`data: {"response":"..","p":"<padding>"}` events as
tests/fakes/workers_ai.py renders them, multi-byte text included, then usage and `[DONE]`) out
of a real `httpx.Response` whose body hands over the same reads, in one of three cuts:

- `event`: one read per event, as Cloudflare and the fake write them (the common case);
- `random`: random cut points, about one per event on average, landing mid-line and mid-UTF-8;
- `4k`: 4 KiB reads, several events each (what a loaded process reads from a busy socket).

Paths, interleaved in every round (the order rotates), each decoding the stream `--streams` times:

- `raw read`: `aiter_raw()` and nothing else, the floor every decoder stands on;
- `hand-written`: `aiter_raw()` fed to `HandWrittenDecoder` below, the incremental decoder the
  Workers AI backend used until issue 19 (quotes/ai/sse.py at commit 6942a41), kept here as the
  yardstick;
- `httpx-sse`: bare `EventSource(response).aiter_sse()`;
- `upstream_events`: httpx-sse as both backends read it now, with the BOM and CR gaps closed
  (quotes/ai/backends/upstream_sse.py).

The decode cost per token is a path's CPU time less the raw read's, over the tokens. For scale, the
app's whole CPU per token at 100 streams is ~130-160 µs (bench.load), and one fast stream
through the app ~50 µs per token (bench.proxy_overhead's tokens/s). Before timing, every decoder
must yield the same events for each cut: a figure for a decoder that decodes wrongly would mean
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx
from httpx_sse import EventSource

from quotes.ai.backends.upstream_sse import upstream_events
from tests.fakes.workers_ai import Scenario, render_body

from .common import machine, median, table

SSE_HEADERS = {"content-type": "text/event-stream"}
#: Words of a quote, some of them multi-byte, so random cuts land mid-character.
WORDS = ("The", " café", " is", " where", " 日本", " thought", " —", " naïve", " ends", ".", " 🎉", " and")
CUTS = ("event", "random", "4k")
DECODERS = ("hand-written", "httpx-sse", "upstream_events")


# -- the yardstick: the hand-written decoder, as it was -------------------------------------------

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class HandWrittenDecoder:
    """Bytes in, dispatched events out: `feed(chunk)` returns the events completed by `chunk`.

    An event still open when the body ends is never dispatched (as the spec says), so nothing
    needs flushing at the end.
    """

    __slots__ = ("_buffer", "_data", "_event", "_id", "_retry", "_skip_lf", "_start")

    def __init__(self) -> None:
        self._buffer = b""  # the unfinished last line
        #: the first bytes of the body until we know whether they are a BOM; None after that
        self._start: bytes | None = b""
        #: a CR ended the previous chunk: an LF starting this one completes that line end
        self._skip_lf = False
        self._data: list[bytes] = []
        self._event = b""
        self._id = b""
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        if self._start is not None:
            chunk = self._strip_bom(chunk)
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 10:  # b"\n"
                chunk = chunk[1:]
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            # A CR at the very end ends its line now; an LF starting the next chunk is its pair.
            self._skip_lf = buffer[-1] == 13
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        events: list[ServerSentEvent] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(self._dispatch())
                else:
                    self._event = b""
                continue
            if line[0] == 58:  # b":": a comment
                continue
            name, colon, value = line.partition(b":")
            if colon and value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value
            elif name == b"id":
                if b"\0" not in value:
                    self._id = value
            elif name == b"retry" and value.isdigit():  # bytes.isdigit: ASCII digits only
                self._retry = int(value)
        return events

    def _dispatch(self) -> ServerSentEvent:
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        event = ServerSentEvent(
            data=data.decode("utf-8", "replace"),
            event=self._event.decode("utf-8", "replace") if self._event else "message",
            id=self._id.decode("utf-8", "replace"),
            retry=self._retry,
        )
        self._data = []
        self._event = b""
        return event

    def _strip_bom(self, chunk: bytes) -> bytes:
        """Drop one UTF-8 BOM at the very start of the body, however the first reads cut it."""
        start = (self._start or b"") + chunk
        if len(start) < len(_BOM) and _BOM.startswith(start):
            self._start = start
            return b""
        self._start = None
        return start[len(_BOM) :] if start.startswith(_BOM) else start


# -- the stream and the paths ----------------------------------------------------------------------


def stream_body(tokens: int, seed: int = 19) -> tuple[bytes, list[int]]:
    """The stream body and the offsets at which its events end."""
    scenario = Scenario(
        tokens=tuple(WORDS[i % len(WORDS)] for i in range(tokens)),
        usage=(24, tokens),
        padding=True,
        seed=seed,
    )
    body = render_body(scenario)
    ends = [index + 2 for index in range(len(body) - 1) if body[index : index + 2] == b"\n\n"]
    return body, ends


def reads(body: bytes, ends: Sequence[int], cut: str, seed: int = 19) -> list[bytes]:
    if cut == "event":
        offsets = list(ends)
    elif cut == "random":
        offsets = sorted(random.Random(seed).sample(range(1, len(body)), k=len(ends)))
    elif cut == "4k":
        offsets = list(range(4096, len(body), 4096))
    else:
        raise ValueError(cut)
    bounds = [0, *offsets, len(body)]
    return [body[start:end] for start, end in itertools.pairwise(bounds) if end > start]


class Reads(httpx.AsyncByteStream):
    """A response body handing over exactly these reads."""

    def __init__(self, chunks: Sequence[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def response(chunks: Sequence[bytes]) -> httpx.Response:
    return httpx.Response(200, headers=SSE_HEADERS, stream=Reads(chunks))


async def raw_read(chunks: Sequence[bytes]) -> list[str]:
    async for _ in response(chunks).aiter_raw():
        pass
    return []


async def hand_written(chunks: Sequence[bytes]) -> list[str]:
    decoder = HandWrittenDecoder()
    data: list[str] = []
    async for chunk in response(chunks).aiter_raw():
        for event in decoder.feed(chunk):
            data.append(event.data)
    return data


async def httpx_sse(chunks: Sequence[bytes]) -> list[str]:
    return [event.data async for event in EventSource(response(chunks)).aiter_sse()]


async def httpx_sse_as_the_backends_read_it(chunks: Sequence[bytes]) -> list[str]:
    return [event.data async for event in upstream_events(response(chunks))]


PATHS: dict[str, Callable[[Sequence[bytes]], Awaitable[list[str]]]] = {
    "raw read": raw_read,
    "hand-written": hand_written,
    "httpx-sse": httpx_sse,
    "upstream_events": httpx_sse_as_the_backends_read_it,
}


@dataclass
class Figures:
    """CPU seconds per stream, one value per round, for each (cut, path)."""

    tokens: int
    per_stream: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def per_token_us(self, cut: str, path: str) -> float:
        return median(self.per_stream[cut, path]) / self.tokens * 1e6

    def decode_us(self, cut: str, path: str) -> float:
        return self.per_token_us(cut, path) - self.per_token_us(cut, "raw read")


async def measure(*, tokens: int, streams: int, rounds: int, cuts: Sequence[str] = CUTS) -> Figures:
    body, ends = stream_body(tokens)
    chunks = {cut: reads(body, ends, cut) for cut in cuts}
    expected = await hand_written([body])
    if len(expected) != tokens + 2:  # the tokens, usage, [DONE]
        raise AssertionError(f"the stream decoded to {len(expected)} events, not {tokens + 2}")
    for cut in cuts:
        for name in DECODERS:
            if await PATHS[name](chunks[cut]) != expected:
                raise AssertionError(f"{name} decoded the {cut!r} cut differently from the whole body")
    figures = Figures(tokens=tokens)
    names = list(PATHS)
    for round_number in range(rounds):
        shift = round_number % len(names)
        for cut in cuts:
            for name in names[shift:] + names[:shift]:
                run = PATHS[name]
                # CPU time, not wall time: on a shared machine the other processes' turns on
                # the CPU would otherwise land in whichever path happened to be running.
                started = time.process_time()
                for _ in range(streams):
                    await run(chunks[cut])
                elapsed = time.process_time() - started
                figures.per_stream.setdefault((cut, name), []).append(elapsed / streams)
    return figures


REPORT_HEADERS = [
    "reads",
    "raw read µs/token",
    *(f"{name}: decode µs/token" for name in DECODERS),
    *(f"{name} / hand-written" for name in DECODERS[1:]),
]


def report(figures: Figures, cuts: Sequence[str] = CUTS) -> str:
    rows = []
    for cut in cuts:
        decode = {name: figures.decode_us(cut, name) for name in DECODERS}
        base = decode["hand-written"]
        rows.append(
            [
                cut,
                f"{figures.per_token_us(cut, 'raw read'):.2f}",
                *(f"{decode[name]:.2f}" for name in DECODERS),
                *(f"{decode[name] / base:.2f}" if base > 0 else "n/a" for name in DECODERS[1:]),
            ]
        )
    return table(REPORT_HEADERS, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=200, help="token events per stream")
    parser.add_argument("--streams", type=int, default=200, help="streams per path per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is kept)")
    args = parser.parse_args(argv)
    figures = asyncio.run(measure(tokens=args.tokens, streams=args.streams, rounds=args.rounds))
    print(machine())
    print(
        f"{args.tokens} tokens a stream, {args.streams} streams per path per round, {args.rounds} rounds; "
        "medians over the rounds"
    )
    print(report(figures))


if __name__ == "__main__":
    main()
