"""Model facts: context window, output limit, LoRA, prices, sampling ranges, doc links.

The Workers AI models are Cloudflare's, as its docs repository publishes them, in
workers_ai_models.json: a snapshot with its source (the files and their commits) that
scripts/refresh_catalog.py writes from a checkout of cloudflare/cloudflare-docs
(docs/deployment.md, section 8). It offers every active text-generation model that suits
short quotes; a retired one stays known as "retired on <date>, use <model>", with its last facts,
so old rows and personas still display and price. The embedded model is ours. `None` means no
figure is published: no price (beta models were billed at no charge), no context window.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from django.core.exceptions import ValidationError

from .base import SAMPLING_FIELDS

#: Our cap on a quote's length where Cloudflare documents no output limit.
OUR_OUTPUT_CAP = 2048
#: The model new personas get, and the seeded ones (docs/deployment.md, section 8).
DEFAULT_MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
LOCAL_MODEL = "gemma-3-270m"


@dataclass(frozen=True, slots=True)
class Range:
    low: float
    high: float

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int | float) and self.low <= value <= self.high

    def __str__(self) -> str:
        return f"{_number(self.low)} to {_number(self.high)}"


def _number(value: float) -> str:
    # 9999999999 stays 9999999999 (":g" would print 1e+10); 0.001 stays 0.001.
    return str(int(value)) if float(value).is_integer() else repr(value)


#: Where an input schema gives no range: Cloudflare's usual one.
USUAL_RANGES = {
    "temperature": Range(0, 5),
    "top_p": Range(0, 2),
    "top_k": Range(1, 50),
    "seed": Range(1, 9_999_999_999),
    "repetition_penalty": Range(0, 2),
    "frequency_penalty": Range(0, 2),
    "presence_penalty": Range(0, 2),
}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    name: str
    context_window: int | None
    #: USD per million tokens; None when no price is published.
    price_in_per_m: float | None
    price_out_per_m: float | None
    doc_url: str
    max_output_tokens: int = OUR_OUTPUT_CAP
    supports_lora: bool = False
    beta: bool = False
    backend: Literal["workers-ai", "local"] = "workers-ai"
    default_max_tokens: int = 256  # Cloudflare's, for every text-generation model
    #: set for a model Cloudflare retired: the day, and the model we move its personas to
    retired_on: dt.date | None = None
    successor: str = ""
    ranges: tuple[tuple[str, Range], ...] = tuple(USUAL_RANGES.items())

    def range(self, field: str) -> Range:
        return dict(self.ranges)[field]

    @property
    def label(self) -> str:
        """The model with what it costs and holds, for a choice in the admin."""
        if self.price_in_per_m is None or self.price_out_per_m is None:
            price = "price not published"
        elif self.price_in_per_m == self.price_out_per_m == 0:
            price = "free"
        else:
            price = f"${self.price_in_per_m:g} in / ${self.price_out_per_m:g} out per M tokens"
        window = f", {self.context_window // 1000}k context" if self.context_window else ""
        return f"{self.name} ({price}{window}{', beta' if self.beta else ''})"


def _cf_doc(model_id: str) -> str:
    return f"https://developers.cloudflare.com/workers-ai/models/{model_id.rsplit('/', 1)[-1]}/"


def _workers_ai(model_id: str, facts: dict[str, Any]) -> ModelInfo:
    window = facts.get("context_window")
    output = facts.get("max_output_tokens") or OUR_OUTPUT_CAP
    retired = facts.get("retired_on")
    ranges = {**USUAL_RANGES, **{name: Range(*bounds) for name, bounds in facts.get("ranges", {}).items()}}
    return ModelInfo(
        id=model_id,
        name=model_id.removeprefix("@cf/").removeprefix("@hf/"),
        context_window=window,
        price_in_per_m=facts.get("price_in_per_m"),
        price_out_per_m=facts.get("price_out_per_m"),
        doc_url=_cf_doc(model_id),
        max_output_tokens=min(output, window) if window else output,
        supports_lora=bool(facts.get("lora")),
        beta=bool(facts.get("beta")),
        retired_on=dt.date.fromisoformat(retired) if retired else None,
        successor=facts.get("successor", ""),
        ranges=tuple(ranges.items()),
    )


SNAPSHOT: dict[str, Any] = json.loads(Path(__file__).with_name("workers_ai_models.json").read_text())
#: The day the snapshot was taken from Cloudflare's docs.
SNAPSHOT_DATE = dt.date.fromisoformat(SNAPSHOT["source"]["date"])

MODELS: dict[str, ModelInfo] = {
    **{model_id: _workers_ai(model_id, facts) for model_id, facts in sorted(SNAPSHOT["models"].items())},
    # Loaded with n_ctx=1024 (its own is 32,768); llama.cpp takes top_p as a probability.
    LOCAL_MODEL: ModelInfo(
        id=LOCAL_MODEL,
        name="Gemma 3 270M (embedded)",
        context_window=1024,
        max_output_tokens=256,
        price_in_per_m=0.0,
        price_out_per_m=0.0,
        doc_url="https://huggingface.co/google/gemma-3-270m",
        backend="local",
        ranges=tuple({**USUAL_RANGES, "top_p": Range(0, 1)}.items()),
    ),
}
RETIRED: dict[str, ModelInfo] = {
    model_id: _workers_ai(model_id, facts) for model_id, facts in sorted(SNAPSHOT["retired"].items())
}


def get_model(model_id: str) -> ModelInfo | None:
    """An offered model's facts, or a retired one's last facts; None for an id nobody knows."""
    return MODELS.get(model_id) or RETIRED.get(model_id)


def is_workers_ai(model_id: str) -> bool:
    return model_id.startswith(("@cf/", "@hf/"))


def model_problem(model_id: str) -> str:
    """Why `model_id` cannot serve: retired by Cloudflare, or a Workers AI id the catalog does not
    know; "" when it can (or is not a Workers AI id: an OpenAI-compatible server's own name)."""
    retired = RETIRED.get(model_id)
    if retired is not None:
        return f"was retired by Cloudflare on {retired.retired_on}: use {retired.successor}"
    if is_workers_ai(model_id) and model_id not in MODELS:
        return f"is not in the Workers AI catalog (Cloudflare's docs of {SNAPSHOT_DATE})"
    return ""


def doc_url(model_id: str) -> str:
    """The model's documentation page: the catalog's, else Cloudflare's pattern for `@cf/` and
    `@hf/` ids, else an empty string."""
    info = get_model(model_id)
    if info is not None:
        return info.doc_url
    if is_workers_ai(model_id):
        return _cf_doc(model_id)
    return ""


def choices() -> list[tuple[str, str]]:
    """The offered models (never a retired one), with what they cost."""
    return [(m.id, m.label) for m in MODELS.values()]


def retired_error(model_id: str) -> ValidationError:
    info = RETIRED[model_id]
    return ValidationError(
        "%(model)s was retired by Cloudflare on %(day)s: choose another model, such as %(successor)s.",
        code="retired_model",
        params={"model": model_id, "day": info.retired_on, "successor": info.successor},
    )


def estimate_cost(model_id: str, prompt_tokens: int, completion_tokens: int) -> float | None:
    """USD for one request, or None when the model is unknown or has no published price."""
    info = get_model(model_id)
    if info is None or info.price_in_per_m is None or info.price_out_per_m is None:
        return None
    return (prompt_tokens * info.price_in_per_m + completion_tokens * info.price_out_per_m) / 1_000_000


def count_tokens_estimate(text: str) -> int:
    """About four characters a token (English): a check against a context window before
    sending; real counts come back in the stream's usage."""
    return (len(text) + 3) // 4


def validate_generation_settings(
    model_id: str, *, max_tokens: int, lora: str | None = None, **sampling: float | None
) -> dict[str, ValidationError]:
    """Per-field errors (for `ValidationError(errors)`) for one generation's settings against the
    model's documented limits; `None` is "not set", `sampling` is SAMPLING_FIELDS by name."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"not a sampling field: {', '.join(sorted(unknown))}")
    if model_id in RETIRED:
        return {"model": retired_error(model_id)}
    info = MODELS.get(model_id)
    if info is None:
        return {
            "model": ValidationError(
                "Unknown model %(model)s: choose one of the listed models.",
                code="unknown_model",
                params={"model": model_id},
            )
        }

    errors: dict[str, ValidationError] = {}
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= info.max_output_tokens
    ):
        errors["max_tokens"] = ValidationError(
            "max_tokens must be a whole number from 1 to %(high)s for %(model)s.",
            code="out_of_range",
            params={"high": info.max_output_tokens, "model": model_id},
        )

    for field in SAMPLING_FIELDS.values():
        value = sampling.get(field.name)
        if value is None:
            continue
        allowed = info.range(field.name)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (field.integer and not float(value).is_integer()) or value not in allowed:
            kind = "a whole number" if field.integer else "a number"
            errors[field.name] = ValidationError(
                "%(field)s must be %(kind)s from %(range)s for %(model)s.",
                code="out_of_range",
                params={"field": field.name, "kind": kind, "range": str(allowed), "model": model_id},
            )

    if lora is not None and not info.supports_lora:
        errors["lora"] = ValidationError(
            "lora is only accepted by LoRA-capable models (such as the -lora ones); "
            "%(model)s does not take an adapter.",
            code="lora_unsupported",
            params={"model": model_id},
        )
    elif lora is not None and not lora.strip():
        errors["lora"] = ValidationError("lora must name an adapter.", code="required")
    return errors
