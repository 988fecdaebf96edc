"""Voice benchmark (issue 23): can a reader tell the personas apart on the embedded model?

    .venv/bin/python -m bench.voice --per-persona 2 --topics rain,bridges,candles,old friends
    .venv/bin/python -m bench.voice --score artifacts/bench/voice/<run> guesses.txt
    .venv/bin/python -m bench.voice --measure artifacts/bench/voice/<run>   # figures again

Writes `--per-persona` quotes per persona on each topic, through the app's own generation
(`quotes.streams.begin`, as `manage.py quote` does, the answer cache off) and the embedded
model (AI_BACKEND=local), on a fresh SQLite database migrated from scratch, so the personas are
the seeded ones with their seeded voice examples. One generation at a time; the personas take
turns, as on a site where visitors ask for different personas.

It writes, in `--out` (default artifacts/bench/voice/<time>/):

- `sheet.md`: the quotes shuffled and numbered, each with its topic and no persona: a blind test.
  Write your guesses one a line (`7 lao-tzu`, or `7 Lao Tzu`) and score them with `--score`;
- `key.md`: the answers, apart (do not open it before you have guessed);
- `quotes.jsonl`: every quote with its persona, topic, timings and token counts;
- `summary.json`: the figures below.

It prints:

- on topic: the share of quotes that name the topic (a word starting with the topic's last word,
  less a plural s: "bridges" counts "bridge" and "bridged");
- ending cleanly: the share ending on . ! ? or an ellipsis (closing marks allowed after it);
- mean length in words;
- distinct-2 across personas: for each topic, the six personas' quotes pooled, distinct word
  pairs over all word pairs (1.0: no pair repeated), averaged over the topics;
- the longest run of words a quote shares with one of its persona's examples (8+ is a copy);
- lexical attribution: each quote given to the persona whose examples' bag of words (words and
  the marks / ; ( ! ?) is nearest by cosine, each feature weighted by how few personas' examples
  have it (tf-idf: a word all personas use says nothing about who speaks; raw counts in
  brackets); the share given to its own persona (chance: one in the number of personas);
- time to first token: p50 over all quotes (personas taking turns), and, per persona, warm (the
  persona's frame already in a slot) against cold (the same request with `cache_prompt` off,
  so llama.cpp reads the whole frame): the difference is the frame's prefill cost.

Sampling and frame can be varied without touching the personas' rows (unsaved, in memory):
`--temperature --top-p --top-k --repeat-penalty`, `--examples K` (the first K), `--order`.
`--smoke`: two personas, one topic, 8 tokens (the smoke test's run).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .common import ARTIFACTS, ROOT, machine, median, parse_args, percentile, table

DEFAULT_TOPICS = "ladders,bread,keys,the sea"
SEED_MIGRATION = ROOT / "quotes" / "migrations" / "0013_seed_voice_examples.py"
_WORD = re.compile(r"[^\W_]+(?:['\u2019][^\W_]+)*")
_MARKS = re.compile(r"[/;(!?]")
_CLEAN_END = re.compile(r"(?:[.!?]|\u2026)['\u2019\")\]]*\s*$")


# --- text measures (independent of the app's code, so they read old code's quotes alike) --------


def words(text: str) -> list[str]:
    return [w.replace("'", "").replace("\u2019", "") for w in _WORD.findall(text.lower())]


def features(text: str) -> Counter[str]:
    """The bag a quote is attributed by: its words and a few telling marks."""
    return Counter(words(text)) + Counter(_MARKS.findall(text))


def cosine(a: Counter[str], b: Counter[str]) -> float:
    dot = sum(count * b[key] for key, count in a.items() if key in b)
    norm = math.sqrt(sum(v * v for v in a.values())) * math.sqrt(sum(v * v for v in b.values()))
    return dot / norm if norm else 0.0


def longest_common_run(text: str, others: list[str]) -> int:
    quote, best = words(text), 0
    for other in others:
        theirs = words(other)
        previous = [0] * (len(theirs) + 1)
        for word in quote:
            current = [0] * (len(theirs) + 1)
            for j, candidate in enumerate(theirs, 1):
                if word == candidate:
                    current[j] = previous[j - 1] + 1
                    best = max(best, current[j])
            previous = current
    return best


def on_topic(text: str, topic: str) -> bool:
    head = words(topic)[-1] if words(topic) else topic.lower()
    stem = head[:-1] if head.endswith("s") and len(head) > 4 else head
    return any(word.startswith(stem) for word in words(text))


def ends_cleanly(text: str) -> bool:
    return bool(_CLEAN_END.search(text))


def distinct_2(texts: list[str]) -> float:
    pairs = [pair for text in texts for pair in zip(words(text), words(text)[1:], strict=False)]
    return len(set(pairs)) / len(pairs) if pairs else float("nan")


def parse_lines(text: str) -> list[str]:
    """Example lines, as the app parses them."""
    from quotes.backends.voice import parse_examples

    return [example.text for example in parse_examples(text)]


# --- one run -----------------------------------------------------------------------------------


@dataclass
class Quote:
    persona: str
    name: str
    topic: str
    text: str = ""
    ttft_ms: float | None = None
    total_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    stop_reason: str = ""
    error: str = ""


@dataclass
class Timing:
    persona: str
    warm_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)
    frame_tokens: list[int] = field(default_factory=list)


def setup_django(database: str | None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("DJANGO_DEBUG", "true")  # in-process, on the development settings
    os.environ["AI_BACKEND"] = "local"
    os.environ.setdefault("DJANGO_LOG_LEVEL", "WARNING")
    os.environ["QUOTES_CACHE_TTL"] = "0"
    os.environ["QUOTES_RATE_LIMIT"] = "100000/minute"
    os.environ["QUOTES_MAX_CONCURRENT_STREAMS"] = "1000"
    os.environ["DATABASE_URL"] = database or f"sqlite:///{tempfile.mkdtemp(prefix='voice-bench-')}/db.sqlite3"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def seed_examples(path: Path) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("voice_seed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.EXAMPLES)


def shape_examples(text: str, *, keep: int | None, order: str, rng: random.Random) -> str:
    """The persona's examples text with only the first `keep` examples, in `order` (notes kept)."""
    lines = text.splitlines()
    notes = [line for line in lines if line.lstrip().startswith("#") or not line.strip()]
    examples = [line for line in lines if line not in notes]
    if keep is not None:
        examples = examples[:keep]
    if order == "reversed":
        examples.reverse()
    elif order == "shuffled":
        rng.shuffle(examples)
    return "\n".join([*notes, *examples])


def prepare(personas: list[Any], args: argparse.Namespace, rng: random.Random) -> dict[str, list[str]]:
    """Apply the command line's overrides to the (unsaved) personas; their examples, by slug."""
    examples = {}
    for persona in personas:
        for name, value in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("top_k", args.top_k),
            ("repetition_penalty", args.repeat_penalty),
        ):
            if value is not None:
                setattr(persona, name, value)
        if args.max_tokens:
            persona.max_tokens = args.max_tokens
        if args.no_examples:
            examples[persona.slug] = parse_lines(persona.voice_examples)
            persona.voice_examples = ""
        else:
            persona.voice_examples = shape_examples(
                persona.voice_examples, keep=args.examples, order=args.order, rng=rng
            )
            examples[persona.slug] = parse_lines(persona.voice_examples)
    return examples


async def generate(persona: Any, topic: str) -> Quote:
    from streaming import Error, Token, Usage

    from quotes import streams
    from quotes.backends import get_backend
    from quotes.clients import Client

    quote = Quote(persona=persona.slug, name=persona.name, topic=topic)
    backend: Any = get_backend("local")
    started = time.perf_counter()
    # The persona as prepare() changed it (unsaved), not as the database has it: no parse().
    asked = streams.Quote.of(persona, None, streams.clean_topic(topic, default=""), fresh=True)
    stream = await streams.begin(Client("bench"), transport="bench", quote=asked, preview=True)
    async for event in stream.read():
        if type(event) is Token:
            if quote.ttft_ms is None:
                quote.ttft_ms = (time.perf_counter() - started) * 1000
            quote.text += event.text
        elif type(event) is Usage:
            quote.prompt_tokens, quote.completion_tokens = event.prompt_tokens, event.completion_tokens
        elif type(event) is Error:
            quote.error = f"{event.code}: {event.message}"
    quote.total_ms = (time.perf_counter() - started) * 1000
    if backend.jobs:
        stats = backend.jobs[-1]
        quote.cached_tokens = getattr(stats, "cached_tokens", None)
        # A quote the copy rule ended: the generation closed the backend's stream ("stopped",
        # or not yet marked when it is read here).
        quote.stop_reason = stats.stop_reason if stats.stop_reason not in ("", "stopped") else "copy cut"
    quote.text = quote.text.strip()
    return quote


async def time_first_token(persona: Any, topic: str, *, cache: bool) -> tuple[float, int]:
    """TTFT of the persona's request straight on the backend, with llama.cpp's prompt cache on
    or off (off: the whole frame is read), and the prompt's length."""
    from streaming import Token, Usage

    from quotes.backends import get_backend
    from quotes.backends.local import completion_body, quote_lead

    backend: Any = get_backend("local")
    request = persona.build_request(topic=topic)
    body = {**completion_body(request, quote_lead(request)), "cache_prompt": cache, "max_tokens": 4}
    started, first, prompt = time.perf_counter(), math.nan, 0
    async for event in backend.stream_completion(body):
        if type(event) is Token and math.isnan(first):
            first = (time.perf_counter() - started) * 1000
        elif type(event) is Usage:
            prompt = event.prompt_tokens
    return first, prompt


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from quotes.backends import reset_backends
    from quotes.models import Persona
    from quotes.rows import writer

    rng = random.Random(args.seed)
    personas = [p async for p in Persona.objects.active().order_by("display_order", "name")]
    if args.personas:
        wanted = args.personas.split(",")
        personas = [p for p in personas if p.slug in wanted]
    examples = prepare(personas, args, rng)
    topics = [t.strip() for t in args.topics.split(",") if t.strip()]
    quotes: list[Quote] = []
    timings = {p.slug: Timing(p.slug) for p in personas}
    try:
        await generate(personas[0], "a warm-up")  # the model loads here, not in the first figure
        for round_ in range(args.per_persona):
            for number, topic in enumerate(topics):
                turn = (round_ + number) % len(personas)  # who goes first rotates
                for persona in personas[turn:] + personas[:turn]:
                    quote = await generate(persona, topic)
                    quotes.append(quote)
                    if not args.quiet:
                        print(f"  {persona.name:16} {topic:14} {quote.ttft_ms or 0:7.1f} ms  {quote.text}")
        for round_ in range(args.timing):
            for persona in personas:
                topic = topics[round_ % len(topics)]
                await generate(persona, topic)  # the persona's frame is in a slot now
                warm, prompt = await time_first_token(persona, topic, cache=True)
                cold, _ = await time_first_token(persona, topic, cache=False)
                timing = timings[persona.slug]
                timing.warm_ms.append(warm)
                timing.cold_ms.append(cold)
                timing.frame_tokens.append(prompt)
    finally:
        await writer().flush(10.0)
        await reset_backends()
    return report(quotes, timings, examples, personas, args, rng)


def attribute(quotes: list[Quote], examples: dict[str, list[str]], *, idf: bool = True) -> list[str]:
    """Each quote's nearest persona: cosine between its bag and each persona's examples' bag.
    With `idf`, a feature counts by how few personas' examples have it (log(personas / having
    it)): a word every persona uses says nothing about who speaks."""
    centroids = {slug: sum((features(line) for line in lines), Counter()) for slug, lines in examples.items()}
    having = Counter(feature for bag in centroids.values() for feature in bag)
    weight = {f: math.log(len(centroids) / n) if idf else 1.0 for f, n in having.items()}

    def weighed(bag: Counter[str]) -> Counter[str]:
        return Counter({f: count * weight.get(f, 0.0) for f, count in bag.items()})

    centroids = {slug: weighed(bag) for slug, bag in centroids.items()}
    return [
        max(centroids, key=lambda slug: (cosine(weighed(features(q.text)), centroids[slug]), slug))
        for q in quotes
    ]


def measure(quotes: list[Quote], examples: dict[str, list[str]], personas: int) -> dict[str, Any]:
    """The figures read from the quotes' text alone."""
    written = [q for q in quotes if q.text and not q.error]
    by_topic: dict[str, list[str]] = {}
    for quote in written:
        by_topic.setdefault(quote.topic, []).append(quote.text)
    runs = [longest_common_run(q.text, examples.get(q.persona, [])) for q in written]
    return {
        "quotes": len(quotes),
        "errors": sum(1 for q in quotes if q.error or not q.text),
        "personas": personas,
        "on_topic": _share(on_topic(q.text, q.topic) for q in written),
        "ends_cleanly": _share(ends_cleanly(q.text) for q in written),
        "mean_words": sum(len(words(q.text)) for q in written) / len(written) if written else math.nan,
        "distinct_2_across_personas": _mean([distinct_2(texts) for texts in by_topic.values()]),
        "distinct_2_all": distinct_2([q.text for q in written]),
        "longest_copied_run": max(runs, default=0),
        "copies_8_plus": sum(1 for run in runs if run >= 8),
        "lexical_attribution": _share(
            guess == q.persona for guess, q in zip(attribute(written, examples), written, strict=True)
        ),
        "lexical_attribution_raw": _share(
            guess == q.persona
            for guess, q in zip(attribute(written, examples, idf=False), written, strict=True)
        ),
        "chance": 1 / personas if personas else math.nan,
        "stop_reasons": dict(Counter(q.stop_reason for q in written)),
    }


def report(
    quotes: list[Quote],
    timings: dict[str, Timing],
    examples: dict[str, list[str]],
    personas: list[Any],
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, Any]:
    written = [q for q in quotes if q.text and not q.error]
    ttfts = [q.ttft_ms for q in written if q.ttft_ms is not None]
    warm = [ms for t in timings.values() for ms in t.warm_ms]
    cold = [ms for t in timings.values() for ms in t.cold_ms]
    frames = [n for t in timings.values() for n in t.frame_tokens] or [q.prompt_tokens for q in written]
    summary: dict[str, Any] = {
        **measure(quotes, examples, len(personas)),
        "ttft_ms_p50": median(ttfts),
        "ttft_ms_p90": percentile(ttfts, 90),
        "ttft_warm_ms_p50": median(warm),
        "ttft_warm_ms_p90": percentile(warm, 90),
        "ttft_cold_ms_p50": median(cold),
        "prefill_ms_p50": median(cold) - median(warm) if warm and cold else math.nan,
        "frame_tokens_p50": median(frames),
        "cached_share": _share((q.cached_tokens or 0) > 0 for q in written if q.cached_tokens is not None),
    }
    out = Path(args.out) if args.out else ARTIFACTS / "voice" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    order = list(range(len(quotes)))
    rng.shuffle(order)
    sheet = ["# Voice benchmark: blind sheet", "", f"Personas: {', '.join(p.name for p in personas)}.", ""]
    sheet += ["Guess each quote's persona; write `number persona` one a line; score with `--score`.", ""]
    key = ["# Key", "", "| # | persona | topic |", "|---|---|---|"]
    for number, index in enumerate(order, 1):
        quote = quotes[index]
        sheet.append(f"{number}. *{quote.topic}*: {quote.text or '(nothing)'}")
        key.append(f"| {number} | {quote.name} | {quote.topic} |")
    (out / "sheet.md").write_text("\n".join(sheet) + "\n")
    (out / "key.md").write_text("\n".join(key) + "\n")
    (out / "key.json").write_text(json.dumps({str(n): quotes[i].persona for n, i in enumerate(order, 1)}))
    with (out / "quotes.jsonl").open("w") as lines:
        for quote in quotes:
            lines.write(json.dumps(asdict(quote)) + "\n")
    summary["samples"] = [f"{quotes[i].name}, on {quotes[i].topic}: {quotes[i].text}" for i in order[:10]]
    summary["settings"] = {
        key: getattr(args, key)
        for key in (
            "per_persona",
            "topics",
            "temperature",
            "top_p",
            "top_k",
            "repeat_penalty",
            "examples",
            "order",
        )
    } | {
        "no_examples": args.no_examples,
        "max_tokens": args.max_tokens,
        "sampling": args.sampling,
        "max_sentences": args.max_sentences,
        "topic_bias": args.topic_bias,
        "enough_words": args.enough_words,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["out"] = str(out)
    return summary


def _share(flags: Any) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else math.nan


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def print_summary(summary: dict[str, Any]) -> None:
    def pct(value: float) -> str:
        return "n/a" if math.isnan(value) else f"{value:.0%}"

    def num(value: float, digits: int = 1) -> str:
        return "n/a" if isinstance(value, float) and math.isnan(value) else f"{value:.{digits}f}"

    rows = [
        ("quotes (errors or empty)", f"{summary['quotes']} ({summary['errors']})"),
        ("on topic", pct(summary["on_topic"])),
        ("ending cleanly", pct(summary["ends_cleanly"])),
        ("mean length, words", num(summary["mean_words"])),
        ("distinct-2 across personas (per topic, mean)", num(summary["distinct_2_across_personas"], 3)),
        ("distinct-2, all quotes", num(summary["distinct_2_all"], 3)),
        ("longest run copied from an example, words", str(summary["longest_copied_run"])),
        ("quotes with a run of 8+ words copied", str(summary["copies_8_plus"])),
        (
            "lexical attribution to its own persona, tf-idf (raw counts)",
            f"{pct(summary['lexical_attribution'])} ({pct(summary['lexical_attribution_raw'])}); "
            f"chance {pct(summary['chance'])}",
        ),
        (
            "TTFT p50 / p90, personas taking turns, ms",
            f"{num(summary['ttft_ms_p50'])} / {num(summary['ttft_ms_p90'])}",
        ),
        (
            "TTFT warm p50 / p90 (frame in a slot), ms",
            f"{num(summary['ttft_warm_ms_p50'])} / {num(summary['ttft_warm_ms_p90'])}",
        ),
        ("TTFT cold p50 (whole frame read), ms", num(summary["ttft_cold_ms_p50"])),
        ("prefill cost of the frame (cold - warm), ms", num(summary["prefill_ms_p50"])),
        ("frame, prompt tokens p50", num(summary["frame_tokens_p50"], 0)),
        ("quotes whose frame was partly cached", pct(summary["cached_share"])),
        ("stop reasons", ", ".join(f"{k or '?'} {v}" for k, v in summary["stop_reasons"].items())),
    ]
    print(table(["figure", "value"], rows))
    print("\nSamples (the first ten of the blind sheet):")
    for sample in summary["samples"]:
        print(f"- {sample}")
    print(f"\nBlind sheet, key and raw quotes: {summary['out']}")


def score(directory: Path, guesses_file: Path) -> None:
    key: dict[str, str] = json.loads((directory / "key.json").read_text())
    names = {slug: slug for slug in key.values()}
    right = total = 0
    for line in guesses_file.read_text().splitlines():
        number, _, guess = line.strip().partition(" ")
        if number not in key or not guess:
            continue
        slug = names.get(guess.strip()) or guess.strip().lower().replace(" ", "-")
        total += 1
        right += slug == key[number]
    print(f"{right} of {total} right ({right / total:.0%}); chance 1 in {len(set(key.values()))}")


#: What a coherence reader is asked, at the head of the sheet.
COHERENCE_RULE = """\
For each quote, answer y or n: is it coherent and on topic? y only when all of these hold:
- it reads as sensible English from start to end: no sentence that contradicts itself, trails off
  or means nothing, no confusion of who or what is spoken of;
- it says something about the topic named (a metaphor about it counts; a passing mention does not);
- it would pass as a quote a reader could accept, whoever said it (style does not matter, nor
  whether you agree with it).
Write one line per quote, `number y` or `number n`, in a text file."""


def coherence_sheet(out: Path, runs: list[Path], seed: int) -> None:
    """One blind sheet of all the runs' quotes, shuffled together (topic and text only), for a
    reader to judge coherent and on topic; the key (number: run and persona) apart."""
    rows = []
    for run_dir in runs:
        for line in (run_dir / "quotes.jsonl").read_text().splitlines():
            quote = json.loads(line)
            if quote["text"] and not quote["error"]:
                rows.append((run_dir.name, quote))
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    sheet = ["# Coherence sheet", "", COHERENCE_RULE, ""]
    sheet += [f"{n}. *{q['topic']}*: {q['text']}" for n, (_, q) in enumerate(rows, 1)]
    (out / "coherence-sheet.md").write_text("\n".join(sheet) + "\n")
    key = {str(n): {"run": run, "persona": q["persona"]} for n, (run, q) in enumerate(rows, 1)}
    (out / "coherence-key.json").write_text(json.dumps(key, indent=1) + "\n")
    print(f"{len(rows)} quotes from {len(runs)} runs: {out / 'coherence-sheet.md'}")


def coherence_score(out: Path, verdict_files: list[Path]) -> None:
    """Each run's share judged coherent and on topic, per reader and by all readers together."""
    key = json.loads((out / "coherence-key.json").read_text())
    runs = sorted({row["run"] for row in key.values()})
    verdicts = []
    for path in verdict_files:
        marks = {}
        for line in path.read_text().splitlines():
            number, _, mark = line.strip().partition(" ")
            if number in key and mark.strip()[:1].lower() in ("y", "n"):
                marks[number] = mark.strip()[:1].lower() == "y"
        missing = len(key) - len(marks)
        if missing:
            print(f"{path}: {missing} quotes without a verdict (left out)")
        verdicts.append(marks)
    header = ["run", *(p.stem for p in verdict_files), "all readers say y", "mean"]
    rows = []
    for run in runs:
        numbers = [n for n, row in key.items() if row["run"] == run]
        cells = [run]
        for marks in verdicts:
            judged = [marks[n] for n in numbers if n in marks]
            cells.append(f"{sum(judged)} of {len(judged)} ({_share(judged):.0%})")
        both = [all(m[n] for m in verdicts) for n in numbers if all(n in m for m in verdicts)]
        cells.append(f"{sum(both)} of {len(both)} ({_share(both):.0%})")
        cells.append(f"{_mean([_share(m[n] for n in numbers if n in m) for m in verdicts]):.0%}")
        rows.append(cells)
    print(table(header, rows))
    if len(verdicts) > 1:
        common = [n for n in key if all(n in m for m in verdicts)]
        agree = sum(len({m[n] for m in verdicts}) == 1 for n in common)
        print(f"readers agree on {agree} of {len(common)} ({agree / len(common):.0%})")


def remeasure(directory: Path, examples_from: Path) -> dict[str, Any]:
    """The text figures of an earlier run again, from its quotes.jsonl (its timings kept), with
    the examples of the seed migration: after a change to the measures, or for old code's runs."""
    quotes = [Quote(**json.loads(line)) for line in (directory / "quotes.jsonl").read_text().splitlines()]
    examples = {slug: parse_lines(text) for slug, text in seed_examples(examples_from).items()}
    summary = json.loads((directory / "summary.json").read_text())
    summary.update(measure(quotes, examples, len({q.persona for q in quotes})))
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["out"] = str(directory)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-persona", type=int, default=2, help="quotes per persona on each topic")
    parser.add_argument("--topics", default=DEFAULT_TOPICS, help="comma-separated")
    parser.add_argument("--personas", default="", help="comma-separated slugs (default: all active)")
    parser.add_argument("--max-tokens", type=int, default=0, help="override the personas' budget")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--repeat-penalty", type=float)
    parser.add_argument("--examples", type=int, help="use only the first K examples")
    parser.add_argument("--order", choices=("given", "reversed", "shuffled"), default="given")
    parser.add_argument("--no-examples", action="store_true", help="the shared frame, as before issue 23")
    parser.add_argument("--max-sentences", type=int, help="end a quote after this many sentences (0: never)")
    parser.add_argument("--topic-bias", type=float, help="raise the topic's words by this much (logit bias)")
    parser.add_argument(
        "--lead", type=int, choices=(0, 1), help="open each quote with its topic's words (1) or not (0)"
    )
    parser.add_argument(
        "--semicolon-ends",
        action="store_true",
        help="a semicolon ends a sentence (the quote ends on a full stop)",
    )
    parser.add_argument(
        "--enough-words", type=int, help="end a quote after a sentence reaching this many words"
    )
    parser.add_argument(
        "--sampling",
        default="",
        help="llama.cpp defaults to change in this process, e.g. dry_multiplier=0.8,min_p=0.05 "
        "(quotes.backends.local.SAMPLING_DEFAULTS)",
    )
    parser.add_argument("--examples-from", default=str(SEED_MIGRATION), help=argparse.SUPPRESS)
    parser.add_argument("--timing", type=int, default=2, help="warm/cold rounds per persona (0: none)")
    parser.add_argument("--seed", type=int, default=23, help="for the blind sheet's order")
    parser.add_argument("--database", help="a DATABASE_URL (default: a fresh SQLite file)")
    parser.add_argument("--out", help="where the sheet, key and quotes go")
    parser.add_argument("--quiet", action="store_true", help="no line per quote as it is written")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--score", nargs=2, metavar=("RUN_DIR", "GUESSES"), help="score a reader's guesses")
    parser.add_argument("--measure", metavar="RUN_DIR", help="recompute an earlier run's text figures")
    parser.add_argument(
        "--coherence-sheet",
        nargs="+",
        metavar=("OUT", "RUN_DIR"),
        help="one blind sheet of these runs' quotes shuffled together, to judge coherent and on topic",
    )
    parser.add_argument(
        "--coherence-score", nargs="+", metavar=("OUT", "VERDICTS"), help="score readers' y/n verdicts"
    )
    args = parse_args(
        parser,
        argv,
        smoke={
            "per_persona": 1,
            "topics": "rain",
            "personas": "alan-watts,lao-tzu",
            "max_tokens": 8,
            "timing": 1,
            "quiet": True,
        },
    )
    if args.coherence_sheet:
        out, *runs = args.coherence_sheet
        coherence_sheet(Path(out), [Path(run) for run in runs], args.seed)
        return
    if args.coherence_score:
        out, *files = args.coherence_score
        coherence_score(Path(out), [Path(f) for f in files])
        return
    if args.score:
        score(Path(args.score[0]), Path(args.score[1]))
        return
    if args.measure:
        print_summary(remeasure(Path(args.measure), Path(args.examples_from)))
        return
    setup_django(args.database)
    from quotes.backends import local

    if args.max_sentences is not None:
        local.MAX_SENTENCES = args.max_sentences
    if args.topic_bias is not None:
        local.TOPIC_BIAS = args.topic_bias
    if args.enough_words is not None:
        local.ENOUGH_WORDS = args.enough_words
    if args.lead is not None:
        local.TOPIC_LEAD = bool(args.lead)
    if args.semicolon_ends:
        pattern = local._SENTENCE_END.pattern
        if "[.!?]" not in pattern:
            parser.error("--semicolon-ends: the sentence's end is no longer written [.!?]")
        local._SENTENCE_END = re.compile(pattern.replace("[.!?]", "[.!?;]", 1))
    if args.sampling:
        for item in args.sampling.split(","):
            name, _, value = item.partition("=")
            local.SAMPLING_DEFAULTS[name.strip()] = float(value) if "." in value else int(value)
    print(machine())
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)


if __name__ == "__main__":
    main()
