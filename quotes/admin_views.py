"""The persona admin's live preview of unsaved form values (admin.py wires it in). Saving,
versions and roll-back are quotes.services; the version history and its diffs quotes.selectors."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponseBase, JsonResponse, QueryDict

from .ai.backends import backend_for
from .ai.conversation import check_context_window
from .ai.errors import ErrorCode, QuoteError, envelope
from .ai.gateway.generation import stream_generation
from .forms import PersonaForm
from .models import Persona

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
    from .transports import WorkersAIEncoder, error_response, stream_response
    from .views import client_of

    try:
        check_context_window(
            persona.build_request(topic=topic),
            model=backend_for(persona).model_name(persona.model),
        )
    except QuoteError as exc:
        return error_response(exc)
    events = stream_generation(
        persona=persona, topic=topic, client=await client_of(request), preview=True, transport="preview"
    )
    return await stream_response(events, WorkersAIEncoder())
