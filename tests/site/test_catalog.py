"""The model catalog: each model's documented limits, prices and pages; the cost estimate; the
check of a persona's generation settings against its model."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from quotes.backends import catalog
from quotes.backends.catalog import (
    MODELS,
    choices,
    count_tokens_estimate,
    doc_url,
    estimate_cost,
    get_model,
    validate_generation_settings,
)

pytestmark = pytest.mark.unit

DEMO = "@cf/google/gemma-2b-it-lora"
LLAMA_31 = "@cf/meta/llama-3.1-8b-instruct"
LLAMA_33 = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"
LLAMA_2 = "@cf/meta/llama-2-7b-chat-int8"


def validate(model: str = LLAMA_31, max_tokens: int = 16, **fields: object) -> dict[str, ValidationError]:
    return validate_generation_settings(model, max_tokens=max_tokens, **fields)  # type: ignore[arg-type]


def message(errors: dict[str, ValidationError], field: str) -> str:
    return ValidationError(errors).message_dict[field][0]


def test_catalog_holds_the_demo_current_and_local_models_with_their_documented_ranges() -> None:
    required = {DEMO, LLAMA_2, "@cf/meta/llama-2-7b-chat-fp16", "@cf/mistral/mistral-7b-instruct-v0.2-lora"}
    assert required | {LLAMA_31, LLAMA_33, "gemma-3-270m"} <= set(MODELS)
    for model in MODELS.values():
        assert 1 <= model.default_max_tokens <= model.max_output_tokens <= model.context_window
        # Every -lora model takes adapters; Gemma 3 12B does too, per its Cloudflare schema.
        assert model.supports_lora == ("-lora" in model.id or model.id == "@cf/google/gemma-3-12b-it")
        if model.backend == "workers-ai":
            assert model.id.startswith("@cf/") and model.default_max_tokens == 256
            assert (model.temperature.low, model.temperature.high, model.top_k.low, model.top_k.high) == (
                0,
                5,
                1,
                50,
            )
            assert (model.seed.low, model.seed.high) == (1, 9_999_999_999)
            assert (model.repetition_penalty.low, model.repetition_penalty.high) == (0, 2)
        else:
            assert model.backend == "local"
    assert (MODELS[LLAMA_31].top_p.low, MODELS[LLAMA_31].top_p.high) == (0, 2)
    assert (MODELS[LLAMA_33].top_p.low, MODELS[LLAMA_33].top_p.high) == (0.001, 1)
    local = MODELS["gemma-3-270m"]
    assert (local.backend, local.context_window, local.price_in_per_m, local.price_out_per_m) == (
        "local",
        1024,
        0,
        0,
    )


def test_get_model_doc_url_and_choices() -> None:
    assert get_model("@cf/nobody/nothing") is None
    assert get_model(DEMO) is MODELS[DEMO]
    for model in MODELS.values():
        if model.backend == "workers-ai":
            name = model.id.rsplit("/", 1)[1]
            assert doc_url(model.id) == f"https://developers.cloudflare.com/workers-ai/models/{name}/"
    assert doc_url("@cf/qwen/qwq-32b") == "https://developers.cloudflare.com/workers-ai/models/qwq-32b/"
    assert doc_url("gpt-unknown") == ""
    assert doc_url("gemma-3-270m") == "https://huggingface.co/google/gemma-3-270m"
    assert choices() == [(model.id, model.name) for model in MODELS.values()]
    assert all(label for _, label in choices())


def test_estimate_cost_uses_per_million_prices() -> None:
    # llama-3.1-8b-instruct: $0.282 per M in, $0.827 per M out.
    assert estimate_cost(LLAMA_31, 1_000_000, 0) == pytest.approx(0.282)
    assert estimate_cost(LLAMA_31, 0, 1_000_000) == pytest.approx(0.827)
    assert estimate_cost(LLAMA_31, 1000, 500) == pytest.approx((1000 * 0.282 + 500 * 0.827) / 1e6)
    assert estimate_cost(LLAMA_31, 0, 0) == 0.0
    # The embedded model is free; an unknown model, or a beta one with no published price: no figure.
    assert estimate_cost("gemma-3-270m", 500, 60) == 0.0
    assert estimate_cost("@cf/nobody/nothing", 10, 10) is None
    assert estimate_cost(DEMO, 10, 10) is None


def test_count_tokens_estimate_is_about_four_chars_per_token() -> None:
    assert [count_tokens_estimate(text) for text in ("", "abcd", "abcde", "x" * 4000)] == [0, 1, 2, 1000]


def test_validate_accepts_the_documented_extremes_and_each_models_own_limit() -> None:
    extremes = {"temperature": 0, "top_p": 2, "top_k": 50, "seed": 9_999_999_999}
    extremes |= {"repetition_penalty": 2, "frequency_penalty": 0, "presence_penalty": 2}
    assert validate(max_tokens=1, **extremes) == {}
    assert validate(DEMO, max_tokens=256, lora="my-adapter") == {}
    assert validate(max_tokens=MODELS[LLAMA_31].max_output_tokens) == {}
    assert validate(LLAMA_2, max_tokens=1800) == {}
    assert "max_tokens" in validate(LLAMA_2, max_tokens=1801)
    assert "max_tokens" in validate("gemma-3-270m", max_tokens=257)
    # Llama 3.3's newer schema: top_p from 0.001 to 1, signed OpenAI-style penalties.
    assert validate(LLAMA_33, top_p=0.001, frequency_penalty=-2) == {}
    assert set(validate(LLAMA_33, top_p=1.5, presence_penalty=-2.1)) == {"top_p", "presence_penalty"}
    assert "top_p" in validate(LLAMA_33, top_p=0)


def test_validate_names_an_unknown_model() -> None:
    errors = validate("@cf/nobody/nothing", max_tokens=10)
    assert list(errors) == ["model"] and errors["model"].code == "unknown_model"
    assert "@cf/nobody/nothing" in message(errors, "model")


@pytest.mark.parametrize("max_tokens", [0, 2049, 1.5, True])
def test_validate_max_tokens_bounds(max_tokens: int) -> None:
    errors = validate(max_tokens=max_tokens)
    assert list(errors) == ["max_tokens"]
    assert "max_tokens" in message(errors, "max_tokens") and "1 to 2048" in message(errors, "max_tokens")


@pytest.mark.parametrize(
    ("field", "below", "above", "shown"),
    [
        ("temperature", -0.01, 5.01, "0 to 5"),
        ("top_p", -0.01, 2.01, "0 to 2"),
        ("top_k", 0, 51, "1 to 50"),
        ("seed", 0, 10_000_000_000, "1 to 9999999999"),
        ("repetition_penalty", -0.01, 2.01, "0 to 2"),
        ("frequency_penalty", -0.01, 2.01, "0 to 2"),
        ("presence_penalty", -0.01, 2.01, "0 to 2"),
    ],
)
def test_validate_sampling_bounds_both_sides(field: str, below: float, above: float, shown: str) -> None:
    for value in (below, above):
        errors = validate(**{field: value})
        assert list(errors) == [field] and errors[field].code == "out_of_range"
        assert field in message(errors, field) and shown in message(errors, field)


def test_validate_rejects_wrong_types_and_nan_and_ranges_are_inclusive() -> None:
    for field, value in [
        ("top_k", 2.5),
        ("seed", 10.5),
        ("temperature", "hot"),
        ("temperature", float("nan")),
    ]:
        assert list(validate(**{field: value})) == [field]
    assert 0 in catalog.TEMPERATURE and 5 in catalog.TEMPERATURE
    assert 5.0001 not in catalog.TEMPERATURE and "1" not in catalog.TEMPERATURE


def test_validate_takes_a_lora_only_on_lora_models_and_reports_every_bad_field() -> None:
    errors = validate(lora="my-adapter")
    assert list(errors) == ["lora"] and errors["lora"].code == "lora_unsupported"
    assert "lora" in message(errors, "lora")
    assert validate("@cf/mistral/mistral-7b-instruct-v0.2-lora", lora="a") == {}
    assert "lora" in validate(DEMO, lora="  ")
    assert set(validate(max_tokens=0, temperature=9, top_k=99, lora="x")) == {
        "max_tokens",
        "temperature",
        "top_k",
        "lora",
    }
