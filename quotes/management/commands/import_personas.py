"""`python manage.py import_personas FILE`: create or update personas (by slug) from an export,
a key left out keeping its value. Every problem is reported with its line, compiler-style
(`personas.json:12: alan-watts.temperature: ...`), and one means nothing is imported.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import models, transaction

from quotes.models import Persona
from quotes.services import persona_save

from .export_personas import persona_fields

_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _printable(text: str) -> str:
    """`text` as it can be written to a terminal or a UTF-8 file: a lone surrogate as `\\udxxx`."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _nested(value: object) -> bool:
    """Whether `value` nests a list or an object: no persona field does, and every later step
    would recurse into it (thousands of levels exhaust the stack)."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(isinstance(child, dict | list) for child in children)


def _text_problem(value: object) -> str | None:
    """Why the database would refuse a string in `value` (a string, or a list of them), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return (
                    "holds text that is not valid Unicode (a lone surrogate), which the database cannot store"
                )
            if "\x00" in item:
                return "holds a NUL character, which the database cannot store"
    return None


@dataclass
class _Entry:
    """One element of the file's list, with where each part of it starts."""

    index: int
    line: int
    value: object
    key_lines: dict[str, list[int]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        slug = self.value.get("slug") if isinstance(self.value, dict) else None
        return _printable(slug) if isinstance(slug, str) and slug else f"#{self.index + 1}"

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, [self.line])[0]


class _Problems(Exception):
    def __init__(self, problems: list[tuple[int, str]]) -> None:
        super().__init__(problems)
        self.problems = problems


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _skip(text: str, pos: int, *punctuation: str) -> int:
    """Skip whitespace, then any one of `punctuation` and the whitespace after it."""
    end = _WHITESPACE.match(text, pos)
    pos = end.end() if end else pos
    if punctuation and text[pos : pos + 1] in punctuation:
        end = _WHITESPACE.match(text, pos + 1)
        pos = end.end() if end else pos + 1
    return pos


def parse_entries(text: str) -> list[_Entry]:
    """The file's list elements with their line numbers (and each key's)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Problems([(exc.lineno, f"not valid JSON: {exc.msg} (column {exc.colno})")]) from None
    except RecursionError:
        raise _Problems(
            [(1, "nested too deeply to read: a persona file is a list of flat objects")]
        ) from None
    start = _skip(text, 0)
    if not isinstance(data, list):
        raise _Problems([(_line(text, start), "the file must hold a JSON list of persona objects")])
    # Valid JSON (checked above): a plain walk over it cannot go wrong.
    decoder = json.JSONDecoder()
    pos = _skip(text, start, "[")
    entries = []
    for index, value in enumerate(data):
        pos = _skip(text, pos, ",")
        entry = _Entry(index=index, line=_line(text, pos), value=value)
        entries.append(entry)
        if not isinstance(value, dict):
            _, pos = decoder.raw_decode(text, pos)
            continue
        pos = _skip(text, pos, "{")
        while text[pos] != "}":
            pos = _skip(text, pos, ",")
            key, after = decoder.raw_decode(text, pos)
            entry.key_lines.setdefault(key, []).append(_line(text, pos))
            _, pos = decoder.raw_decode(text, _skip(text, after, ":"))
            pos = _skip(text, pos)
        pos += 1
    return entries


def _expected_type(model_field: models.Field[Any, Any]) -> tuple[tuple[type, ...], str]:
    if isinstance(model_field, models.BooleanField):
        types: tuple[type, ...] = (bool,)
        name = "true or false"
    elif isinstance(model_field, models.IntegerField):
        types, name = (int,), "a whole number"
    elif isinstance(model_field, models.FloatField):
        types, name = (int, float), "a number"
    elif isinstance(model_field, models.DecimalField):
        # Exported as text ("2.5000"), so no binary float rounds it; a plain number is read too.
        types, name = (str, int, float), "a decimal number"
    elif isinstance(model_field, models.JSONField):
        types, name = (list,), "a list"
    else:
        types, name = (str,), "a string"
    if model_field.null:
        types, name = (*types, type(None)), name + " or null"
    return types, name


def _type_error(model_field: models.Field[Any, Any], value: object) -> str | None:
    types, name = _expected_type(model_field)
    if (
        (isinstance(value, bool) and bool not in types)
        or not isinstance(value, types)
        or (isinstance(value, float) and not math.isfinite(value))  # NaN, Infinity: Python reads them
    ):
        return f"must be {name}, not {json.dumps(value)[:60]}"
    return None


#: Fields older files carry that personas no longer have (`emoji`: migration 0010): skipped.
RETIRED_FIELDS = frozenset({"emoji"})


def check_entries(entries: list[_Entry]) -> tuple[list[Persona], list[tuple[int, str]]]:
    """Personas ready to save (unsaved changes applied) and every problem found, with its line."""
    fields = {f.name: f for f in Persona._meta.concrete_fields if not f.primary_key}
    problems: list[tuple[int, str]] = []
    personas: list[Persona] = []
    seen: dict[str, int] = {}
    for entry in entries:
        label = entry.label
        if not isinstance(entry.value, dict):
            problems.append((entry.line, f"{label}: must be an object of a persona's fields"))
            continue
        value: dict[str, Any] = entry.value
        bad: set[str] = set()
        for key, lines in entry.key_lines.items():
            where = f"{label}.{_printable(key)}"
            if len(lines) > 1:
                problems.append((lines[1], f"{where}: given more than once"))
            if key in RETIRED_FIELDS:
                continue
            if key not in fields:
                problems.append((lines[0], f"{where}: unknown field"))
                bad.add(key)
            elif _nested(value[key]):
                problems.append(
                    (lines[0], f"{where}: nested too deeply (a value is at most a list of strings)")
                )
                bad.add(key)
            elif (error := _type_error(fields[key], value[key]) or _text_problem(value[key])) is not None:
                problems.append((lines[0], f"{where}: {error}"))
                bad.add(key)
        slug = value.get("slug")
        if "slug" not in value:
            problems.append((entry.line, f"{label}: slug is required (it says which persona this is)"))
            continue
        if "slug" in bad or not isinstance(slug, str):
            continue
        if slug in seen:
            problems.append((entry.line_of("slug"), f"{label}: the same slug as line {seen[slug]}"))
            continue
        seen[slug] = entry.line_of("slug")

        persona = Persona.objects.filter(slug=slug).first() or Persona()
        for key in fields:
            if key in value and key not in bad:
                setattr(persona, key, value[key])
        try:
            persona.full_clean()
        except ValidationError as exc:
            for name, messages in exc.message_dict.items():
                if name in bad:
                    continue  # already reported as the wrong type
                where = f"{label}" if name == NON_FIELD_ERRORS else f"{label}.{name}"
                line = entry.line if name == NON_FIELD_ERRORS else entry.line_of(name)
                problems.append((line, f"{where}: {' '.join(messages)}"))
            continue
        personas.append(persona)
    return personas, sorted(problems, key=lambda problem: problem[0])


class Command(BaseCommand):
    help = "Create or update personas (by slug) from a JSON export; all of it or, on any problem, none."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="a file written by export_personas")

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["file"]
        try:
            text = Path(name).read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"Cannot read {name}: {exc}") from None
        try:
            personas, problems = check_entries(parse_entries(text))
        except _Problems as exc:
            problems = exc.problems
        if problems:
            for line, message in problems:
                self.stderr.write(f"{name}:{line}: {_printable(message)}")
            raise CommandError(
                f"{len(problems)} problem{'s' if len(problems) != 1 else ''} in {name}; nothing was imported."
            )

        created = updated = unchanged = versions = 0
        note = f"imported from {Path(name).name}"
        with transaction.atomic():
            for persona in personas:
                if persona.pk is not None:
                    stored = Persona.objects.get(pk=persona.pk)
                    if all(getattr(stored, f) == getattr(persona, f) for f in persona_fields()):
                        unchanged += 1
                        continue
                    updated += 1
                else:
                    created += 1
                versions += persona_save(persona=persona, note=note) is not None
        self.stdout.write(
            f"Imported {name}: {created} created, {updated} updated, {unchanged} unchanged; "
            f"{versions} new version{'s' if versions != 1 else ''}."
        )
