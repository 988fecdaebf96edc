from __future__ import annotations

import hashlib
import string
import uuid
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.dispatch import Signal

from .backends.base import GENERATION_FIELDS, SAMPLING_FIELDS, GenerationRequest, Message, VoiceExample
from .backends.catalog import DEFAULT_MODEL, RETIRED, get_model, retired_error, validate_generation_settings
from .backends.voice import example_problems, parse_examples

TEMPLATE_VARIABLES = frozenset({"topic"})

#: The topic a chat model is told an example without a topic was about.
UNTOPICAL = "anything at all"

BACKEND_CHOICES = [("local", "Embedded model"), ("workers-ai", "Workers AI"), ("openai", "OpenAI-compatible")]


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


def validate_voice_examples(value: str) -> None:
    problems = example_problems(value)
    if problems:
        raise ValidationError(problems)


#: Personas changed without a save() or delete() of each (a queryset update): quotes.personas
#: forgets them as on post_save.
personas_changed = Signal()


class PersonaQuerySet(models.QuerySet["Persona"]):
    def active(self) -> PersonaQuerySet:
        return self.filter(is_active=True)

    def update(self, **kwargs: Any) -> int:
        count = super().update(**kwargs)
        personas_changed.send(sender=Persona)
        return count

    def bulk_update(self, objs: Any, fields: Any, batch_size: int | None = None) -> int:
        count = super().bulk_update(objs, fields, batch_size=batch_size)
        personas_changed.send(sender=Persona)
        return count


class Persona(models.Model):
    """Who speaks, and what is sent to the model for them. Save and delete through
    quotes.services (versions; the log keeps pointing at a persona)."""

    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100, unique=True)
    description = models.CharField(max_length=200, blank=True)
    system_prompt = models.TextField()
    user_prompt_template = models.TextField(
        validators=[validate_prompt_template],
        help_text="The user prompt. {topic} is replaced with the visitor's topic.",
    )
    default_topic = models.CharField(max_length=200)
    voice_examples = models.TextField(
        blank=True,
        validators=[validate_voice_examples],
        help_text="A few short lines in this persona's voice, one per line as topic: line "
        "(e.g. water: Nothing is softer than water.). Before every quote the model is shown them as "
        "this persona's earlier quotes, and a quote never copies eight words in a row from one. "
        "Lines starting with # are notes, e.g. the edition quoted.",
    )
    backend = models.CharField(
        max_length=20,
        choices=BACKEND_CHOICES,
        blank=True,
        help_text="Leave empty for the site's backend (AI_BACKEND).",
    )
    model = models.CharField(
        max_length=200,
        default=DEFAULT_MODEL,
        help_text="A model from the catalog. The embedded model stands in for it when no Cloudflare credentials are set.",
    )
    fallback_models = models.JSONField(
        default=list,
        blank=True,
        help_text="Models tried in order when the model fails before its first token.",
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
    top_p = models.FloatField(null=True, blank=True)
    top_k = models.PositiveIntegerField(null=True, blank=True)
    seed = models.BigIntegerField(null=True, blank=True)
    repetition_penalty = models.FloatField(null=True, blank=True)
    frequency_penalty = models.FloatField(null=True, blank=True)
    presence_penalty = models.FloatField(null=True, blank=True)
    cache_ttl = models.PositiveIntegerField(
        "cache TTL (s)",
        null=True,
        blank=True,
        help_text="Overrides the site's cache TTL for this persona's quotes. 0 turns caching off.",
    )
    daily_spend_limit_usd = models.DecimalField(
        "daily spend ceiling (USD)",
        max_digits=10,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="The most this persona's quotes may cost on paid models in one day (UTC). "
        "Empty: only the site's ceiling applies.",
    )
    is_active = models.BooleanField(default=True)
    display_order = models.IntegerField(default=0)

    objects = PersonaQuerySet.as_manager()

    class Meta:
        ordering = ["display_order", "name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors = validate_generation_settings(
            self.model, max_tokens=self.max_tokens, lora=self.lora or None, **self.sampling()
        )
        fallbacks = self.fallback_models
        if not isinstance(fallbacks, list) or not all(isinstance(m, str) for m in fallbacks):
            errors["fallback_models"] = ValidationError("Fallback models must be a list of model ids.")
        else:
            unknown = [m for m in fallbacks if get_model(m) is None]
            retired = [m for m in fallbacks if m in RETIRED]
            if unknown:
                errors["fallback_models"] = ValidationError(f"Unknown model(s): {', '.join(unknown)}.")
            elif retired:
                errors["fallback_models"] = retired_error(retired[0])
            elif self.model in fallbacks:
                errors["fallback_models"] = ValidationError("A fallback must differ from the model itself.")
        if errors:
            raise ValidationError(errors)

    def sampling(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    def generation_config(self) -> dict[str, Any]:
        return {field: getattr(self, field) for field in GENERATION_FIELDS}

    def user_prompt(self, topic: str) -> str:
        # str.replace, not str.format: a topic is visitor input and must never be formatted.
        return self.user_prompt_template.replace("{topic}", topic)

    def examples(self) -> tuple[VoiceExample, ...]:
        return parse_examples(self.voice_examples)

    def build_request(
        self, *, topic: str, messages: tuple[Message, ...] = (), model: str | None = None
    ) -> GenerationRequest:
        examples = self.examples()
        # A chat model sees the examples as its own earlier answers (few-shot turns).
        shots = [
            turn
            for example in examples
            for turn in (
                Message("user", self.user_prompt(example.topic or UNTOPICAL)),
                Message("assistant", example.text),
            )
        ]
        chat = (
            Message("system", self.system_prompt),
            *shots,
            Message("user", self.user_prompt(topic)),
            *messages,
        )
        return GenerationRequest(
            model=model or self.model,
            messages=chat,
            speaker=self.name,
            topic=topic,
            description=self.description,
            max_tokens=self.max_tokens,
            **self.sampling(),
            lora=self.lora or None,
            examples=examples,
        )


class PersonaVersion(models.Model):
    """An immutable snapshot of what a persona sent to the model from `created_at` on."""

    persona = models.ForeignKey(Persona, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    config = models.JSONField()
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    is_draft = models.BooleanField(
        default=False,
        help_text="Saved from the form without going live: an experiment can try it on a share of readers.",
    )

    class Meta:
        ordering = ["persona", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["persona", "number"], name="unique_persona_version_number")
        ]

    def __str__(self) -> str:
        return f"{self.persona} v{self.number}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise ValueError("Persona versions are immutable; roll back to make a new one.")
        super().save(*args, **kwargs)


class Experiment(models.Model):
    """A draft version tried on a share of a persona's readers while the others get its live
    version; a reader keeps one arm for the experiment's life (`arm_of`). At most one runs per
    persona; it ends promoted (the draft made live) or ended."""

    LIVE, DRAFT = "live", "draft"

    class Outcome(models.TextChoices):
        RUNNING = "", "running"
        PROMOTED = "promoted", "draft promoted"
        ENDED = "ended", "ended"

    persona = models.ForeignKey(Persona, on_delete=models.CASCADE, related_name="experiments")
    draft = models.ForeignKey(PersonaVersion, on_delete=models.CASCADE, related_name="experiments")
    share = models.PositiveSmallIntegerField(
        "readers on the draft (%)", validators=[MinValueValidator(1), MaxValueValidator(99)]
    )
    started_at = models.DateTimeField(auto_now_add=True)
    started_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    ended_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=10, choices=Outcome.choices, blank=True)

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["persona"], condition=models.Q(ended_at__isnull=True), name="one_running_experiment"
            )
        ]

    def __str__(self) -> str:
        return f"{self.persona}: v{self.draft.number} to {self.share}%"

    def arm_of(self, reader: str) -> str:
        """The reader's arm: where a hash of the experiment and the reader falls, so the same reader
        always lands in the same arm and readers spread as the share says."""
        digest = hashlib.sha256(f"{self.pk}:{reader}".encode()).digest()
        return self.DRAFT if int.from_bytes(digest[:8], "big") % 100 < self.share else self.LIVE


class Generation(models.Model):
    """The request log, a row per generation: inserted `running`, completed once when it ends
    (quotes.rows); one left `running` past the total deadline is shown as lost."""

    class Status(models.TextChoices):
        RUNNING = "running", "running"
        OK = "ok", "ok"
        ERROR = "error", "error"
        CANCELLED = "cancelled", "cancelled"

    class CacheStatus(models.TextChoices):
        HIT = "hit", "hit"
        MISS = "miss", "miss"
        BYPASS = "bypass", "bypass"

    #: the id in the quote's public permalink: random, so quotes cannot be enumerated
    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    persona = models.ForeignKey(Persona, on_delete=models.PROTECT, related_name="generations")
    persona_version = models.ForeignKey(
        PersonaVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="generations"
    )
    experiment = models.ForeignKey(
        Experiment, null=True, blank=True, on_delete=models.SET_NULL, related_name="generations"
    )
    arm = models.CharField(
        max_length=5, blank=True, choices=[(Experiment.LIVE, "live"), (Experiment.DRAFT, "draft")]
    )
    backend = models.CharField(max_length=20)
    model = models.CharField(max_length=200, help_text="The model that actually answered.")
    fallback_step = models.PositiveSmallIntegerField(default=0, help_text="0: the primary model.")
    topic = models.CharField(max_length=500, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, db_index=True)
    cache_status = models.CharField(max_length=10, choices=CacheStatus.choices, blank=True)
    error_code = models.CharField(max_length=50, blank=True)
    error_message = models.TextField(blank=True)
    text = models.TextField(blank=True)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    cost_usd = models.DecimalField(
        "estimated cost (USD)", max_digits=12, decimal_places=8, null=True, blank=True
    )
    cost_estimated = models.BooleanField(
        "cost without usage",
        default=False,
        help_text="The upstream sent no token counts (a stop, a dropped or cut-off stream): the cost "
        "is the prompt, counted as the spend ceiling reserves it, plus the text streamed.",
    )
    ttft_ms = models.FloatField("time to first token (ms)", null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    request = models.JSONField(default=dict, blank=True)
    upstream_headers = models.JSONField(default=dict, blank=True)
    client_hash = models.CharField(max_length=64, blank=True, help_text="A salted hash of the client IP.")
    is_preview = models.BooleanField(default=False)
    feedback = models.SmallIntegerField(
        null=True,
        blank=True,
        choices=[(1, "👍"), (-1, "👎")],
        help_text="The visitors' verdict: the sign of the sum of their votes (one per visitor), "
        "empty when there are none or they cancel out.",
    )
    shared_at = models.DateTimeField(
        "first shared",
        null=True,
        blank=True,
        help_text="When its Permalink or Copy button was first used. Shared quotes are kept longer.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.persona} · {self.status} · {self.created_at:%Y-%m-%d %H:%M}"


class Refusal(models.Model):
    """Refused stream requests (429, 503) per persona, hour and code: no row each, so a flood of
    them cannot grow the log."""

    persona = models.ForeignKey(Persona, on_delete=models.CASCADE, related_name="refusals")
    hour = models.DateTimeField(db_index=True)
    code = models.CharField(max_length=50)
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["persona", "hour", "code"], name="one_count_per_hour")]

    def __str__(self) -> str:
        return f"{self.persona} · {self.code} · {self.count}"


class Vote(models.Model):
    """One visitor's thumbs up or down on one quote, which only they may change."""

    generation = models.ForeignKey(Generation, on_delete=models.CASCADE, related_name="votes")
    #: as limits count clients: "user:<id>", or "ip:<salted hash of the address or IPv6 network>"
    client_key = models.CharField(max_length=64)
    value = models.SmallIntegerField(choices=[(1, "👍"), (-1, "👎")])
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["generation", "client_key"], name="one_vote_per_client_per_quote")
        ]

    def __str__(self) -> str:
        return f"{self.generation_id} · {self.value:+d}"
