"""The model catalog: Cloudflare's Workers AI models as its docs publish them (the snapshot that
scripts/refresh_catalog.py writes), each model's documented limits, prices and pages; retired models
known as retired; the cost estimate; the check of a persona's generation settings against its
model. The refresh itself is tested on a small docs tree of the same layout."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from harness.workers_ai import CATALOG as FAKE_CATALOG
from quotes.backends import catalog
from quotes.backends.catalog import (
    DEFAULT_MODEL,
    MODELS,
    RETIRED,
    SNAPSHOT,
    choices,
    count_tokens_estimate,
    doc_url,
    estimate_cost,
    get_model,
    model_problem,
    validate_generation_settings,
)
from scripts import refresh_catalog

pytestmark = pytest.mark.unit

DEMO = "@cf/google/gemma-2b-it-lora"
FP8 = "@cf/meta/llama-3.1-8b-instruct-fp8"
LLAMA_33 = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"
#: Retired by Cloudflare on 2026-05-30 (changelog 2026-05-08-planned-model-deprecations.mdx).
RETIRED_DEFAULT = "@cf/meta/llama-3.1-8b-instruct"


def validate(model: str = FP8, max_tokens: int = 16, **fields: object) -> dict[str, ValidationError]:
    return validate_generation_settings(model, max_tokens=max_tokens, **fields)  # type: ignore[arg-type]


def message(errors: dict[str, ValidationError], field: str) -> str:
    return ValidationError(errors).message_dict[field][0]


def test_the_snapshot_names_its_source_and_the_fake_reads_the_same_one() -> None:
    source = SNAPSHOT["source"]
    assert source["repository"] == "cloudflare/cloudflare-docs"
    assert dt.date.fromisoformat(source["date"]) == catalog.SNAPSHOT_DATE
    assert all(len(commit) == 40 for commit in source["files"].values())
    assert "src/content/changelog/workers-ai/2026-05-08-planned-model-deprecations.mdx" in source["files"]
    assert FAKE_CATALOG["source"] == source
    # Every offered model is one the fake knows the schema of; the retired are the same on both sides.
    assert {m for m in MODELS if m.startswith("@")} <= set(FAKE_CATALOG["schemas"])
    assert set(RETIRED) == set(FAKE_CATALOG["retired"])


def test_no_retired_model_is_offered_or_defaulted_and_each_has_an_offered_successor() -> None:
    offered = {model_id for model_id, _ in choices()}
    assert RETIRED_DEFAULT in RETIRED and RETIRED_DEFAULT not in offered
    assert not offered & set(RETIRED)
    assert DEFAULT_MODEL in offered and DEFAULT_MODEL not in RETIRED
    assert get_model(DEFAULT_MODEL).price_in_per_m is not None  # type: ignore[union-attr]  # the ceiling can count it
    for model in RETIRED.values():
        assert model.retired_on is not None and model.retired_on <= catalog.SNAPSHOT_DATE
        assert model.successor in offered, model.id
    # The -fast and -lora variants stay (the same changelog).
    assert {"@cf/meta/llama-3.1-8b-instruct-fast", DEMO, LLAMA_33} <= offered
    assert RETIRED[RETIRED_DEFAULT].successor == FP8
    assert str(RETIRED[RETIRED_DEFAULT].retired_on) == "2026-05-30"


def test_catalog_holds_each_models_documented_facts() -> None:
    for model in MODELS.values():
        assert 1 <= model.default_max_tokens <= model.max_output_tokens
        assert model.context_window is None or model.max_output_tokens <= model.context_window
        if model.backend == "workers-ai":
            assert model.id.startswith("@cf/") and model.default_max_tokens == 256
            assert model.supports_lora == model.id.endswith("-lora") or model.id == "@cf/qwen/qwq-32b"
    # The newer schemas: top_p from 0.001 to 1 and signed penalties on Llama 3.3; Llama 3.1 fp8's older ones.
    assert str(MODELS[LLAMA_33].range("top_p")) == "0.001 to 1"
    assert str(MODELS[LLAMA_33].range("frequency_penalty")) == "-2 to 2"
    assert str(MODELS[FP8].range("top_p")) == "0 to 2"
    assert (MODELS[FP8].context_window, MODELS[LLAMA_33].context_window) == (32000, 24000)
    local = MODELS["gemma-3-270m"]
    assert (local.backend, local.context_window, local.price_in_per_m, local.price_out_per_m) == (
        "local",
        1024,
        0,
        0,
    )


def test_model_problem_names_retired_and_unknown_workers_ai_models() -> None:
    assert model_problem(FP8) == "" and model_problem("gemma-3-270m") == ""
    assert model_problem("gpt-4o") == ""  # an OpenAI-compatible server's own name: not ours to judge
    assert model_problem(RETIRED_DEFAULT) == f"was retired by Cloudflare on 2026-05-30: use {FP8}"
    assert "not in the Workers AI catalog" in model_problem("@cf/nobody/nothing")


def test_get_model_doc_url_and_choices() -> None:
    assert get_model("@cf/nobody/nothing") is None
    assert get_model(DEMO) is MODELS[DEMO]
    assert get_model(RETIRED_DEFAULT) is RETIRED[RETIRED_DEFAULT]  # old rows and personas still display
    for model in [*MODELS.values(), *RETIRED.values()]:
        if model.backend == "workers-ai":
            name = model.id.rsplit("/", 1)[1]
            assert doc_url(model.id) == f"https://developers.cloudflare.com/workers-ai/models/{name}/"
    assert doc_url("@cf/qwen/qwq-32b") == "https://developers.cloudflare.com/workers-ai/models/qwq-32b/"
    assert doc_url("gpt-unknown") == ""
    assert doc_url("gemma-3-270m") == "https://huggingface.co/google/gemma-3-270m"
    labels = dict(choices())
    assert labels[FP8] == "meta/llama-3.1-8b-instruct-fp8 ($0.152 in / $0.287 out per M tokens, 32k context)"
    assert labels[DEMO] == "google/gemma-2b-it-lora (price not published, 8k context, beta)"
    assert labels["gemma-3-270m"] == "Gemma 3 270M (embedded) (free, 1k context)"


def test_estimate_cost_uses_per_million_prices() -> None:
    # llama-3.1-8b-instruct-fp8: $0.152 per M in, $0.287 per M out (pricing.mdx).
    assert estimate_cost(FP8, 1_000_000, 0) == pytest.approx(0.152)
    assert estimate_cost(FP8, 0, 1_000_000) == pytest.approx(0.287)
    assert estimate_cost(FP8, 1000, 500) == pytest.approx((1000 * 0.152 + 500 * 0.287) / 1e6)
    assert estimate_cost(FP8, 0, 0) == 0.0
    # A retired model keeps its last price: its old rows and an unmoved persona still price.
    assert estimate_cost(RETIRED_DEFAULT, 1_000_000, 1_000_000) == pytest.approx(0.282 + 0.827)
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
    assert validate(max_tokens=MODELS[FP8].max_output_tokens) == {}
    assert "max_tokens" in validate("gemma-3-270m", max_tokens=257)
    # Llama 3.3's newer schema: top_p from 0.001 to 1, signed OpenAI-style penalties.
    assert validate(LLAMA_33, top_p=0.001, frequency_penalty=-2) == {}
    assert set(validate(LLAMA_33, top_p=1.5, presence_penalty=-2.1)) == {"top_p", "presence_penalty"}
    assert "top_p" in validate(LLAMA_33, top_p=0)


def test_validate_names_an_unknown_model_and_refuses_a_retired_one() -> None:
    errors = validate("@cf/nobody/nothing", max_tokens=10)
    assert list(errors) == ["model"] and errors["model"].code == "unknown_model"
    assert "@cf/nobody/nothing" in message(errors, "model")
    errors = validate(RETIRED_DEFAULT, max_tokens=10)
    assert list(errors) == ["model"] and errors["model"].code == "retired_model"
    assert message(errors, "model") == (
        f"{RETIRED_DEFAULT} was retired by Cloudflare on 2026-05-30: choose another model, such as {FP8}."
    )


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
    temperature = catalog.USUAL_RANGES["temperature"]
    assert 0 in temperature and 5 in temperature
    assert 5.0001 not in temperature and "1" not in temperature


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


# -- the refresh, on a docs tree of Cloudflare's layout ------------------------------------------

CHAT_SCHEMA = {
    "type": "object",
    "oneOf": [
        {"title": "Prompt", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {
            "title": "Messages",
            "properties": {
                "messages": {"type": "array"},
                "temperature": {"type": "number", "minimum": 0, "maximum": 5},
                "top_p": {"type": "number", "minimum": 0.001, "maximum": 1},
            },
            "required": ["messages"],
        },
    ],
}


def model_file(name: str, *properties: tuple[str, object], schema: object = CHAT_SCHEMA) -> dict[str, object]:
    return {
        "name": name,
        "task": {"name": "Text Generation"},
        "properties": [{"property_id": key, "value": value} for key, value in properties],
        "schema": {"input": schema, "output": {}},
    }


def docs_tree(root: Path) -> Path:
    models = root / refresh_catalog.MODELS_DIR
    models.mkdir(parents=True)
    files = {
        "new.json": model_file("@cf/acme/new-8b", ("context_window", "64000")),
        "thinker.json": model_file("@cf/acme/thinker", ("reasoning", "true")),
        "old.json": model_file("@cf/acme/old-7b", ("context_window", "4096")),
        "later.json": model_file("@cf/acme/later", ("planned_deprecation_date", "2027-01-01")),
        "embed.json": {"name": "@cf/acme/embed", "task": {"name": "Text Embeddings"}, "schema": {}},
    }
    for name, content in files.items():
        (models / name).write_text(json.dumps(content))
    pricing = root / refresh_catalog.PRICING
    pricing.parent.mkdir(parents=True)
    pricing.write_text(
        "| Model | Price in Tokens | Price in Neurons |\n"
        "| @cf/acme/new-8b | $0.100 per M input tokens <br/> $0.200 per M output tokens | 1 <br/> 2 |\n"
        "| @cf/acme/old-7b | $0.300 per M input tokens <br/> $0.400 per M output tokens | 3 <br/> 4 |\n"
    )
    changelog = root / refresh_catalog.CHANGELOG_DIR / "2026-05-08-planned-model-deprecations.mdx"
    changelog.parent.mkdir(parents=True)
    changelog.write_text(
        "## Recommended replacements\n\n- [`@cf/acme/new-8b`](/x/) is newer.\n\n"
        "## Models deprecated on May 30, 2026\n\n- `@cf/acme/old-7b`\n\n## Variants that remain active\n\n"
        "- `@cf/acme/new-8b`\n"
    )
    return root


def refresh(
    docs: Path, day: dt.date, successor: str = "@cf/acme/new-8b"
) -> tuple[dict[str, Any], dict[str, Any]]:
    return refresh_catalog.build(docs, {"*": "c" * 40}, day, default_successor=successor)


def test_refresh_offers_active_chat_models_and_retires_what_the_changelog_lists(tmp_path: Path) -> None:
    docs = docs_tree(tmp_path)
    app, fake = refresh(docs, dt.date(2026, 11, 28))
    assert set(app["models"]) == {"@cf/acme/new-8b", "@cf/acme/later"}  # later: retires next year
    new = app["models"]["@cf/acme/new-8b"]
    assert (new["context_window"], new["price_in_per_m"], new["price_out_per_m"]) == (64000, 0.1, 0.2)
    assert new["ranges"] == {"temperature": [0, 5], "top_p": [0.001, 1]}
    assert app["not_offered"] == {"@cf/acme/thinker": "a reasoning model"}
    assert app["retired"]["@cf/acme/old-7b"] == {
        "context_window": 4096,
        "max_output_tokens": None,
        "price_in_per_m": 0.3,
        "price_out_per_m": 0.4,
        "lora": False,
        "beta": False,
        "ranges": {"temperature": [0, 5], "top_p": [0.001, 1]},
        "retired_on": "2026-05-30",
        "successor": "@cf/acme/new-8b",
    }
    assert fake["retired"] == ["@cf/acme/old-7b"] and "@cf/acme/embed" not in fake["schemas"]
    assert fake["schemas"]["@cf/acme/thinker"] == CHAT_SCHEMA  # the fake knows every model, verbatim
    assert set(app["source"]["files"]) == {
        *(f"{refresh_catalog.MODELS_DIR}/{name}.json" for name in ("new", "thinker", "old", "later")),
        refresh_catalog.PRICING,
        f"{refresh_catalog.CHANGELOG_DIR}/2026-05-08-planned-model-deprecations.mdx",
    }
    # Before the day, nothing was retired yet.
    app, _ = refresh(docs, dt.date(2026, 5, 29))
    assert "@cf/acme/old-7b" in app["models"] and not app["retired"]


def test_refresh_refuses_a_successor_it_does_not_offer(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="@cf/acme/old-7b is retired"):
        refresh(docs_tree(tmp_path), dt.date(2026, 11, 28), successor="@cf/acme/thinker")
