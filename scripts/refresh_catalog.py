"""Refresh the Workers AI model catalog from a checkout of Cloudflare's docs repository.

    git clone --depth 1 https://github.com/cloudflare/cloudflare-docs /tmp/cloudflare-docs
    .venv/bin/python scripts/refresh_catalog.py /tmp/cloudflare-docs [--commit SHA] [--date YYYY-MM-DD]
    git diff quotes/backends/workers_ai_models.json harness/workers_ai_models.json

It reads the model files (`src/content/workers-ai-models/*.json`), the LLM price table of
`src/content/docs/workers-ai/platform/pricing.mdx` and the Workers AI changelog
(`src/content/changelog/workers-ai/*.mdx`), and writes two snapshots, each with its source:

- quotes/backends/workers_ai_models.json, the app's catalog (quotes/backends/catalog.py): every
  active text-generation model that suits short quotes (below), with its context window, output
  limit, prices, LoRA and beta flags and sampling ranges; and every retired one as "retired on
  <date>, use <successor>", with its last known facts, so old rows and personas still price;
- harness/workers_ai_models.json, the fake Workers AI's (harness/workers_ai.py): each
  text-generation model's input schema, verbatim, and the retired ids, which it answers with
  error 5007 as Cloudflare does.

A model suits short quotes when it is a text-generation model, not retired, not a reasoning
model (it would spend a quote's few tokens thinking), not one made for code, maths or
moderation, and the body this site sends (messages, stream, max_tokens, temperature) is valid
against its input schema. The successor of a retired model is our choice (SUCCESSORS); the
script refuses one that is not offered.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
APP_SNAPSHOT = ROOT / "quotes/backends/workers_ai_models.json"
FAKE_SNAPSHOT = ROOT / "harness/workers_ai_models.json"
MODELS_DIR = "src/content/workers-ai-models"
PRICING = "src/content/docs/workers-ai/platform/pricing.mdx"
CHANGELOG_DIR = "src/content/changelog/workers-ai"

#: Made for something else than a quote in a voice.
NOT_FOR_QUOTES = re.compile(r"coder|math|guard|sqlcoder|-base\b|-base-|vision")

#: What a retired model's personas move to, and what the catalog tells an admin to use: the same
#: family where one is still offered (SEA-LION v4 is Gemma 3 27B, tuned), else a model of the same
#: price and size. Cloudflare's own
#: recommended replacements (glm-4.7-flash, gemma-4-26b-a4b-it, kimi-k2.6: the changelog of
#: 2026-05-08) are reasoning models, which spend a short quote's tokens thinking.
SUCCESSORS = {
    "@cf/meta/llama-3.1-70b-instruct": "@cf/meta/llama-3.3-70b-instruct-fp8-fast",
    "@cf/meta/llama-2-7b-chat-int8": "@cf/meta/llama-3.2-3b-instruct",
    "@cf/meta/llama-2-7b-chat-fp16": "@cf/meta/llama-3.2-3b-instruct",
    "@cf/microsoft/phi-2": "@cf/meta/llama-3.2-3b-instruct",
    "@cf/mistral/mistral-7b-instruct-v0.1": "@cf/mistralai/mistral-small-3.1-24b-instruct",
    "@hf/mistral/mistral-7b-instruct-v0.2": "@cf/mistralai/mistral-small-3.1-24b-instruct",
    "@cf/google/gemma-3-12b-it": "@cf/aisingapore/gemma-sea-lion-v4-27b-it",
    "@hf/google/gemma-7b-it": "@cf/aisingapore/gemma-sea-lion-v4-27b-it",
}

#: The successor of a retired model SUCCESSORS does not name: the site's default model.
DEFAULT_SUCCESSOR = "@cf/meta/llama-3.1-8b-instruct-fp8"

#: The body this site sends a Workers AI model (quotes/backends/workers_ai.py), at its smallest.
OUR_BODY = {
    "messages": [{"role": "system", "content": "You are Alan Watts"}, {"role": "user", "content": "A quote"}],
    "stream": True,
    "max_tokens": 96,
    "temperature": 0.7,
}
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)

_PRICE_ROW = re.compile(
    r"^\|\s*(?P<id>@(?:cf|hf)/\S+)\s*\|\s*\$(?P<input>[\d.]+) per M input tokens.*?"
    r"\$(?P<output>[\d.]+) per M output tokens",
    re.M,
)
#: A line that says when models are (or were) deprecated: a heading, a sentence or a list's lead.
_DEPRECATION_DATE = re.compile(
    r"(?P<month>[A-Z][a-z]+) (?P<day>\d{1,2})(?:st|nd|rd|th)?, (?P<year>\d{4})|(?P<iso>\d{4}-\d{2}-\d{2})"
)
_LIST_ITEM = re.compile(r"^\s*-\s+`?(?P<id>@(?:cf|hf)/[\w./-]+)`?(?:\s*-->\s*`(?P<alias>@(?:cf|hf)/[^`]+)`)?")
#: Where Cloudflare announces deprecations: the changelog's posts and the release notes.
ANNOUNCEMENTS = (f"{CHANGELOG_DIR}/*.md*", "src/content/release-notes/workers-ai.yaml")


def properties(model: dict[str, Any]) -> dict[str, Any]:
    return {item["property_id"]: item["value"] for item in model.get("properties", [])}


def prices(docs: Path) -> dict[str, tuple[float, float]]:
    text = (docs / PRICING).read_text()
    return {m["id"]: (float(m["input"]), float(m["output"])) for m in _PRICE_ROW.finditer(text)}


def retirements(docs: Path, today: dt.date) -> dict[str, dict[str, str]]:
    """The ids an announcement says were deprecated on a date up to `today`: {id: {on,
    announced[, alias]}}. A line that speaks of deprecation and names a date opens a list of ids
    (`- @cf/...`, `- `@cf/...` --> `@cf/...``: an alias); a heading or a new entry closes it. (An id
    named in a sentence is not listed: "we will be deprecating `@cf/x` on ..." was followed by a
    list in every later announcement, and sentences name replacements too.)"""
    retired: dict[str, dict[str, str]] = {}
    for pattern in ANNOUNCEMENTS:
        for path in sorted(docs.glob(pattern)):
            on: dt.date | None = None
            for line in path.read_text().splitlines():
                if line.lstrip().startswith(("#", "- publish_date")):
                    on = None
                date = _DEPRECATION_DATE.search(line)
                if "deprecat" in line.lower() and date is not None:
                    on = _date(date)
                elif on is not None and on <= today and (item := _LIST_ITEM.match(line)):
                    announced = {"on": on.isoformat(), "announced": str(path.relative_to(docs))}
                    retired.setdefault(item["id"], announced)
                    if item["alias"]:
                        retired[item["id"]].setdefault("alias", item["alias"])
    return retired


def _date(match: re.Match[str]) -> dt.date:
    if match["iso"]:
        return dt.date.fromisoformat(match["iso"])
    return dt.datetime.strptime(f"{match['month']} {match['day']} {match['year']}", "%B %d %Y").date()


def messages_variant(schema: dict[str, Any]) -> dict[str, Any]:
    """The variant of an input schema our body matches (its properties give the ranges)."""
    for variant in schema.get("oneOf", [schema]):
        try:
            jsonschema.validate(OUR_BODY, {**variant, "type": "object"})
        except jsonschema.ValidationError:
            continue
        return variant
    return {}


def ranges(variant: dict[str, Any]) -> dict[str, list[float]]:
    found = {}
    for name in SAMPLING:
        field = variant.get("properties", {}).get(name, {})
        if "minimum" in field and "maximum" in field:
            found[name] = [field["minimum"], field["maximum"]]
    return found


def facts(model: dict[str, Any], price: tuple[float, float] | None) -> dict[str, Any]:
    props = properties(model)
    for item in props.get("price") or []:
        if item.get("unit") == "per M input tokens":
            price = (float(item["price"]), price[1] if price else 0.0)
        elif item.get("unit") == "per M output tokens":
            price = (price[0] if price else 0.0, float(item["price"]))
    variant = messages_variant(model.get("schema", {}).get("input", {}))
    max_tokens = variant.get("properties", {}).get("max_tokens", {})
    window = props.get("context_window")
    return {
        "context_window": int(window) if window else None,
        "max_output_tokens": max_tokens.get("maximum"),
        "price_in_per_m": price[0] if price else None,
        "price_out_per_m": price[1] if price else None,
        "lora": props.get("lora") == "true",
        "beta": props.get("beta") == "true",
        "ranges": ranges(variant),
    }


def unsuitable(model: dict[str, Any]) -> str:
    """Why a text-generation model does not suit short quotes, or ""."""
    props = properties(model)
    if props.get("reasoning") == "true":
        return "a reasoning model"
    if NOT_FOR_QUOTES.search(model["name"]):
        return "made for code, maths, moderation or images"
    if not messages_variant(model.get("schema", {}).get("input", {})):
        return "its input schema does not take this site's chat body"
    return ""


def build(
    docs: Path, commits: dict[str, str], today: dt.date, *, default_successor: str = DEFAULT_SUCCESSOR
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two snapshots; `commits`: each file's commit (a checkout: HEAD for every file, under "*");
    a retired model SUCCESSORS does not name moves to `default_successor`."""

    def commit(path: Path) -> str:
        relative = str(path.relative_to(docs))
        return commits.get(relative) or commits["*"]

    price_table = prices(docs)
    retired = retirements(docs, today)
    files: dict[str, str] = {}
    offered: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    known: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for path in sorted((docs / MODELS_DIR).glob("*.json")):
        model = json.loads(path.read_text())
        if model.get("task", {}).get("name") != "Text Generation":
            continue
        files[str(path.relative_to(docs))] = commit(path)
        model_id = model["name"]
        known[model_id] = facts(model, price_table.get(model_id))
        planned = properties(model).get("planned_deprecation_date")
        if planned and dt.date.fromisoformat(planned) <= today and model_id not in retired:
            retired[model_id] = {"on": planned, "announced": str(path.relative_to(docs))}
        if model_id in retired:
            continue
        schemas[model_id] = model.get("schema", {}).get("input", {})
        if why := unsuitable(model):
            skipped[model_id] = why
            continue
        offered[model_id] = known[model_id]
    files[PRICING] = commit(docs / PRICING)
    for retirement in retired.values():
        files[retirement["announced"]] = commit(docs / retirement["announced"])
    gone: dict[str, Any] = {}
    for model_id, retirement in sorted(retired.items()):
        successor = SUCCESSORS.get(model_id, default_successor)
        if successor not in offered:
            raise SystemExit(
                f"{model_id} is retired: give it an offered successor in SUCCESSORS (not {successor})"
            )
        last = known.get(model_id) or {
            "price_in_per_m": price_table.get(model_id, (None, None))[0],
            "price_out_per_m": price_table.get(model_id, (None, None))[1],
        }
        gone[model_id] = {**last, "retired_on": retirement["on"], "successor": successor}
    source = {"repository": "cloudflare/cloudflare-docs", "date": today.isoformat(), "files": files}
    app = {"source": source, "models": offered, "retired": gone, "not_offered": skipped}
    fake = {"source": source, "schemas": schemas, "retired": sorted(retired)}
    return app, fake


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("docs", type=Path, help="a checkout of cloudflare/cloudflare-docs")
    parser.add_argument(
        "--commits",
        type=Path,
        help="a JSON file of {path: commit} for a copy of the docs put together file by file "
        "(default: the checkout's HEAD for every file)",
    )
    parser.add_argument("--date", type=dt.date.fromisoformat, default=dt.date.today())
    args = parser.parse_args(argv)
    if args.commits:
        commits = json.loads(args.commits.read_text())
    else:
        head = ["git", "-C", str(args.docs), "rev-parse", "HEAD"]
        commits = {"*": subprocess.run(head, capture_output=True, text=True, check=True).stdout.strip()}
    app, fake = build(args.docs, commits, args.date)
    for path, data in ((APP_SNAPSHOT, app), (FAKE_SNAPSHOT, fake)):
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")
    print(
        f"{len(app['models'])} models offered, {len(app['retired'])} retired, {len(app['not_offered'])} not offered"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
