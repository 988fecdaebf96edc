from __future__ import annotations

import string

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from .ai.events import GenerationRequest, Message

TEMPLATE_VARIABLES = frozenset({"topic"})


def validate_prompt_template(value: str) -> None:
    """A user-prompt template may only use the known variables, e.g. `{topic}`."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
    except ValueError as exc:
        raise ValidationError(
            f"The template is not valid: {exc}. Write a literal brace as {{{{ or }}}}."
        ) from exc
    unknown = sorted({name for name in fields if name not in TEMPLATE_VARIABLES})
    if unknown:
        allowed = ", ".join("{" + name + "}" for name in sorted(TEMPLATE_VARIABLES))
        raise ValidationError(
            f"Unknown variable {', '.join('{' + n + '}' for n in unknown)}; use only {allowed}."
        )


class PersonaQuerySet(models.QuerySet["Persona"]):
    def active(self) -> PersonaQuerySet:
        return self.filter(is_active=True)


class Persona(models.Model):
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100, unique=True)
    description = models.CharField(max_length=200, blank=True)
    emoji = models.CharField(max_length=8, blank=True)
    system_prompt = models.TextField()
    user_prompt_template = models.TextField(
        validators=[validate_prompt_template],
        help_text="The user prompt. {topic} is replaced with the visitor's topic.",
    )
    default_topic = models.CharField(max_length=200)
    model = models.CharField(
        max_length=200,
        default="@cf/meta/llama-3.1-8b-instruct",
        help_text="A model from the catalog. The embedded model stands in for it when no Cloudflare credentials are set.",
    )
    lora = models.CharField(
        "LoRA adapter",
        max_length=200,
        blank=True,
        help_text="A fine-tuned adapter's id or name; only LoRA-capable models (the -lora ones) take one.",
    )
    max_tokens = models.PositiveIntegerField(
        default=96, validators=[MinValueValidator(1), MaxValueValidator(4096)]
    )
    temperature = models.FloatField(default=0.7, validators=[MinValueValidator(0.0), MaxValueValidator(5.0)])
    is_active = models.BooleanField(default=True)
    display_order = models.IntegerField(default=0)

    objects = PersonaQuerySet.as_manager()

    class Meta:
        ordering = ["display_order", "name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        from .ai.catalog import validate_generation_settings

        errors = validate_generation_settings(
            self.model, max_tokens=self.max_tokens, temperature=self.temperature, lora=self.lora or None
        )
        if errors:
            raise ValidationError(errors)

    def user_prompt(self, topic: str) -> str:
        # str.replace, not str.format: a topic is visitor input and must never be formatted.
        return self.user_prompt_template.replace("{topic}", topic)

    def build_request(self, *, topic: str, messages: tuple[Message, ...] = ()) -> GenerationRequest:
        chat = (
            Message("system", self.system_prompt),
            Message("user", self.user_prompt(topic)),
            *messages,
        )
        return GenerationRequest(
            model=self.model,
            messages=chat,
            speaker=self.name,
            topic=topic,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            lora=self.lora or None,
        )


class Generation(models.Model):
    """One row per stream request: the request log."""

    class Status(models.TextChoices):
        OK = "ok", "ok"
        ERROR = "error", "error"
        CANCELLED = "cancelled", "cancelled"
        RATE_LIMITED = "rate_limited", "rate-limited"
        BUSY = "busy", "busy"

    persona = models.ForeignKey(Persona, on_delete=models.PROTECT, related_name="generations")
    backend = models.CharField(max_length=20)
    model = models.CharField(max_length=200)
    topic = models.CharField(max_length=500, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices)
    error_code = models.CharField(max_length=50, blank=True)
    error_message = models.TextField(blank=True)
    text = models.TextField(blank=True)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.FloatField("time to first token (ms)", null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    request = models.JSONField(default=dict, blank=True)
    upstream_headers = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.persona} · {self.status} · {self.created_at:%Y-%m-%d %H:%M}"
