"""The persona form: the admin's change form, the live preview and nothing else build one."""

from __future__ import annotations

from django import forms

from .ai import catalog
from .models import Persona

_SAMPLING_HELP = "Leave empty for the model's default. The allowed range depends on the model."


def _lora_models() -> str:
    names = [m.name for m in catalog.MODELS.values() if m.supports_lora]
    return ", ".join(names) or "none"


class PersonaForm(forms.ModelForm[Persona]):
    """Every persona field, with the model and its fallbacks chosen from the catalog.

    Range checks live in `Persona.clean()` (the catalog's limits for the chosen model); a
    ModelForm puts each of its errors on the field it names.
    """

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
            "emoji",
            "system_prompt",
            "user_prompt_template",
            "default_topic",
            "backend",
            "model",
            "fallback_models",
            "lora",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "cache_ttl",
            "is_active",
            "display_order",
        )
        widgets = {
            "system_prompt": forms.Textarea(attrs={"rows": 4, "cols": 80}),
            "user_prompt_template": forms.Textarea(attrs={"rows": 3, "cols": 80}),
        }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fields["lora"].help_text = (
            "A fine-tuned adapter's id or name. Only LoRA-capable models take one: " + _lora_models() + "."
        )
        self.fields["max_tokens"].help_text = (
            "The answer's length limit; at most the model's output limit (e.g. 2048, 256 for the "
            "embedded model)."
        )
        for name in ("top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            self.fields[name].help_text = _SAMPLING_HELP

    def clean_fallback_models(self) -> list[str]:
        # Keep the catalog's order: that is the order the select lists them in.
        chosen = set(self.cleaned_data.get("fallback_models") or [])
        return [model_id for model_id, _ in catalog.choices() if model_id in chosen]
