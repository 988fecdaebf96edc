"""The persona form (the admin's change form and its live preview), and the analytics' range."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django import forms
from django.utils import timezone

from ..backends import catalog
from ..backends.base import GENERATION_FIELDS, SAMPLING_FIELDS
from ..models import Persona
from .analytics import MAX_RANGE, PRESET_RANGES


class PersonaForm(forms.ModelForm[Persona]):
    """Every persona field, the models chosen from the catalog; `Persona.clean()` checks ranges."""

    model = forms.ChoiceField(
        choices=catalog.choices,
        help_text="From the model catalog. The embedded model stands in for it when no Cloudflare "
        "credentials are set.",
    )
    fallback_models = forms.MultipleChoiceField(
        choices=catalog.choices,
        required=False,
        widget=forms.SelectMultiple(attrs={"size": 6}),
        help_text="Tried, in the order listed, when the model fails before its first token. "
        "Hold Ctrl (⌘ on a Mac) to pick several.",
    )

    class Meta:
        model = Persona
        fields = (
            "name",
            "slug",
            "description",
            *GENERATION_FIELDS,
            "cache_ttl",
            "is_active",
            "display_order",
        )
        widgets = {
            "system_prompt": forms.Textarea(attrs={"rows": 4, "cols": 80}),
            "user_prompt_template": forms.Textarea(attrs={"rows": 3, "cols": 80}),
            "voice_examples": forms.Textarea(attrs={"rows": 8, "cols": 100}),
        }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        lora_models = ", ".join(m.name for m in catalog.MODELS.values() if m.supports_lora) or "none"
        self.fields[
            "lora"
        ].help_text = f"A fine-tuned adapter's id or name. Only LoRA-capable models take one: {lora_models}."
        self.fields["max_tokens"].help_text = (
            "The answer's length limit; at most the model's output limit (e.g. 2048, 256 for the "
            "embedded model)."
        )
        for field in SAMPLING_FIELDS.values():
            if field.help_text:
                self.fields[field.name].help_text = field.help_text
        # A persona on a retired model (or fallback) shows it, marked, so the form can say why it
        # is refused rather than "not one of the available choices".
        current = self.initial.get("model")
        fallbacks = self.initial.get("fallback_models")
        set_now = [current, *(fallbacks if isinstance(fallbacks, list) else [])]
        retired = [
            catalog.RETIRED[m] for m in dict.fromkeys(set_now) if isinstance(m, str) and m in catalog.RETIRED
        ]
        marked = [(m.id, f"{m.id} (retired on {m.retired_on})") for m in retired]
        self.models = [*catalog.choices(), *marked]
        if marked:
            for name in ("model", "fallback_models"):
                choice = self.fields[name]
                assert isinstance(choice, forms.ChoiceField)
                choice.choices = self.models

    def clean_voice_examples(self) -> str:
        # A browser posts CRLF: stored so, the same examples would be a new version on every save.
        return str(self.cleaned_data.get("voice_examples") or "").replace("\r\n", "\n")

    def clean_fallback_models(self) -> list[str]:
        # In the catalog's order, as the select lists them.
        chosen = set(self.cleaned_data.get("fallback_models") or [])
        return [model_id for model_id, _ in self.models if model_id in chosen]


class StatsRangeForm(forms.Form):
    """The analytics page's GET parameters: a named range, or a custom from-to in whole days."""

    range = forms.ChoiceField(
        choices=[
            ("24h", "Last 24 hours"),
            ("7d", "Last 7 days"),
            ("30d", "Last 30 days"),
            ("custom", "Custom"),
        ],
        required=False,
    )
    start = forms.DateField(
        label="From", required=False, widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d")
    )
    end = forms.DateField(
        label="To", required=False, widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d")
    )
    bucket = forms.ChoiceField(
        choices=[("", "Auto"), ("hour", "Hour"), ("day", "Day")], required=False, label="Per"
    )
    previews = forms.BooleanField(label="Include previews", required=False)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        chosen = data.get("range") or ("custom" if data.get("start") or data.get("end") else "24h")
        data["range"] = chosen
        now = timezone.now()
        if chosen != "custom":
            data["since"], data["until"] = now - PRESET_RANGES[chosen], now
        else:
            start, end = data.get("start"), data.get("end")
            if start is None and "start" not in self.errors:
                self.add_error("start", "Choose the first day of the range.")
            if end is None and "end" not in self.errors:
                self.add_error("end", "Choose the last day of the range.")
            if start is None or end is None:
                return data
            if end < start:
                raise forms.ValidationError("The range ends before it starts: swap From and To.")
            # Before any arithmetic: the day after 9999-12-31 would be an OverflowError.
            if start > timezone.localdate(now):
                raise forms.ValidationError("The range starts in the future.")
            if (end - start).days + 1 > MAX_RANGE.days:
                raise forms.ValidationError(f"Choose at most {MAX_RANGE.days} days.")
            tz = timezone.get_current_timezone()
            since = dt.datetime.combine(start, dt.time.min, tzinfo=tz)
            until = dt.datetime.combine(end + dt.timedelta(days=1), dt.time.min, tzinfo=tz)
            data["since"], data["until"] = since, until
        if data.get("bucket") == "hour" and data["until"] - data["since"] > dt.timedelta(days=31):
            self.add_error("bucket", "Hourly buckets go up to 31 days; choose Day or Auto.")
        return data
