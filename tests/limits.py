"""Helpers for tests of the gateway's per-client limits (QUOTES_GATEWAY)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any


def configure(settings: Any, **options: Any) -> None:
    """Change some of the gateway's settings (pytest-django's `settings`) for this test. A raised
    client rate limit raises the network's with it (as settings.py derives it), unless given."""
    rate = options.get("rate_limit")
    if rate is not None and "network_rate_limit" not in options:
        current = settings.QUOTES_GATEWAY.network_rate_limit
        options["network_rate_limit"] = (max(current[0], rate[0] * 6), rate[1])
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, **options)


async def at_start_of_window(window: int = 60, margin_s: float = 5.0) -> None:
    """Fixed-window limits reset on the window's edge: don't start a count right before it."""
    remaining = window - time.time() % window
    if remaining < margin_s:
        await asyncio.sleep(remaining + 0.05)
