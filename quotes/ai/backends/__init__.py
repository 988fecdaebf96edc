"""Backends: one module per upstream. Each turns a GenerationRequest into a stream of events."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from ..events import Event, GenerationRequest


class HasBackend(Protocol):
    """A persona, as far as choosing its backend goes (backends know no Django models)."""

    @property
    def backend(self) -> str: ...


class Backend(Protocol):
    #: the name in settings and in the log: "local", "workers-ai", "openai"
    name: str

    def stream(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        """Yield Meta/Token/Usage events and end with exactly one Done or Error.

        Cancellation (the consumer stops iterating, or the task is cancelled) must stop the
        upstream work at once: close the HTTP response, or stop the model thread.
        """
        ...

    def model_name(self, requested: str) -> str:
        """The model that will actually answer a request for `requested`."""
        ...

    async def aclose(self) -> None:
        """Release process-wide resources (HTTP pools, threads)."""
        ...


_backends: dict[str, Backend] = {}


def get_backend(name: str | None = None) -> Backend:
    """The process-wide backend for `name` (default: settings.AI_BACKEND), made on first use."""
    from django.conf import settings

    name = name or settings.AI_BACKEND
    backend = _backends.get(name)
    if backend is None:
        backend = _backends[name] = _make_backend(name)
    return backend


def backend_for(persona: HasBackend) -> Backend:
    """The backend that answers for `persona`: its own, or settings.AI_BACKEND when it names none.

    The one place this is decided: the page's model name, the context-window check, the admin
    preview and the gateway must all agree on it."""
    return get_backend(persona.backend or None)


def loaded_backends() -> list[Backend]:
    """The backends this process has made so far (none is made by asking)."""
    return list(_backends.values())


def _make_backend(name: str) -> Backend:
    from django.conf import settings

    if name == "local":
        from .local import LocalBackend

        return LocalBackend.from_settings(settings.LOCAL_MODEL)
    if name == "workers-ai":
        from .workers_ai import WorkersAIBackend

        return WorkersAIBackend(
            workers_ai=settings.WORKERS_AI, gateway=settings.AI_GATEWAY, http=settings.AI_HTTP
        )
    if name == "openai":
        from .openai_compat import OpenAICompatBackend

        return OpenAICompatBackend(
            base_url=settings.OPENAI_COMPAT.base_url,
            api_key=settings.OPENAI_COMPAT.api_key,
            http=settings.AI_HTTP,
        )
    raise ValueError(f"unknown backend {name!r}")


async def reset_backends() -> None:
    """Close and forget every backend (tests use this after changing settings)."""
    backends = list(_backends.values())
    _backends.clear()
    for backend in backends:
        await backend.aclose()
