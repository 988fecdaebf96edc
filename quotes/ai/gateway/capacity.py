"""How many streams this process takes at once: a limit that follows its own event loop's lag.

Every token of every stream passes through the one loop, so an overloaded loop slows them all
together, and how many it holds depends on the host: one timer (`_probe`) measures how late the
loop runs, and `GradientLimit` (after Netflix's Gradient2) follows it. See docs/deployment.md.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable

from django.conf import settings

from ...conf import GatewaySettings

PROBE_INTERVAL_S = 0.1
#: The limit a process starts with, before its loop has said anything.
INITIAL_LIMIT = 50
#: The lag the limit follows is the second-highest of this many samples (two seconds): about
#: their 90th percentile, with one stall (a garbage collection, a first import) left out.
LAG_WINDOW = 20
#: Share of a shrink's gradient one sample applies: a lag twice the target (or more) takes a
#: quarter off per sample.
SHRINK_SMOOTHING = 0.5
#: Weight of an ended stream's duration in the expected duration (Retry-After).
DURATION_SMOOTHING = 0.1
#: Retry-After while no stream has ended yet: about the time a short quote takes to stream.
DEFAULT_RETRY_AFTER_S = 5
#: Retry-After never says more than this: a guess further out is no guess.
MAX_RETRY_AFTER_S = 60


class OpenStreams:
    """The streams open in this process (what admission counts), when each opened, and its live
    generations (a run goes on for its resume grace with no connection: a drain waits for it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = 0
        self.runs = 0
        #: stream requests let in and neither admitted nor answered yet (admission.Entry)
        self.entering = 0
        #: set when both fall to 0 (made by a drain)
        self.emptied: asyncio.Event | None = None
        #: the most streams open or asked for since the limit's last sample
        self.peak = 0
        #: the smoothed duration of the streams that ended (None until one has)
        self.expected_s: float | None = None
        self._clock = clock
        self._serial = 0
        #: when each open stream opened, oldest first
        self._opened: dict[int, float] = {}

    def try_enter(self, limit: float) -> bool:
        self.peak = max(self.peak, self.count + self.entering + 1)
        if self.count + self.entering >= limit:
            return False
        self.entering += 1
        return True

    def open(self) -> int:
        """Open the stream of a request counted in `entering`: its slot, for `close`."""
        self.entering -= 1
        self.count += 1
        self._serial += 1
        self._opened[self._serial] = self._clock()
        return self._serial

    def close(self, slot: int) -> None:
        self.count -= 1
        opened = self._opened.pop(slot, None)  # a stream's clean-up never raises
        if opened is not None:
            held = self._clock() - opened
            expected = held if self.expected_s is None else self.expected_s  # the first sets it
            self.expected_s = expected + DURATION_SMOOTHING * (held - expected)
        self._check_empty()

    def run_started(self) -> None:
        self.runs += 1

    def run_ended(self) -> None:
        self.runs -= 1
        self._check_empty()

    def _check_empty(self) -> None:
        if not self.count and not self.runs and self.emptied is not None:
            self.emptied.set()

    def retry_after_s(self, limit: float) -> int:
        """Whole seconds until this process likely takes a new stream: until enough of its open
        streams, oldest first, are expected to have ended for the count to fall under `limit`."""
        if self.expected_s is None or not self._opened:
            return DEFAULT_RETRY_AFTER_S
        must_end = max(1, self.count - math.floor(limit) + 1)
        index = min(must_end, len(self._opened)) - 1
        opened = next(itertools.islice(self._opened.values(), index, None))
        remaining = opened + self.expected_s - self._clock()
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(remaining)))


class GradientLimit:
    """The adaptive limit's arithmetic, fed one lag sample at a time (no clock, no loop)."""

    def __init__(self, initial: float = INITIAL_LIMIT) -> None:
        self.limit = float(initial)
        #: the lag the limit follows (the second-highest of the last LAG_WINDOW samples), in seconds
        self.lag_s = 0.0
        self._recent = collections.deque([0.0] * LAG_WINDOW, maxlen=LAG_WINDOW)

    def observe(self, lag_s: float) -> float:
        """Add one lag sample to the window, and return the window's second-highest."""
        self._recent.append(lag_s)
        self.lag_s = heapq.nlargest(2, self._recent)[1]
        return self.lag_s

    def sample(self, lag_s: float, *, peak: int, target_s: float, floor: int, ceiling: int = 0) -> float:
        """One lag sample (seconds). `peak`: the most streams open or asked for since the last
        sample. `ceiling`: the static cap (0: none). Returns the new limit, which grows by its
        square root per sample (Gradient2's queue allowance) while the lag is under the target
        and shrinks towards what is held times target/lag at each late sample."""
        lag = self.observe(lag_s)
        limit = self.limit
        headroom = math.sqrt(limit)
        if lag <= target_s:
            # Grow only while the limit is what holds streams back: a limit far above what was
            # ever asked for says nothing about what the loop can hold.
            if peak + headroom >= limit:
                # Full steps while the loop is well under its target, smaller ones near it.
                limit += headroom * min(1.0, 2.0 * (1.0 - lag / target_s))
        elif lag_s > target_s:  # late lately, and now: each late sample shrinks it once
            gradient = max(0.5, target_s / lag)
            # From what is held, not from a limit never reached: streams are not taken back, so
            # only a limit under the open count stops more of them joining.
            held = min(limit, peak)
            limit = held * (1.0 - SHRINK_SMOOTHING * (1.0 - gradient))
        if ceiling:
            limit = min(limit, ceiling)
        self.limit = max(float(floor), limit)
        return self.limit


open_streams = OpenStreams()
gradient = GradientLimit()
#: The loop the lag probe times: a new loop (a test's) starts its own, the old one's stops.
_probed: asyncio.AbstractEventLoop | None = None


def _probe(loop: asyncio.AbstractEventLoop, due: float) -> None:
    """A timer on the loop every PROBE_INTERVAL_S, feeding how late it fired to the limit: one
    timer per process, nothing per token."""
    if loop is not _probed:
        return
    now = loop.time()
    lag_s = max(0.0, now - due)
    options: GatewaySettings = settings.QUOTES_GATEWAY
    if options.loop_lag_target_ms > 0:
        gradient.sample(
            lag_s,
            peak=open_streams.peak,
            target_s=options.loop_lag_target_ms / 1000,
            floor=options.min_open_streams,
            ceiling=options.max_open_streams,
        )
    else:
        gradient.observe(lag_s)  # shown in /metrics all the same
    open_streams.peak = open_streams.count
    due = now + PROBE_INTERVAL_S
    loop.call_at(due, _probe, loop, due)


def limit_now(options: GatewaySettings) -> float:
    """The number of streams this process admits now (infinity: no limit). Starts the lag probe in
    the running loop, with the adaptive limit off too: /metrics still shows the lag."""
    global _probed
    loop = asyncio.get_running_loop()
    if loop is not _probed:
        _probed = loop
        due = loop.time() + PROBE_INTERVAL_S
        loop.call_at(due, _probe, loop, due)
    return current_limit(options)


def current_limit(options: GatewaySettings) -> float:
    """`limit_now`, read only (for /metrics): the adaptive limit within the optional ceiling, or
    the ceiling alone with the adaptive limit off."""
    ceiling = options.max_open_streams or math.inf
    if options.loop_lag_target_ms <= 0:
        return ceiling
    # The floor holds before the first sample too (the limit starts at INITIAL_LIMIT).
    return min(max(options.min_open_streams, math.floor(gradient.limit)), ceiling)


def reset() -> None:
    """Start over (a test's fresh process): the initial limit, no lag, no durations."""
    global gradient
    gradient = GradientLimit()
    open_streams.expected_s = None
    open_streams.peak = open_streams.count
