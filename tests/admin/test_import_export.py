"""export_personas / import_personas: a lossless round trip, and an import that is all or nothing."""

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


def snapshot() -> list[dict[str, Any]]:
    return [
        {name: getattr(p, name) for name in ["id", *persona_fields()]} for p in Persona.objects.order_by("id")
    ]


def every_field_set() -> dict[str, Any]:
    """A persona with every field away from its default."""
    return {
        "name": "Hypatia",
        "slug": "hypatia",
        "description": "Mathematician of Alexandria.",
        "system_prompt": "You are Hypatia.\nYou teach geometry.",
        "user_prompt_template": "One line about {topic}, with a diagram in words.",
        "default_topic": "conic sections",
        "voice_examples": "# From her letters (none survive).\ngeometry: A line is the shortest road to what it means.",
        "backend": "workers-ai",
        "model": "@cf/google/gemma-2b-it-lora",
        "fallback_models": ["@cf/meta/llama-3.2-3b-instruct", "@cf/meta/llama-3.1-8b-instruct"],
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
        "is_active": False,
        "display_order": 9,
    }


def test_export_writes_every_field_in_a_stable_order(tmp_path: Path) -> None:
    Persona.objects.create(**every_field_set())
    text = export()
    data = json.loads(text)
    assert [p["slug"] for p in data] == list(
        Persona.objects.order_by("display_order", "name", "slug").values_list("slug", flat=True)
    )
    assert all(list(p) == persona_fields() for p in data)
    assert data[-1] == every_field_set()
    assert text == json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    assert export() == text  # stable

    path = tmp_path / "personas.json"
    assert "Exported 7 personas" in export(output=str(path))
    assert path.read_text(encoding="utf-8") == text


@pytest.mark.services
def test_import_round_trips_every_field(tmp_path: Path) -> None:
    Persona.objects.create(**every_field_set())
    path = tmp_path / "personas.json"
    export(output=str(path))
    before = snapshot()

    # Change everything about one persona, delete another: the import puts both back.
    hypatia = Persona.objects.get(slug="hypatia")
    for name, value in {
        "name": "H",
        "description": "",
        "system_prompt": "changed",
        "user_prompt_template": "{topic}",
        "default_topic": "x",
        "voice_examples": "",
        "backend": "",
        "model": "@cf/meta/llama-3.1-8b-instruct",
        "fallback_models": [],
        "lora": "",
        "max_tokens": 5,
        "temperature": 1.0,
        "top_p": None,
        "top_k": None,
        "seed": None,
        "repetition_penalty": None,
        "frequency_penalty": None,
        "presence_penalty": None,
        "cache_ttl": None,
        "is_active": True,
        "display_order": 0,
    }.items():
        setattr(hypatia, name, value)
    hypatia.save()
    Persona.objects.get(slug="lao-tzu").delete()

    out, err = import_file(path)
    assert err == ""
    assert "1 created, 1 updated, 5 unchanged" in out
    after = {p["slug"]: {k: v for k, v in p.items() if k != "id"} for p in snapshot()}
    assert after == {p["slug"]: {k: v for k, v in p.items() if k != "id"} for p in before}
    restored = Persona.objects.get(slug="hypatia")
    latest = restored.versions.order_by("-number").first()
    assert latest is not None and latest.note == "imported from personas.json"
    assert latest.config == restored.generation_config()

    # Importing the same file again changes nothing.
    out, _ = import_file(path)
    assert "0 created, 0 updated, 7 unchanged; 0 new versions" in out


def test_import_reports_every_bad_field_with_its_line_and_changes_nothing(tmp_path: Path) -> None:
    data = json.loads(export())
    watts = next(p for p in data if p["slug"] == "alan-watts")
    watts.update(
        temperature=9,
        top_k="many",
        lora="adapter",
        user_prompt_template="About {subject}",
        fallback_models=["@cf/nobody/x"],
    )
    watts["colour"] = "blue"
    data.append({**every_field_set(), "slug": "new one", "max_tokens": True, "system_prompt": ""})
    data.append(["not", "an", "object"])
    data.append({"name": "No slug"})
    text = json.dumps(data, indent=2, ensure_ascii=False)
    path = tmp_path / "personas.json"
    path.write_text(text, encoding="utf-8")
    lines = text.splitlines()

    def line_of(needle: str, after: int = 0) -> int:
        return next(i for i, line in enumerate(lines, 1) if i > after and needle in line)

    at = {
        needle: line_of(needle)
        for needle in (
            '"user_prompt_template": "About {subject}"',
            '"colour"',
            '"@cf/nobody/x"',
            '"lora": "adapter"',
            '"temperature": 9',
            '"top_k": "many"',
            '"slug": "new one"',
            '"max_tokens": true',
            '"not"',
            '"name": "No slug"',
        )
    }
    blank_prompt = line_of('"system_prompt": ""', after=at['"slug": "new one"'])
    not_object, no_slug = len(data) - 1, len(data)
    before = snapshot()
    with pytest.raises(CommandError, match=r"11 problems in .*personas.json; nothing was imported"):
        import_file(path)
    assert snapshot() == before

    err = StringIO()
    with pytest.raises(CommandError):
        call_command("import_personas", str(path), stderr=err)
    reported = err.getvalue().splitlines()
    name = str(path)
    expected = [
        (at['"colour"'], "alan-watts.colour: unknown field"),
        (
            at['"user_prompt_template": "About {subject}"'],
            "alan-watts.user_prompt_template: Unknown variable {subject}; use only {topic}.",
        ),
        (at['"@cf/nobody/x"'] - 1, "alan-watts.fallback_models: Unknown model(s): @cf/nobody/x."),
        (at['"lora": "adapter"'], "alan-watts.lora: lora is only accepted by LoRA-capable models"),
        (at['"temperature": 9'], "alan-watts.temperature: Ensure this value is less than or equal to 5.0."),
        (at['"top_k": "many"'], 'alan-watts.top_k: must be a whole number or null, not "many"'),
        (at['"slug": "new one"'], "new one.slug: Enter a valid “slug”"),
        (blank_prompt, "new one.system_prompt: This field cannot be blank."),
        (at['"max_tokens": true'], "new one.max_tokens: must be a whole number, not true"),
        (at['"not"'] - 1, f"#{not_object}: must be an object of a persona's fields"),
        (at['"name": "No slug"'] - 1, f"#{no_slug}: slug is required"),
    ]
    assert len(reported) == len(expected), reported
    for line, message in expected:
        assert any(r.startswith(f"{name}:{line}: {message}") for r in reported), (line, message, reported)
    # A list value's error is on its key's line.
    assert lines[at['"@cf/nobody/x"'] - 2].strip() == '"fallback_models": ['
    # One problem per line, in file order.
    numbers = [int(line.split(":")[1]) for line in reported]
    assert numbers == sorted(numbers)


def test_import_reports_broken_json_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[\n  {\n    "slug": "alan-watts",\n    "name": "Alan"\n    "emoji": "x"\n  }\n]\n')
    err = StringIO()
    before = snapshot()
    with pytest.raises(CommandError, match="1 problem in"):
        call_command("import_personas", str(path), stderr=err)
    assert err.getvalue().startswith(f"{path}:5: not valid JSON: Expecting ',' delimiter")
    assert snapshot() == before


def test_import_rejects_a_file_that_is_not_a_list(tmp_path: Path) -> None:
    path = tmp_path / "object.json"
    path.write_text('\n{"slug": "alan-watts"}\n')
    err = StringIO()
    with pytest.raises(CommandError):
        call_command("import_personas", str(path), stderr=err)
    assert err.getvalue().strip() == f"{path}:2: the file must hold a JSON list of persona objects"


@pytest.mark.services
def test_import_rolls_back_when_a_save_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads(export())
    for persona in data:
        persona["default_topic"] = "changed"
    path = tmp_path / "personas.json"
    path.write_text(json.dumps(data, indent=2))
    before = snapshot()
    saved: list[str] = []
    original = Persona.save

    def failing_save(self: Persona, *args: Any, **kwargs: Any) -> None:
        saved.append(self.slug)
        if len(saved) == 3:
            raise RuntimeError("disk full")
        original(self, *args, **kwargs)

    monkeypatch.setattr(Persona, "save", failing_save)
    with pytest.raises(RuntimeError):
        import_file(path)
    monkeypatch.undo()
    assert len(saved) == 3
    assert snapshot() == before


def test_import_skips_the_retired_emoji_field_of_older_files(tmp_path: Path) -> None:
    # Files exported before migration 0010 carry each persona's `emoji`: they still import.
    data = json.loads(export())
    for entry in data:
        entry["emoji"] = "🌊"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    before = snapshot()

    out, err = import_file(path)

    assert err == ""
    assert "0 created, 0 updated, 6 unchanged" in out
    assert snapshot() == before


# --- issue 20: files that crashed the import instead of being reported ---------------------------


def import_problems(path: Path) -> tuple[str, str]:
    """The CommandError's message and what was written to stderr; fails if anything was imported."""
    before = snapshot()
    err = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("import_personas", str(path), stdout=StringIO(), stderr=err)
    assert snapshot() == before
    return str(raised.value), err.getvalue()


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_import_reports_a_deeply_nested_file(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "nested.json"
    path.write_text("[" * depth + "]" * depth)

    message, err = import_problems(path)

    assert "1 problem in" in message
    assert err.startswith(f"{path}:1: ") and "nested too deeply" in err, err


@pytest.mark.services
def test_import_reports_a_deeply_nested_value(tmp_path: Path) -> None:
    """A list inside a field's list is no persona value: it is named as such, before the type
    checks and the model's validation, which would each recurse into it (at any depth)."""
    depth = 200
    text = '[\n  {"slug": "alan-watts",\n   "fallback_models": ' + "[" * depth + "]" * depth + "}\n]"
    path = tmp_path / "nested.json"
    path.write_text(text)

    _, err = import_problems(path)

    assert err.startswith(f"{path}:3: alan-watts.fallback_models: ") and "nested too deeply" in err, err


@pytest.mark.services
@pytest.mark.parametrize(
    ("entry", "line", "problem"),
    [
        # A lone surrogate is a valid JSON escape, and passes the model's validation; the
        # database refuses it at insert (SQLite and PostgreSQL alike).
        ('{"slug": "alan-watts", "name": "Bad \\ud800 name"}', "alan-watts.name: ", "not valid Unicode"),
        (
            '{"slug": "alan-watts", "default_topic": "\\udfff"}',
            "alan-watts.default_topic: ",
            "not valid Unicode",
        ),
        (
            '{"slug": "alan-watts", "fallback_models": ["\\ud83d"]}',
            "alan-watts.fallback_models: ",
            "not valid Unicode",
        ),
        ('{"slug": "bad-\\ud800", "name": "X"}', "bad-\\ud800.slug: ", "not valid Unicode"),
        ('{"slug": "alan-watts", "\\ud800": 1}', "alan-watts.\\ud800: ", "unknown field"),
        # PostgreSQL refuses a NUL character in text at insert.
        (
            '{"slug": "alan-watts", "system_prompt": "You are\\u0000 Alan"}',
            "alan-watts.system_prompt: ",
            "NUL",
        ),
        # NaN and Infinity are not JSON, but Python's parser reads them.
        ('{"slug": "alan-watts", "temperature": NaN}', "alan-watts.temperature: ", "not NaN"),
        ('{"slug": "alan-watts", "top_p": -Infinity}', "alan-watts.top_p: ", "not -Infinity"),
        ('{"slug": "alan-watts", "seed": 1e400}', "alan-watts.seed: ", "whole number"),
        ('{"slug": "alan-watts", "seed": 100000000000000000000000000000}', "alan-watts.seed: ", ""),
    ],
)
def test_import_reports_text_and_numbers_the_database_would_refuse(
    tmp_path: Path, entry: str, line: str, problem: str
) -> None:
    path = tmp_path / "personas.json"
    path.write_text("[\n" + entry + "\n]\n", encoding="utf-8")

    message, err = import_problems(path)

    assert "1 problem in" in message, (message, err)
    assert err.startswith(f"{path}:2: {line}"), err
    assert problem in err, err
    err.encode("utf-8")  # the report itself is printable (a lone surrogate is escaped)
