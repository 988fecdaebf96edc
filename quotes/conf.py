"""Typed shapes of the app's grouped settings.

config/settings.py reads the environment and builds these; code reads them as attributes
(`settings.QUOTES_GATEWAY.ttft_timeout_s`), so mypy catches a wrong name where a dict's string key
would fail at run time. This module imports nothing from Django (settings.py imports it before
any app is loaded). Tests override one field with `dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    max_concurrent_streams: int
    #: per process, whoever asks: past it a stream is refused at once (503 over_capacity)
    max_open_streams: int
    #: attempts at each model before the first token, and the delay between them
    max_attempts: int
    retry_delay_ms: int
    backoff: Backoff
    #: tried in order after a persona's own fallbacks, only before the first token
    fallback_models: Sequence[str]
    ttft_timeout_s: float
    idle_timeout_s: float
    total_timeout_s: float
    keepalive_s: float
    #: on SIGTERM, how long open streams may run on before they are told to resume elsewhere
    drain_timeout_s: float
