"""What a server process holds in memory for its event loop, in one object: its streams, its
admission counts, its rate limiter and spend counters (and their Redis connections), its row
writer, its sockets. Each module asks for its part by type (`of(RowWriter)`), made on first use.
One loop per server process; a test's loop has its own, which `reset()` closes at the test's end.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Process:
    """One event loop's parts, by type. A part with `aclose()` is closed with it; one whose
    `CLOSE_FIRST` is true (the streams: their ends write rows) before the others."""

    def __init__(self) -> None:
        self.parts: dict[type[Any], Any] = {}

    def get(self, kind: type[T]) -> T:
        part = self.parts.get(kind)
        if part is None:
            part = self.parts[kind] = kind()
        return part

    async def close(self) -> None:
        parts = sorted(self.parts.values(), key=lambda part: not getattr(part, "CLOSE_FIRST", False))
        for part in parts:
            if (close := getattr(part, "aclose", None)) is not None:
                await close()


_processes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Process] = weakref.WeakKeyDictionary()


def of(kind: type[T]) -> T:
    """The running event loop's `kind` part."""
    loop = asyncio.get_running_loop()
    process = _processes.get(loop)
    if process is None:
        process = _processes[loop] = Process()
    return process.get(kind)


def every(kind: type[T]) -> Iterator[T]:
    """Each loop's `kind` part that exists (at exit, once nothing answers any more)."""
    return iter([process.parts[kind] for process in list(_processes.values()) if kind in process.parts])


async def reset() -> None:
    """Close this loop's parts, and forget them: the next use starts afresh (a test's end)."""
    process = _processes.pop(asyncio.get_running_loop(), None)
    if process is not None:
        await process.close()
