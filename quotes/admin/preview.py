"""The persona admin's live preview: a quote streamed from the change form's unsaved values,
through the same path visitors use (admission, cache bypassed, a row marked as a preview)."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponseBase, JsonResponse, QueryDict

from .. import streams
from ..clients import Client
from ..encoders import WorkersAIEncoder, error_response, stream_response
from ..errors import ErrorCode, QuoteError, envelope
from ..models import Persona
from .forms import PersonaForm


class InvalidPersona(QuoteError):
    """The previewed values would not save; `fields` maps each field to its messages."""

    def __init__(self, fields: dict[str, list[str]]) -> None:
        summary = "; ".join(
            f"{name if name != '__all__' else 'form'}: {msgs[0]}" for name, msgs in fields.items()
        )
        super().__init__(ErrorCode.INVALID_PERSONA, f"Fix the form before previewing. {summary}", 400)
        self.fields = fields

    def response(self) -> JsonResponse:
        return JsonResponse(envelope(self.code, self.message, fields=self.fields), status=self.status)


def preview_persona(request: HttpRequest, saved: Persona) -> tuple[Persona, object]:
    """An unsaved copy of `saved` with the posted values, through the change form's own ModelForm
    (so never a value a save would refuse), and the topic: a JSON body {"fields", "topic"}, or a
    form post with `_preview_topic`."""
    data: QueryDict = request.POST
    topic = request.POST.get("_preview_topic")
    if request.content_type == "application/json":
        try:
            body = json.loads(request.body)
        except (ValueError, RecursionError):  # (RecursionError: nested deeper than Python recurses)
            raise QuoteError(ErrorCode.INVALID_JSON, "The body is not valid JSON.", 400) from None
        fields = body.get("fields") if isinstance(body, dict) else None
        if not isinstance(fields, dict):
            raise QuoteError(ErrorCode.INVALID_JSON, 'Send {"fields": {...}, "topic": "..."}.', 400)
        data = QueryDict(mutable=True)
        for key, value in fields.items():
            data.setlist(
                str(key),
                ["" if v is None else str(v) for v in (value if isinstance(value, list) else [value])],
            )
        topic = body.get("topic")
    form = PersonaForm(data=data, instance=saved)
    if not form.is_valid():
        raise InvalidPersona({name: [str(m) for m in messages] for name, messages in form.errors.items()})
    return form.instance, topic


async def stream_preview(
    request: HttpRequest, persona: Persona, topic: str, user_id: int
) -> HttpResponseBase:
    client = Client.of(request.META.get("REMOTE_ADDR") or "", user_id)
    try:
        quote = streams.Quote.of(persona, None, topic, fresh=True)
        stream = await streams.begin(client, transport="preview", quote=quote, preview=True)
    except QuoteError as exc:
        return error_response(exc)
    return await stream_response(stream, WorkersAIEncoder())
