"""Backends: one module per upstream, each turning a GenerationRequest (quotes.backends.base)
into a stream of events. `backend_for(persona)` is the one place that decides which backend
answers for a persona."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from .base import Backend
from .local import LocalBackend
from .openai_compat import OpenAICompatBackend
from .workers_ai import WorkersAIBackend

_KINDS: dict[str, Any] = {
    "local": LocalBackend,
    "workers-ai": WorkersAIBackend,
    "openai": OpenAICompatBackend,
}
_backends: dict[str, Backend] = {}


def get_backend(name: str | None = None) -> Backend:
    """The process's backend called `name` (default: settings.AI_BACKEND), made on first use."""
    name = name or settings.AI_BACKEND
    backend = _backends.get(name)
    if backend is None:
        if name not in _KINDS:
            raise ValueError(f"unknown backend {name!r}")
        backend = _backends[name] = _KINDS[name].from_settings()
    return backend


def backend_for(persona: Any) -> Backend:
    return get_backend(persona.backend or None)


def loaded_backends() -> list[Backend]:
    return list(_backends.values())


async def reset_backends() -> None:
    """Close and forget every backend (after a change of settings, and at exit)."""
    backends = list(_backends.values())
    _backends.clear()
    for backend in backends:
        await backend.aclose()
