"""System checks: personas and settings on a Workers AI model Cloudflare retired, or on a Workers AI
id the catalog does not know. `manage.py check` says the settings'; `manage.py check --database
default` the personas' too; the server logs both once at start (quotes.ops.server). And Django's
own security checks, made to see the middleware of quotes.ops.middleware."""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections
from django.db.migrations.recorder import MigrationRecorder
from django.test.utils import override_settings
from django.utils.module_loading import import_string

from .backends.catalog import model_problem
from .ops.middleware import Inline

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


#: Django's warnings that its security, CSRF or X-Frame-Options middleware is missing: they look
#: for its dotted path in MIDDLEWARE, and settings list the same classes from
#: quotes.ops.middleware (subclasses that run without thread hops), so settings silence them and
#: `django_security_checks` gives them again, as quotes.security.W00n, when a class is missing.
MIDDLEWARE_MISSING = ("security.W001", "security.W002", "security.W003")
_rerun: ContextVar[bool] = ContextVar("rerun", default=False)


@checks.register(checks.Tags.security, deploy=True)
def django_security_checks(
    *, app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Django's security checks as if MIDDLEWARE named Django's own classes: the many that only
    run when they find its middleware (HSTS, the SSL redirect, X-Frame-Options, the CSRF cookie)
    judge the settings as they would with Django's paths; what they say beyond a plain run is
    said here."""
    if _rerun.get():
        return []
    token = _rerun.set(True)
    try:
        plain = checks.run_checks(app_configs, tags=[checks.Tags.security], include_deployment_checks=True)
        with override_settings(MIDDLEWARE=[django_path(path) for path in settings.MIDDLEWARE]):
            seen = checks.run_checks(app_configs, tags=[checks.Tags.security], include_deployment_checks=True)
    finally:
        _rerun.reset(token)
    return [_relabel(message) for message in seen if message.id in MIDDLEWARE_MISSING or message not in plain]


def django_path(path: str) -> str:
    """The dotted path of the class a quotes.ops.middleware class runs; else `path`."""
    cls = import_string(path)
    if not (isinstance(cls, type) and issubclass(cls, Inline)):
        return path
    shipped = cls.shipped()
    return f"{shipped.__module__}.{shipped.__qualname__}"


def _relabel(message: checks.CheckMessage) -> checks.CheckMessage:
    if message.id not in MIDDLEWARE_MISSING:
        return message
    return checks.CheckMessage(
        message.level, message.msg, hint=message.hint, obj=message.obj, id=f"quotes.{message.id}"
    )
