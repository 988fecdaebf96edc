"""Helpers for tests of the gateway's per-client limits (QUOTES_GATEWAY)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any


def configure(settings: Any, **options: Any) -> None:
    """Change some of the gateway's settings (pytest-django's `settings`) for this test."""
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, **options)


async def at_start_of_window(window: int = 60, margin_s: float = 5.0) -> None:
    """Fixed-window limits reset on the window's edge: don't start a count right before it."""
    remaining = window - time.time() % window
    if remaining < margin_s:
        await asyncio.sleep(remaining + 0.05)
