from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from quotes.ai import catalog
from quotes.ai.catalog import (
    MODELS,
    check_generation_settings,
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

REQUIRED = (
    DEMO,
    "@cf/meta/llama-2-7b-chat-int8",
    "@cf/meta/llama-2-7b-chat-fp16",
    "@cf/mistral/mistral-7b-instruct-v0.2-lora",
    LLAMA_31,
    LLAMA_33,
    "gemma-3-270m",
)


def messages(errors: dict[str, ValidationError]) -> dict[str, list[str]]:
    return ValidationError(errors).message_dict


def test_catalog_holds_the_demo_current_and_local_models() -> None:
    assert set(REQUIRED) <= set(MODELS)
    for model in MODELS.values():
        assert model.backend in ("workers-ai", "local")
        assert 1 <= model.default_max_tokens <= model.max_output_tokens
        assert model.max_output_tokens <= model.context_window
        # Every -lora model takes adapters; Gemma 3 12B does too, per its Cloudflare schema.
        assert model.supports_lora == ("-lora" in model.id or model.id == "@cf/google/gemma-3-12b-it")


def test_catalog_workers_ai_models_default_to_256_tokens_and_documented_ranges() -> None:
    for model in MODELS.values():
        if model.backend == "workers-ai":
            assert model.id.startswith("@cf/")
            assert model.default_max_tokens == 256
            assert (model.temperature.low, model.temperature.high) == (0, 5)
            assert (model.top_k.low, model.top_k.high) == (1, 50)
            assert (model.seed.low, model.seed.high) == (1, 9_999_999_999)
            assert (model.repetition_penalty.low, model.repetition_penalty.high) == (0, 2)
    assert (MODELS[LLAMA_31].top_p.low, MODELS[LLAMA_31].top_p.high) == (0, 2)
    assert (MODELS[LLAMA_33].top_p.low, MODELS[LLAMA_33].top_p.high) == (0.001, 1)


def test_catalog_local_model_is_free_and_sized_for_our_context() -> None:
    local = get_model("gemma-3-270m")
    assert local is not None
    assert local.backend == "local"
    assert local.context_window == 1024
    assert local.price_in_per_m == local.price_out_per_m == 0.0
    assert local.doc_url == "https://huggingface.co/google/gemma-3-270m"


def test_get_model_unknown_is_none() -> None:
    assert get_model("@cf/nobody/nothing") is None
    assert get_model(DEMO) is MODELS[DEMO]


def test_doc_url_follows_cloudflares_pattern() -> None:
    assert doc_url(DEMO) == "https://developers.cloudflare.com/workers-ai/models/gemma-2b-it-lora/"
    assert doc_url(LLAMA_33) == (
        "https://developers.cloudflare.com/workers-ai/models/llama-3.3-70b-instruct-fp8-fast/"
    )
    for model in MODELS.values():
        if model.backend == "workers-ai":
            assert model.doc_url == (
                f"https://developers.cloudflare.com/workers-ai/models/{model.id.rsplit('/', 1)[1]}/"
            )


def test_doc_url_for_unknown_ids() -> None:
    assert doc_url("@cf/qwen/qwq-32b") == "https://developers.cloudflare.com/workers-ai/models/qwq-32b/"
    assert doc_url("gpt-unknown") == ""
    assert doc_url("gemma-3-270m") == "https://huggingface.co/google/gemma-3-270m"


def test_choices_list_every_model_once_for_a_select() -> None:
    pairs = choices()
    assert [value for value, _ in pairs] == list(MODELS)
    assert all(isinstance(label, str) and label for _, label in pairs)
    assert (DEMO, MODELS[DEMO].name) in pairs


def test_estimate_cost_uses_per_million_prices() -> None:
    # llama-3.1-8b-instruct: $0.282 per M in, $0.827 per M out.
    assert estimate_cost(LLAMA_31, 1_000_000, 0) == pytest.approx(0.282)
    assert estimate_cost(LLAMA_31, 0, 1_000_000) == pytest.approx(0.827)
    assert estimate_cost(LLAMA_31, 1000, 500) == pytest.approx((1000 * 0.282 + 500 * 0.827) / 1e6)
    assert estimate_cost(LLAMA_31, 0, 0) == 0.0


def test_estimate_cost_local_is_free_unknown_and_unpriced_are_none() -> None:
    assert estimate_cost("gemma-3-270m", 500, 60) == 0.0
    assert estimate_cost("@cf/nobody/nothing", 10, 10) is None
    assert estimate_cost(DEMO, 10, 10) is None  # beta model: no published price


def test_count_tokens_estimate_is_about_four_chars_per_token() -> None:
    assert count_tokens_estimate("") == 0
    assert count_tokens_estimate("abcd") == 1
    assert count_tokens_estimate("abcde") == 2
    assert count_tokens_estimate("x" * 4000) == 1000


def test_validate_accepts_documented_extremes() -> None:
    assert (
        validate_generation_settings(
            LLAMA_31,
            max_tokens=1,
            temperature=0,
            top_p=2,
            top_k=50,
            seed=9_999_999_999,
            repetition_penalty=2,
            frequency_penalty=0,
            presence_penalty=2,
        )
        == {}
    )
    assert validate_generation_settings(DEMO, max_tokens=256, lora="my-adapter") == {}
    assert validate_generation_settings(LLAMA_31, max_tokens=MODELS[LLAMA_31].max_output_tokens) == {}


def test_validate_unknown_model() -> None:
    errors = validate_generation_settings("@cf/nobody/nothing", max_tokens=10)
    assert list(errors) == ["model"]
    assert errors["model"].code == "unknown_model"
    assert "@cf/nobody/nothing" in messages(errors)["model"][0]


@pytest.mark.parametrize("max_tokens", [0, -1, 2049, 1.5, True])
def test_validate_max_tokens_bounds(max_tokens: int) -> None:
    errors = validate_generation_settings(LLAMA_31, max_tokens=max_tokens)
    assert list(errors) == ["max_tokens"]
    assert "max_tokens" in messages(errors)["max_tokens"][0]
    assert "1 to 2048" in messages(errors)["max_tokens"][0]


def test_validate_max_tokens_uses_the_models_own_limit() -> None:
    assert validate_generation_settings("@cf/meta/llama-2-7b-chat-int8", max_tokens=1800) == {}
    assert "max_tokens" in validate_generation_settings("@cf/meta/llama-2-7b-chat-int8", max_tokens=1801)
    assert "max_tokens" in validate_generation_settings("gemma-3-270m", max_tokens=257)


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
        errors = validate_generation_settings(LLAMA_31, max_tokens=16, **{field: value})  # type: ignore[arg-type]
        assert list(errors) == [field]
        assert errors[field].code == "out_of_range"
        text = messages(errors)[field][0]
        assert field in text
        assert shown in text


def test_validate_newer_models_use_their_own_schema() -> None:
    assert "top_p" in validate_generation_settings(LLAMA_33, max_tokens=16, top_p=0)
    assert "top_p" in validate_generation_settings(LLAMA_33, max_tokens=16, top_p=1.5)
    assert validate_generation_settings(LLAMA_33, max_tokens=16, top_p=0.001) == {}
    # Llama 3.3's schema allows signed OpenAI-style penalties.
    assert validate_generation_settings(LLAMA_33, max_tokens=16, frequency_penalty=-2) == {}
    assert "presence_penalty" in validate_generation_settings(LLAMA_33, max_tokens=16, presence_penalty=-2.1)


@pytest.mark.parametrize(("field", "value"), [("top_k", 2.5), ("seed", 10.5), ("temperature", "hot")])
def test_validate_rejects_wrong_types(field: str, value: object) -> None:
    errors = validate_generation_settings(LLAMA_31, max_tokens=16, **{field: value})  # type: ignore[arg-type]
    assert list(errors) == [field]


def test_validate_rejects_nan() -> None:
    assert "temperature" in validate_generation_settings(LLAMA_31, max_tokens=16, temperature=float("nan"))


def test_validate_lora_only_on_lora_models() -> None:
    errors = validate_generation_settings(LLAMA_31, max_tokens=16, lora="my-adapter")
    assert list(errors) == ["lora"]
    assert errors["lora"].code == "lora_unsupported"
    assert "lora" in messages(errors)["lora"][0]
    assert (
        validate_generation_settings("@cf/mistral/mistral-7b-instruct-v0.2-lora", max_tokens=16, lora="a")
        == {}
    )
    assert "lora" in validate_generation_settings(DEMO, max_tokens=16, lora="  ")


def test_validate_reports_every_bad_field_at_once() -> None:
    errors = validate_generation_settings(LLAMA_31, max_tokens=0, temperature=9, top_k=99, lora="x")
    assert set(errors) == {"max_tokens", "temperature", "top_k", "lora"}


def test_check_generation_settings_raises_a_per_field_error() -> None:
    check_generation_settings(LLAMA_31, max_tokens=16, temperature=1)
    with pytest.raises(ValidationError) as caught:
        check_generation_settings(LLAMA_31, max_tokens=16, temperature=6)
    assert list(caught.value.message_dict) == ["temperature"]


def test_range_contains_is_inclusive() -> None:
    assert 0 in catalog.TEMPERATURE
    assert 5 in catalog.TEMPERATURE
    assert 5.0001 not in catalog.TEMPERATURE
    assert "1" not in catalog.TEMPERATURE
