"""Whether Redis answers, as this process last found it: one breaker for every use of Redis (the
shared cache, the rate limits and slots, the runs shared across processes).

Redis is a cache and a coordinator here, never the source of truth. When a call to it fails or
times out (REDIS_SOCKET_TIMEOUT), the breaker opens for RETRY_S: meanwhile every caller skips
Redis at once and falls back to what this process can do alone (its own rate counts and slots,
no answer cache, no coalescing or resume across processes), so a Redis that is down or hung
costs each request at most one socket timeout, not one per call. The next call after RETRY_S
tries Redis again. One WARNING per outage, one INFO when Redis answers again.
"""

from __future__ import annotations

import logging
import threading
import time

from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

#: How long the process leaves Redis alone after a failure before it tries again.
RETRY_S = 2.0


class RedisUnavailable(ConnectionError):
    """Redis failed a moment ago: not asked again yet (the breaker is open)."""


class Breaker:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the cache's calls run on worker threads
        self.down_until = 0.0
        self.failing = False

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def check(self) -> None:
        """Raise RedisUnavailable while the breaker is open."""
        if time.monotonic() < self.down_until:
            raise RedisUnavailable("Redis failed a moment ago")

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self.down_until = time.monotonic() + RETRY_S
            first = not self.failing
            self.failing = True
        if first:
            logger.warning(
                "Redis is unavailable (%s); this process serves on its own until it answers",
                type(error).__name__,
            )

    def succeeded(self) -> None:
        if not self.failing:
            return
        with self._lock:
            first = self.failing
            self.failing = False
            self.down_until = 0.0
        if first:
            logger.info("Redis answers again; sharing across processes resumes")

    def reset(self) -> None:
        with self._lock:
            self.down_until = 0.0
            self.failing = False


breaker = Breaker()


def report(log: logging.Logger, message: str, error: BaseException) -> None:
    """Log a failed use of Redis or the cache: an outage (the breaker has said so, once) at DEBUG;
    anything else, which would be our bug, at ERROR with its traceback."""
    if isinstance(error, (RedisError, OSError)):
        log.debug("%s: %r", message, error)
    else:
        log.error("%s", message, exc_info=error)
