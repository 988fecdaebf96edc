"""export_personas / import_personas: a lossless round trip, and an import that is all or nothing,
reporting each problem with its line."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from quotes.management.commands.export_personas import persona_fields
from quotes.models import Persona

pytestmark = [pytest.mark.django_db, pytest.mark.integration]


def export(**options: Any) -> str:
    out = StringIO()
    call_command("export_personas", stdout=out, **options)
    return out.getvalue()


def import_file(path: Path) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("import_personas", str(path), stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def import_problems(path: Path) -> tuple[str, str]:
    """The CommandError's message and what went to stderr; fails if anything was imported."""
    before, err = snapshot(), StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("import_personas", str(path), stdout=StringIO(), stderr=err)
    assert snapshot() == before
    return str(raised.value), err.getvalue()


def snapshot() -> dict[str, dict[str, Any]]:
    return {p["slug"]: p for p in Persona.objects.order_by("id").values("id", *persona_fields())}


def every_field_set() -> dict[str, Any]:
    """A persona with every field away from its default, as the export writes it."""
    return {
        "name": "Hypatia",
        "slug": "hypatia",
        "description": "Mathematician of Alexandria.",
        "system_prompt": "You are Hypatia.\nYou teach geometry.",
        "user_prompt_template": "One line about {topic}, with a diagram in words.",
        "default_topic": "conic sections",
        "voice_examples": "# From her letters (none survive).\ngeometry: A line is the shortest road.",
        "backend": "workers-ai",
        "model": "@cf/google/gemma-2b-it-lora",
        "fallback_models": ["@cf/meta/llama-3.2-3b-instruct", "@cf/meta/llama-3.1-8b-instruct-fp8"],
        "lora": "hypatia-adapter",
        "max_tokens": 120,
        "temperature": 0.35,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1234567890,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.2,
        "presence_penalty": 0.3,
        "cache_ttl": 600,
        "daily_spend_limit_usd": "2.5000",
        "is_active": False,
        "display_order": 9,
    }


def test_export_writes_every_field_in_a_stable_order(tmp_path: Path) -> None:
    Persona.objects.create(**every_field_set())
    text = export()
    data = json.loads(text)
    order = Persona.objects.order_by("display_order", "name", "slug").values_list("slug", flat=True)
    assert [p["slug"] for p in data] == list(order)
    assert all(list(p) == persona_fields() for p in data)
    assert data[-1] == every_field_set()
    assert text == json.dumps(data, indent=2, ensure_ascii=False) + "\n" == export()  # stable

    path = tmp_path / "personas.json"
    assert "Exported 7 personas" in export(output=str(path))
    assert path.read_text(encoding="utf-8") == text


@pytest.mark.services
def test_import_round_trips_every_field(tmp_path: Path) -> None:
    Persona.objects.create(**every_field_set())
    path = tmp_path / "personas.json"
    export(output=str(path))
    before = snapshot()
    # Another persona's every value on one persona, and another deleted: the import puts both back.
    twain = Persona.objects.filter(slug="mark-twain").values(*persona_fields()).get()
    Persona.objects.filter(slug="hypatia").update(**{k: v for k, v in twain.items() if k != "slug"})
    Persona.objects.get(slug="lao-tzu").delete()

    out, err = import_file(path)

    assert err == "" and "1 created, 1 updated, 5 unchanged" in out

    def without_ids(personas: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {slug: p | {"id": 0} for slug, p in personas.items()}

    assert without_ids(snapshot()) == without_ids(before)
    restored = Persona.objects.get(slug="hypatia")
    latest = restored.versions.order_by("-number").first()
    assert latest is not None and latest.note == "imported from personas.json"
    assert latest.config == restored.generation_config()
    assert "0 created, 0 updated, 7 unchanged; 0 new versions" in import_file(path)[0]  # again: nothing


def test_import_reports_every_bad_field_with_its_line_and_changes_nothing(tmp_path: Path) -> None:
    data = json.loads(export())
    watts = next(p for p in data if p["slug"] == "alan-watts")
    watts.update(temperature=9, top_k="many", lora="adapter", user_prompt_template="About {subject}")
    watts.update(fallback_models=["@cf/nobody/x"], colour="blue", daily_spend_limit_usd="lots")
    data.append({**every_field_set(), "slug": "new one", "max_tokens": True, "system_prompt": ""})
    data += [["not", "an", "object"], {"name": "No slug"}]
    text = json.dumps(data, indent=2, ensure_ascii=False)
    path = tmp_path / "personas.json"
    path.write_text(text, encoding="utf-8")
    lines = text.splitlines()

    def line_of(needle: str, after: int = 0) -> int:
        return next(i for i, line in enumerate(lines, 1) if i > after and needle in line)

    new_one, at = line_of('"slug": "new one"'), "alan-watts."
    expected = [
        (line_of('"colour"'), f"{at}colour: unknown field"),
        (line_of("{subject}"), f"{at}user_prompt_template: Unknown variable {{subject}}; use only {{topic}}"),
        (line_of('"@cf/nobody/x"') - 1, f"{at}fallback_models: Unknown model(s): @cf/nobody/x."),
        (line_of('"lora": "adapter"'), f"{at}lora: lora is only accepted by LoRA-capable models"),
        (line_of('"temperature": 9'), f"{at}temperature: Ensure this value is less than or equal to 5.0"),
        (line_of('"top_k": "many"'), f'{at}top_k: must be a whole number or null, not "many"'),
        (line_of('"lots"'), f"{at}daily_spend_limit_usd: “lots” value must be a decimal number."),
        (new_one, "new one.slug: Enter a valid “slug”"),
        (line_of('"system_prompt": ""', after=new_one), "new one.system_prompt: This field cannot be blank."),
        (line_of('"max_tokens": true'), "new one.max_tokens: must be a whole number, not true"),
        (line_of('"not"') - 1, f"#{len(data) - 1}: must be an object of a persona's fields"),
        (line_of('"name": "No slug"') - 1, f"#{len(data)}: slug is required"),
    ]
    message, err = import_problems(path)
    assert f"{len(expected)} problems in" in message and "nothing was imported" in message
    reported = err.splitlines()
    assert len(reported) == len(expected), reported
    for line, problem in expected:
        assert any(r.startswith(f"{path}:{line}: {problem}") for r in reported), (line, problem, reported)
    numbers = [int(line.split(":")[1]) for line in reported]
    assert numbers == sorted(numbers)  # one problem per line, in file order


NESTED_VALUE = '[\n{"slug": "alan-watts",\n "fallback_models": ' + "[" * 200 + "]" * 200 + "}\n]"


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ('[\n  {\n    "slug": "alan-watts",\n    "x": 1\n    "y": 1\n  }\n]\n', 5, "not valid JSON"),
        ('\n{"slug": "alan-watts"}\n', 2, "the file must hold a JSON list of persona objects"),
        ("[" * 100_000 + "]" * 100_000, 1, "nested too deeply"),
        (NESTED_VALUE, 3, "alan-watts.fallback_models: nested too deeply"),
    ],
    ids=["broken-json", "not-a-list", "nested-file", "nested-value"],
)
def test_import_reports_a_file_it_cannot_read(tmp_path: Path, text: str, line: int, problem: str) -> None:
    path = tmp_path / "personas.json"
    path.write_text(text)

    message, err = import_problems(path)

    assert "1 problem in" in message and err.startswith(f"{path}:{line}: ") and problem in err, err


@pytest.mark.services
@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        # A lone surrogate is a valid JSON escape that the database refuses at insert.
        ("name", '"Bad \\ud800 name"', "not valid Unicode"),
        ("fallback_models", '["\\ud83d"]', "not valid Unicode"),
        ("\\ud800", "1", "unknown field"),
        ("system_prompt", '"You are\\u0000 Alan"', "NUL"),  # PostgreSQL refuses a NUL in text
        # NaN and Infinity are not JSON, but Python's parser reads them.
        ("temperature", "NaN", "not NaN"),
        ("daily_spend_limit_usd", "Infinity", "not Infinity"),
        ("seed", "1e400", "whole number"),
        ("seed", "100000000000000000000000000000", ""),
    ],
)
def test_import_reports_text_and_numbers_the_database_would_refuse(
    tmp_path: Path, field: str, value: str, problem: str
) -> None:
    path = tmp_path / "personas.json"
    path.write_text(f'[\n{{"slug": "alan-watts", "{field}": {value}}}\n]\n', encoding="utf-8")

    message, err = import_problems(path)

    assert "1 problem in" in message and err.startswith(f"{path}:2: alan-watts.{field}: ") and problem in err
    err.encode("utf-8")  # the report itself is printable (a lone surrogate is escaped)


@pytest.mark.services
def test_import_rolls_back_when_a_save_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "personas.json"
    path.write_text(json.dumps([p | {"default_topic": "changed"} for p in json.loads(export())]))
    before, saved, original = snapshot(), [], Persona.save

    def failing_save(self: Persona, *args: Any, **kwargs: Any) -> None:  # the disk fills on the third
        saved.append(self.slug)
        if len(saved) == 3:
            raise RuntimeError("disk full")
        original(self, *args, **kwargs)

    monkeypatch.setattr(Persona, "save", failing_save)
    with pytest.raises(RuntimeError):
        import_file(path)
    monkeypatch.undo()
    assert len(saved) == 3 and snapshot() == before


def test_import_skips_the_retired_emoji_field_of_older_files(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps([p | {"emoji": "🌊"} for p in json.loads(export())], ensure_ascii=False))
    before = snapshot()

    out, err = import_file(path)

    assert err == "" and "0 created, 0 updated, 6 unchanged" in out and snapshot() == before
