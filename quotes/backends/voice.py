"""A persona's voice examples, parsed from the admin's text, and the rule that a quote never
copies one.

One example a line, optionally `Topic: line` (or "on topic: line"); blank lines and `#` notes
(`# Meditations, tr. George Long (1862)`) are left out. A quote that shares COPY_RUN_WORDS words
in a row with an example (lower case, punctuation ignored) copies it: `guard_copies` ends any
backend's quote before the word that would complete a copy.
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncGenerator, Iterable, Sequence
from contextlib import aclosing

from streaming import Done, Error, Event, Token

from .base import VoiceExample

#: The embedded model's frame holds all of a persona's examples in a context of 1,024 tokens.
MAX_EXAMPLES = 12
MAX_EXAMPLE_CHARS = 400
MAX_TOPIC_CHARS = 60
COPY_RUN_WORDS = 8
#: What a quote may not end on: a comma, colon, dash, slash (a line break in verse) or open
#: bracket, and spaces. A quote the copy rule ends drops them; the embedded model holds them back.
DANGLING = " \t,;:/(-\u2013\u2014"

# A topic is a few plain words (no sentence punctuation), so "Remember this: ..." reads as one
# only when it is that short.
_TOPIC_LINE = re.compile(
    r"^(?:on\s+)?(?P<topic>[^:.,!?;\"\u201c\u201d/()]{1,60}?)\s*:\s+(?P<text>\S.*)$", re.IGNORECASE
)
_MAX_TOPIC_WORDS = 5
_QUOTE_MARKS = '"\u201c\u201d'  # straight and curly double quotes
_APOSTROPHES = ("'", "\u2019")
_WORD = re.compile(r"[^\W_]+(?:['\u2019][^\W_]+)*")  # "don't" is one word


def parse_examples(text: str) -> tuple[VoiceExample, ...]:
    """The examples in the admin's text, in its order (40 µs for seven: no cache)."""
    examples = []
    for raw in text.splitlines():
        line = " ".join(raw.split())
        if not line or line.startswith("#"):
            continue
        topic = ""
        match = _TOPIC_LINE.match(line)
        if match and len(match["topic"].split()) <= _MAX_TOPIC_WORDS:
            topic, line = match["topic"].strip(), match["text"]
        examples.append(VoiceExample(topic=topic, text=_unquoted(line)))
    return tuple(examples)


def _unquoted(line: str) -> str:
    """The line without quote marks around the whole of it (the frame adds its own)."""
    if len(line) >= 2 and line[0] in _QUOTE_MARKS and line[-1] in _QUOTE_MARKS:
        inner = line[1:-1].strip()
        if inner and not any(mark in inner for mark in _QUOTE_MARKS):
            return inner
    return line


def example_problems(text: str) -> list[str]:
    """What is wrong with the admin's text, for the form (empty when nothing is)."""
    examples = parse_examples(text)
    problems = []
    if len(examples) > MAX_EXAMPLES:
        problems.append(f"At most {MAX_EXAMPLES} examples (one a line); there are {len(examples)}.")
    for number, example in enumerate(examples, 1):
        if len(example.text) > MAX_EXAMPLE_CHARS:
            problems.append(f"Example {number} is longer than {MAX_EXAMPLE_CHARS} characters.")
        if len(example.topic) > MAX_TOPIC_CHARS:
            problems.append(f"Example {number}'s topic is longer than {MAX_TOPIC_CHARS} characters.")
    return problems


def words(text: str) -> list[str]:
    """The words of `text` as the copy rule compares them: lower case, no punctuation."""
    return [_normal(word) for word in _WORD.findall(text)]


def _normal(word: str) -> str:
    return word.lower().replace("'", "").replace("\u2019", "")


def longest_copied_run(text: str, examples: Iterable[VoiceExample]) -> int:
    """The most words in a row that `text` shares with any one example."""
    quote = words(text)
    best = 0
    for example in examples:
        other = words(example.text)
        previous = [0] * (len(other) + 1)
        for word in quote:
            current = [0] * (len(other) + 1)
            for j, theirs in enumerate(other, 1):
                if word == theirs:
                    current[j] = previous[j - 1] + 1
                    best = max(best, current[j])
            previous = current
    return best


class CopyGuard:
    """Ends a streaming quote before it copies `run` words in a row from an example.

    `feed(piece)` returns the text that may go out now and whether the quote ends there: text goes
    out as it comes, except a word still being written after the first `run - 1` words of a copy,
    which waits until it is whole (no copy is sent, even in part). `finish()` returns the rest.
    A piece costs time in its own length, not the quote's: only text not yet sent or counted is
    kept, and of a word longer than any example's, only its last letter.
    """

    run = COPY_RUN_WORDS

    def __init__(self, examples: Iterable[VoiceExample]) -> None:
        self._copies, self._leads, self._longest = _runs_of(tuple(examples), self.run)
        self._words: list[str] = []  # the quote's whole words so far
        self._text = ""  # what was received, from offset _base on
        self._base = 0  # offsets below count from the quote's start
        self._sent = 0  # how much of it went out
        self._scan = 0  # where the next word not yet counted starts
        self._last_end = 0  # where the last word counted ends
        self._long = False  # the word being written is longer than any example's
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._text += piece
        base = self._base
        tail = None  # the last word, if it may go on in the next piece
        for match in _WORD.finditer(self._text, self._scan - base):
            if self._unfinished(match):
                tail = match
                break
            if self._copied(match):
                return self._stop(base + match.start()), True
            self._scan = self._last_end = base + match.end()
        if tail is not None:
            self._scan = base + tail.start()
            self._long = self._long or len(_normal(tail.group())) > self._longest
            if self._long:  # keep its last letter only, to see where it ends
                self._scan = base + tail.end() - 1
        else:  # no word starts in what is left
            self._scan = base + len(self._text)
        until = base + len(self._text)
        if not self._long and tuple(self._words[-(self.run - 1) :]) in self._leads:
            # The next word could complete a copy: hold back all after the last whole word.
            until = max(self._sent, self._last_end)
        out = self._text[self._sent - base : until - base]
        self._sent = max(self._sent, until)
        cut = min(self._sent, self._scan)
        self._text, self._base = self._text[cut - base :], cut
        return out, False

    def finish(self) -> str:
        """What is left to send once the stream has ended (its last word is whole now)."""
        if self.stopped:
            return ""
        for match in _WORD.finditer(self._text, self._scan - self._base):
            if self._copied(match):
                return self._stop(self._base + match.start())
        out = self._text[self._sent - self._base :]
        self._sent = self._base + len(self._text)
        return out

    def _unfinished(self, match: re.Match[str]) -> bool:
        """The word reaches the end of what was received (or only an apostrophe follows it)."""
        return match.end() == len(self._text) or self._text[match.end() :] in _APOSTROPHES

    def _copied(self, match: re.Match[str]) -> bool:
        """Count the word; True when it completes a copied run."""
        self._words.append("" if self._long else _normal(match.group()))  # "" is in no example
        self._long = False
        return tuple(self._words[-self.run :]) in self._copies

    def _stop(self, at: int) -> str:
        self.stopped = True
        out = self._text[self._sent - self._base : max(self._sent, at) - self._base]
        if self._sent + len(out) == at:  # the quote ends here: no dangling comma or dash
            out = out.rstrip(DANGLING)
        self._sent = self._base + len(self._text)
        return out


@functools.lru_cache(maxsize=256)
def _runs_of(
    examples: tuple[VoiceExample, ...], run: int
) -> tuple[frozenset[tuple[str, ...]], frozenset[tuple[str, ...]], int]:
    """Every run of `run` words of the examples, the first `run - 1` words of each, and the
    longest word's length: once per persona's examples."""
    copies: set[tuple[str, ...]] = set()
    for example in examples:
        seq = words(example.text)
        copies.update(tuple(seq[start : start + run]) for start in range(len(seq) - run + 1))
    longest = max((len(word) for gram in copies for word in gram), default=0)
    return frozenset(copies), frozenset(gram[:-1] for gram in copies), longest


def guard_copies(
    events: AsyncGenerator[Event, None], examples: Sequence[VoiceExample]
) -> AsyncGenerator[Event, None]:
    """`events` with a quote that would copy an example ended (Done) before the copy, and the
    backend's stream closed, which stops it."""
    if not examples:
        return events
    return _guarded(events, CopyGuard(examples))


async def _guarded(events: AsyncGenerator[Event, None], guard: CopyGuard) -> AsyncGenerator[Event, None]:
    async with aclosing(events):
        async for event in events:
            if type(event) is Token:
                text, stop = guard.feed(event.text)
                if text:
                    yield Token(text)
                if stop:
                    yield Done()
                    return
                continue
            if type(event) is Done or type(event) is Error:
                rest = guard.finish()
                if rest:
                    yield Token(rest)
            yield event
