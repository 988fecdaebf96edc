"""System checks: personas and settings on a Workers AI model Cloudflare retired, or on a Workers AI
id the catalog does not know. `manage.py check` says the settings'; `manage.py check --database
default` the personas' too; the server logs both once at start (quotes.ops.server)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections
from django.db.migrations.recorder import MigrationRecorder

from .backends.catalog import model_problem

#: The migration that moves personas off retired models: until it ran, `migrate` will.
MOVED_OFF_RETIRED = ("quotes", "0015_models_of_today")


@checks.register()
def settings_on_retired_models(
    *, app_configs: Sequence[AppConfig] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    return [
        checks.Warning(
            f"QUOTES_FALLBACK_MODELS names {model}, which {problem}.",
            hint="Change QUOTES_FALLBACK_MODELS in the environment.",
            id="quotes.W010",
        )
        for model in settings.QUOTES_FALLBACK_MODELS
        if (problem := model_problem(model))
    ]


@checks.register(checks.Tags.database)
def personas_on_retired_models(
    *, app_configs: Sequence[AppConfig] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    from .models import Persona

    messages: list[checks.CheckMessage] = []
    for alias in databases or ():
        try:
            if MOVED_OFF_RETIRED not in MigrationRecorder(connections[alias]).applied_migrations():
                continue
            personas = list(Persona.objects.using(alias).only("slug", "model", "fallback_models"))
        except DatabaseError:
            continue  # not migrated, or unreachable: nothing to say about its personas
        for persona in personas:
            fallbacks = persona.fallback_models if isinstance(persona.fallback_models, list) else []
            for role, model in [("model", persona.model), *(("fallback", m) for m in fallbacks)]:
                if isinstance(model, str) and (problem := model_problem(model)):
                    messages.append(
                        checks.Warning(
                            f"Persona {persona.slug!r}: its {role} {model} {problem}.",
                            hint="Choose another model in the persona's admin page.",
                            obj=persona,
                            id="quotes.W011",
                        )
                    )
    return messages
