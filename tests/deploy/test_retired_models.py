"""A database from before Cloudflare retired models (issue 38), through the commands an operator
runs: `migrate` moves every persona on a retired model to its successor, as a new version that
says why; `check --database default` names any persona (or setting) still on a retired or unknown
Workers AI model, and the server says the same once as it starts."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.daphne import ROOT, environment, manage, start_site

pytestmark = pytest.mark.system

RETIRED_DEFAULT = "@cf/meta/llama-3.1-8b-instruct"  # retired 2026-05-30
GEMMA_3 = "@cf/google/gemma-3-12b-it"  # retired 2026-05-30
FP8, SEA_LION = "@cf/meta/llama-3.1-8b-instruct-fp8", "@cf/aisingapore/gemma-sea-lion-v4-27b-it"
LLAMA_32 = "@cf/meta/llama-3.2-3b-instruct"


def sql(db: Path, statement: str, *params: object) -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as connection:
        return connection.execute(statement, params).fetchall()


def check(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", "check", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr  # warnings: the site still serves (fallbacks)
    return result.stdout + result.stderr


def test_migrate_moves_personas_off_retired_models_and_check_names_what_remains(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite3"
    env = environment(DJANGO_DEBUG="true", DATABASE_URL=f"sqlite:///{db}")
    manage(env, "migrate", "quotes", "0014", "--noinput", "-v0")
    # The personas as the old catalog let admins set them.
    sql(db, "UPDATE quotes_persona SET model = ? WHERE slug = 'alan-watts'", RETIRED_DEFAULT)
    sql(
        db,
        "UPDATE quotes_persona SET model = ?, fallback_models = ? WHERE slug = 'ada-lovelace'",
        GEMMA_3,
        json.dumps([RETIRED_DEFAULT, LLAMA_32, FP8]),
    )
    before = dict(sql(db, "SELECT persona_id, MAX(number) FROM quotes_personaversion GROUP BY persona_id"))

    manage(env, "migrate", "--noinput", "-v0")

    personas = {
        slug: (model, json.loads(fallbacks))
        for slug, model, fallbacks in sql(db, "SELECT slug, model, fallback_models FROM quotes_persona")
    }
    assert personas["alan-watts"] == (FP8, [])
    assert personas["ada-lovelace"] == (SEA_LION, [FP8, LLAMA_32])  # moved, each once, in order
    assert {model for model, _ in personas.values()} <= {FP8, SEA_LION}  # the others were on the default
    latest = {
        slug: (persona_id, number, note, json.loads(config))
        for slug, persona_id, number, note, config in sql(
            db,
            "SELECT p.slug, p.id, v.number, v.note, v.config FROM quotes_personaversion v "
            "JOIN quotes_persona p ON p.id = v.persona_id "
            "WHERE v.number = (SELECT MAX(number) FROM quotes_personaversion WHERE persona_id = p.id)",
        )
    }
    moved = {slug for slug, (persona_id, number, *_) in latest.items() if number > before[persona_id]}
    assert moved == {"alan-watts", "ada-lovelace"}  # only they have a new version
    *_, note, config = latest["ada-lovelace"]
    assert note == f"Cloudflare retired {GEMMA_3} → {SEA_LION}; {RETIRED_DEFAULT} → {FP8} (on 2026-05-30)"
    assert (config["model"], config["fallback_models"]) == (SEA_LION, [FP8, LLAMA_32])
    assert check(env, "--database", "default").strip() == "System check identified no issues (0 silenced)."

    # Later: a persona left on a retired model (a restored backup, say), one on an id nobody knows,
    # and a site setting on a retired model.
    sql(db, "UPDATE quotes_persona SET model = ? WHERE slug = 'alan-watts'", RETIRED_DEFAULT)
    sql(
        db,
        "UPDATE quotes_persona SET fallback_models = ? WHERE slug = 'mark-twain'",
        '["@cf/nobody/nothing"]',
    )
    env["QUOTES_FALLBACK_MODELS"] = GEMMA_3
    said = check(env, "--database", "default")
    assert (
        f"Persona 'alan-watts': its model {RETIRED_DEFAULT} was retired by Cloudflare on 2026-05-30: use {FP8}."
        in said
    )
    assert "Persona 'mark-twain': its fallback @cf/nobody/nothing is not in the Workers AI catalog" in said
    assert f"QUOTES_FALLBACK_MODELS names {GEMMA_3}, which was retired by Cloudflare on 2026-05-30" in said
    assert said.count("quotes.W011") == 2 and said.count("quotes.W010") == 1
    assert "quotes.W011" not in check(env)  # the personas' check is the database's

    # The server says the same, once, as it starts, and serves.
    with start_site(tmp_path, **{k: v for k, v in env.items() if k.startswith("QUOTES_")}) as site:
        assert httpx.get(f"{site.url}/healthz", timeout=10).status_code == 200
        log = site.log_path.read_text()
    assert log.count(f"Persona 'alan-watts': its model {RETIRED_DEFAULT} was retired") == 1
    assert log.count(f"QUOTES_FALLBACK_MODELS names {GEMMA_3}") == 1
