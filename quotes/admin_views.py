"""What the persona admin does beyond Django's stock views: versions with authors, a readable
diff between versions, roll-back, and the live preview of unsaved form values.

The admin classes in admin.py wire these in; the import/export commands reuse `persona_save`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from django.http import HttpRequest, HttpResponseBase, JsonResponse, QueryDict

from .ai.backends import get_backend
from .ai.conversation import check_context_window
from .ai.errors import ErrorCode, QuoteError, envelope
from .ai.gateway import stream_generation
from .forms import PersonaForm
from .models import GENERATION_FIELDS, Persona, PersonaVersion

# --- saving with an author and a note ----------------------------------------------------------


def persona_save(*, persona: Persona, created_by: Any = None, note: str = "") -> PersonaVersion | None:
    """Save `persona`; when that makes a new version, it records who made it and why."""
    persona.save(version_note=note, version_author=created_by)
    return persona.saved_version


def persona_rollback(*, persona: Persona, version: PersonaVersion, user: Any) -> PersonaVersion | None:
    """Apply `version`'s configuration to `persona` and save it as a new version.

    Raises ValidationError when the old configuration is no longer valid (say, a model left the
    catalog); returns None when the persona already has exactly that configuration.
    """
    if version.persona_id != persona.pk:
        raise ValueError("That version belongs to another persona.")
    for name in GENERATION_FIELDS:
        if name in version.config:
            setattr(persona, name, version.config[name])
    persona.full_clean()
    return persona_save(persona=persona, created_by=user, note=f"rollback to v{version.number}")


# --- the diff between two versions -----------------------------------------------------------

LineKind = Literal["add", "remove", "same"]


@dataclass(frozen=True, slots=True)
class DiffLine:
    kind: LineKind
    text: str

    @property
    def sign(self) -> str:
        return {"add": "+", "remove": "-", "same": " "}[self.kind]


@dataclass(slots=True)
class FieldDiff:
    name: str
    lines: list[DiffLine] = field(default_factory=list)


def _display(value: object) -> str:
    if value is None:
        return "(not set)"
    if value == "":
        return "(empty)"
    if isinstance(value, list):
        return ", ".join(str(item) for item in value) if value else "(none)"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _text_lines(value: object) -> list[str]:
    return _display(value).splitlines() or [""]


def config_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> list[FieldDiff]:
    """The fields that differ between two version configs, line by line (every field when
    there is no older version). Plain text: the template escapes it."""
    names = [n for n in GENERATION_FIELDS if n in new or (old and n in old)]
    names += sorted(set(new) - set(names))
    diffs = []
    for name in names:
        after = new.get(name)
        if old is None:
            diffs.append(FieldDiff(name, [DiffLine("add", line) for line in _text_lines(after)]))
            continue
        before = old.get(name)
        if before == after:
            continue
        a, b = _text_lines(before), _text_lines(after)
        lines: list[DiffLine] = []
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if tag == "equal":
                lines += [DiffLine("same", line) for line in a[i1:i2]]
                continue
            lines += [DiffLine("remove", line) for line in a[i1:i2]]
            lines += [DiffLine("add", line) for line in b[j1:j2]]
        diffs.append(FieldDiff(name, lines))
    return diffs


@dataclass(slots=True)
class VersionEntry:
    version: PersonaVersion
    diffs: list[FieldDiff]
    is_current: bool


def version_history(persona: Persona) -> list[VersionEntry]:
    """The persona's versions, newest first, each with its diff against the one before."""
    versions = list(persona.versions.select_related("created_by").order_by("-number"))
    current = persona.generation_config()
    entries = []
    for index, version in enumerate(versions):
        older = versions[index + 1] if index + 1 < len(versions) else None
        entries.append(
            VersionEntry(
                version=version,
                diffs=config_diff(older.config if older else None, version.config),
                is_current=version.config == current,
            )
        )
    return entries


# --- live preview --------------------------------------------------------------------------------


class InvalidPersona(QuoteError):
    """The previewed form values would not save; `fields` maps each field to its messages."""

    def __init__(self, fields: dict[str, list[str]]) -> None:
        summary = "; ".join(
            f"{name if name != '__all__' else 'form'}: {messages[0]}" for name, messages in fields.items()
        )
        super().__init__(ErrorCode.INVALID_PERSONA, f"Fix the form before previewing. {summary}", 400)
        self.fields = fields

    def response(self) -> JsonResponse:
        return JsonResponse(envelope(self.code, self.message, fields=self.fields), status=self.status)


def _form_data(request: HttpRequest) -> tuple[QueryDict, object]:
    """The posted form fields and topic: a JSON body {"fields": {...}, "topic": ...} (what the
    admin page sends) or an ordinary form post with a `_preview_topic` field."""
    if request.content_type == "application/json":
        try:
            body = json.loads(request.body)
        except ValueError:
            raise QuoteError(ErrorCode.INVALID_JSON, "The body is not valid JSON.", 400) from None
        fields = body.get("fields") if isinstance(body, dict) else None
        if not isinstance(fields, dict):
            raise QuoteError(ErrorCode.INVALID_JSON, 'Send {"fields": {...}, "topic": "..."}.', 400)
        data = QueryDict(mutable=True)
        for key, value in fields.items():
            values = value if isinstance(value, list) else [value]
            data.setlist(str(key), ["" if v is None else str(v) for v in values])
        return data, body.get("topic")
    return request.POST, request.POST.get("_preview_topic")


def preview_persona(request: HttpRequest, saved: Persona) -> tuple[Persona, object]:
    """An unsaved copy of `saved` carrying the posted form values, and the posted topic.

    Raises InvalidPersona listing each field's errors when the values
    would not pass the change form. Runs the same ModelForm as the change form, so the preview
    can never use a value a save would refuse.
    """
    data, topic = _form_data(request)
    form = PersonaForm(data=data, instance=saved)
    if not form.is_valid():
        raise InvalidPersona({name: [str(m) for m in messages] for name, messages in form.errors.items()})
    # is_valid() copied the cleaned values onto the instance; it is never saved.
    return form.instance, topic


async def stream_preview(request: HttpRequest, persona: Persona, topic: str) -> HttpResponseBase:
    """Stream a quote from the unsaved persona through the same path visitors use."""
    from .views import client_of, error_response, stream_response

    try:
        check_context_window(
            persona.build_request(topic=topic),
            model=get_backend(persona.backend or None).model_name(persona.model),
        )
    except QuoteError as exc:
        return error_response(exc)
    events = stream_generation(
        persona=persona, topic=topic, client=await client_of(request), preview=True, transport="preview"
    )
    return await stream_response(events)
