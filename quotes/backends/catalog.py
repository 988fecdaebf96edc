"""Model facts in one table: context window, output limit, LoRA, prices, sampling ranges, doc links.

Sources: the cloudflare-docs repository (`src/content/workers-ai-models/*.json`,
`workers-ai/platform/pricing.mdx`) and shared/reference/workers-ai.md. Prices live here and
nowhere else; `None` means none is published (beta models were billed at no charge). The ranges
are each input schema's `minimum`/`maximum`. `max_output_tokens` is Cloudflare's documented
limit where there is one (Llama 2's, when streaming launched), else our cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from django.core.exceptions import ValidationError

from .base import SAMPLING_FIELDS

#: Our cap on a quote's length where Cloudflare documents no output limit.
_OUR_OUTPUT_CAP = 2048


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


TEMPERATURE = Range(0, 5)
TOP_P_OLD = Range(0, 2)
TOP_P_NEW = Range(0.001, 1)
TOP_K = Range(1, 50)
SEED = Range(1, 9_999_999_999)
PENALTY = Range(0, 2)
SIGNED_PENALTY = Range(-2, 2)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    name: str
    context_window: int
    #: USD per million tokens; None when no price is published.
    price_in_per_m: float | None
    price_out_per_m: float | None
    doc_url: str
    max_output_tokens: int = _OUR_OUTPUT_CAP
    supports_lora: bool = False
    backend: Literal["workers-ai", "local"] = "workers-ai"
    default_max_tokens: int = 256  # Cloudflare's, for every text-generation model
    temperature: Range = TEMPERATURE
    top_p: Range = TOP_P_OLD
    top_k: Range = TOP_K
    seed: Range = SEED
    repetition_penalty: Range = PENALTY
    frequency_penalty: Range = PENALTY
    presence_penalty: Range = PENALTY


def _cf_doc(model_id: str) -> str:
    return f"https://developers.cloudflare.com/workers-ai/models/{model_id.rsplit('/', 1)[-1]}/"


def _cf(model_id: str, name: str, **facts: object) -> ModelInfo:
    return ModelInfo(id=model_id, name=name, doc_url=_cf_doc(model_id), **facts)  # type: ignore[arg-type]


MODELS: dict[str, ModelInfo] = {
    m.id: m
    for m in (
        # The original persona-quote demo's model: beta, a LoRA base model; 8,192-token context.
        _cf(
            "@cf/google/gemma-2b-it-lora",
            "Gemma 2B IT (LoRA)",
            context_window=8192,
            supports_lora=True,
            price_in_per_m=None,
            price_out_per_m=None,
        ),
        _cf(
            "@cf/meta/llama-2-7b-chat-int8",
            "Llama 2 7B Chat (int8)",
            context_window=2048,
            max_output_tokens=1800,
            price_in_per_m=None,
            price_out_per_m=None,
        ),
        _cf(
            "@cf/meta/llama-2-7b-chat-fp16",
            "Llama 2 7B Chat (fp16)",
            context_window=3072,
            max_output_tokens=2500,
            price_in_per_m=0.556,
            price_out_per_m=6.667,
        ),
        # Beta LoRA base model. Cloudflare states no context window for it; 32,768 is
        # Mistral 7B v0.2's own (unconfirmed for Workers AI).
        _cf(
            "@cf/mistral/mistral-7b-instruct-v0.2-lora",
            "Mistral 7B Instruct v0.2 (LoRA)",
            context_window=32768,
            supports_lora=True,
            price_in_per_m=None,
            price_out_per_m=None,
        ),
        _cf(
            "@cf/meta/llama-3.1-8b-instruct",
            "Llama 3.1 8B Instruct",
            context_window=8192,
            price_in_per_m=0.282,
            price_out_per_m=0.827,
        ),
        _cf(
            "@cf/meta/llama-3.3-70b-instruct-fp8-fast",
            "Llama 3.3 70B Instruct (fp8, fast)",
            context_window=24000,
            price_in_per_m=0.293,
            price_out_per_m=2.253,
            top_p=TOP_P_NEW,
            frequency_penalty=SIGNED_PENALTY,
            presence_penalty=SIGNED_PENALTY,
        ),
        # Small and cheap. Context: Llama 3.2's 128k; the schema caps a prompt at 131,072 chars
        # (approximate for Workers AI).
        _cf(
            "@cf/meta/llama-3.2-3b-instruct",
            "Llama 3.2 3B Instruct",
            context_window=128000,
            price_in_per_m=0.051,
            price_out_per_m=0.335,
        ),
        _cf(
            "@cf/google/gemma-3-12b-it",
            "Gemma 3 12B IT",
            context_window=80000,
            supports_lora=True,
            price_in_per_m=0.345,
            price_out_per_m=0.556,
        ),
        _cf(
            "@cf/mistralai/mistral-small-3.1-24b-instruct",
            "Mistral Small 3.1 24B Instruct",
            context_window=128000,
            price_in_per_m=0.351,
            price_out_per_m=0.555,
        ),
        # Loaded with n_ctx=1024 (its own is 32,768); llama.cpp takes top_p as a probability.
        ModelInfo(
            id="gemma-3-270m",
            name="Gemma 3 270M (embedded)",
            context_window=1024,
            max_output_tokens=256,
            price_in_per_m=0.0,
            price_out_per_m=0.0,
            doc_url="https://huggingface.co/google/gemma-3-270m",
            backend="local",
            top_p=Range(0, 1),
        ),
    )
}


def get_model(model_id: str) -> ModelInfo | None:
    return MODELS.get(model_id)


def doc_url(model_id: str) -> str:
    """The model's documentation page: the catalog's, else Cloudflare's pattern for `@cf/` and
    `@hf/` ids, else an empty string."""
    info = MODELS.get(model_id)
    if info is not None:
        return info.doc_url
    if model_id.startswith(("@cf/", "@hf/")):
        return _cf_doc(model_id)
    return ""


def choices() -> list[tuple[str, str]]:
    return [(m.id, m.name) for m in MODELS.values()]


def estimate_cost(model_id: str, prompt_tokens: int, completion_tokens: int) -> float | None:
    """USD for one request, or None when the model is unknown or has no published price."""
    info = MODELS.get(model_id)
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
        allowed: Range = getattr(info, field.name)
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
