"""Settings as production starts them: a fresh interpreter with the environment set (settings
are read once, at import), and the README's configuration table read against config/settings.py."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Documented in the README's table but read by a library, not by config/settings.py: the OpenMP
#: runtime under llama.cpp (quotes/ai/backends/local.py only gives it a default).
READ_ELSEWHERE = {"OMP_WAIT_POLICY"}

SHOW = """
import dataclasses, json, django
from django.conf import settings
django.setup()
values = {name: getattr(settings, name) for name in %r}
print(json.dumps({k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values.items()}, default=str))
"""


def _start(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    # Only the variables the test sets (development mode unless it says otherwise; None unsets
    # one): none of the developer's own configuration leaks in.
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CLOUDFLARE_", "AI_", "QUOTES_"))
    }
    chosen = {"DJANGO_DEBUG": "true", **env, "DJANGO_SETTINGS_MODULE": "config.settings"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, **{k: v for k, v in chosen.items() if v is not None}},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _settings(*names: str, **env: str | None) -> dict[str, dict[str, object]]:
    result = _start(SHOW % (names,), **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _start_up_error(**env: str | None) -> str:
    result = _start("import django; django.setup()", **env)
    assert result.returncode != 0, "start-up should have been refused"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: "), result.stderr
    return last


# -- the README's table ----------------------------------------------------------------------------


def variables_read_by_settings() -> set[str]:
    """Every environment variable config/settings.py reads: the first argument of a call to
    `env.<cast>(...)` or to one of the module's own helpers (`_env_or_error("X", ...)`)."""
    tree = ast.parse((ROOT / "config" / "settings.py").read_text())
    helpers = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        reader = (
            isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "env"
        ) or (isinstance(func, ast.Name) and func.id in helpers)
        first = node.args[0]
        if reader and isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.add(first.value)
    return names


def readme_configuration_rows() -> list[str]:
    """The variable of each row of the README's table under `## Configuration`."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", section, flags=re.MULTILINE)


@pytest.mark.unit
def test_readme_table_has_one_row_for_each_variable_settings_reads() -> None:
    rows = readme_configuration_rows()
    read = variables_read_by_settings()

    assert len(read) > 50  # the walk found the readers
    assert sorted({name for name in rows if rows.count(name) > 1}) == []
    assert sorted(read - set(rows)) == [], "read by config/settings.py, missing from the README's table"
    assert sorted(set(rows) - read - READ_ELSEWHERE) == [], "in the README's table, read by nothing"


# -- fail-fast validation --------------------------------------------------------------------------


@pytest.mark.system
def test_debug_is_off_by_default_and_production_refuses_a_missing_or_known_key() -> None:
    """Issue 29, point 9: with nothing set the settings are production's, which refuse to start
    without a secret key of their own; the development key (public, in config/settings.py) is
    refused too. `make run` and the tests ask for development mode by name."""
    from django.conf import settings

    hosts = {"DJANGO_ALLOWED_HOSTS": "quotes.example.com"}
    unset = _start_up_error(DJANGO_DEBUG=None, **hosts)
    dev_key = _start_up_error(DJANGO_DEBUG=None, DJANGO_SECRET_KEY=settings.DEV_SECRET_KEY, **hosts)
    off = _start_up_error(DJANGO_DEBUG="false", DJANGO_SECRET_KEY=settings.DEV_SECRET_KEY, **hosts)

    for error in (unset, dev_key, off):
        assert "DJANGO_SECRET_KEY must be set to a secret of your own" in error and "make run" in error
    assert _settings("DEBUG", DJANGO_DEBUG=None, DJANGO_SECRET_KEY="k" * 50, **hosts) == {"DEBUG": False}
    assert _settings("DEBUG", "SECRET_KEY") == {"DEBUG": True, "SECRET_KEY": settings.DEV_SECRET_KEY}


@pytest.mark.system
@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"AI_TOTAL_TIMEOUT": "soon"}, "AI_TOTAL_TIMEOUT"),
        ({"AI_MAX_CONNECTIONS": "0"}, "AI_MAX_CONNECTIONS"),
        ({"LOCAL_MODEL_SLOTS": "four"}, "LOCAL_MODEL_SLOTS"),
        ({"LOCAL_MODEL_QUEUE_TIMEOUT": "soon"}, "LOCAL_MODEL_QUEUE_TIMEOUT"),
        ({"QUOTES_RETRY_BACKOFF": "random"}, "QUOTES_RETRY_BACKOFF"),
        ({"QUOTES_RETRY_DELAY_MS": "-1"}, "QUOTES_RETRY_DELAY_MS"),
        ({"AI_GATEWAY_ID": "gw", "AI_GATEWAY_MAX_ATTEMPTS": "9"}, "AI_GATEWAY_MAX_ATTEMPTS"),
        ({"AI_GATEWAY_ID": "gw", "AI_GATEWAY_BACKOFF": "random"}, "AI_GATEWAY_BACKOFF"),
        ({"AI_BACKEND": "openai"}, "OPENAI_BASE_URL"),
    ],
)
def test_settings_bad_value_stops_start_up_naming_the_variable(env: dict[str, str], named: str) -> None:
    assert named in _start_up_error(**env)


@pytest.mark.system
@pytest.mark.parametrize(
    ("name", "value", "replacement"),
    [
        ("AI_GATEWAY_MAX_ATTEMPTS", "3", "QUOTES_MAX_ATTEMPTS"),
        ("AI_GATEWAY_RETRY_DELAY_MS", "500", "QUOTES_RETRY_DELAY_MS"),
        ("AI_GATEWAY_BACKOFF", "linear", "QUOTES_RETRY_BACKOFF"),
    ],
)
def test_settings_cloudflare_retries_without_a_gateway_stop_start_up(
    name: str, value: str, replacement: str
) -> None:
    """They once set the app's own retries too; with no gateway to send them to they would do
    nothing, so a deploy relying on the old meaning is stopped with the variable to use."""
    error = _start_up_error(**{name: value})
    assert name in error and "AI_GATEWAY_ID" in error and replacement in error


# -- one variable per setting ----------------------------------------------------------------------


@pytest.mark.system
def test_settings_app_retries_and_cloudflare_gateway_retries_are_apart() -> None:
    values = _settings(
        "QUOTES_GATEWAY",
        "AI_GATEWAY",
        AI_GATEWAY_ID="gw",
        AI_GATEWAY_MAX_ATTEMPTS="5",
        AI_GATEWAY_RETRY_DELAY_MS="1000",
        AI_GATEWAY_BACKOFF="constant",
    )
    app, cloudflare = values["QUOTES_GATEWAY"], values["AI_GATEWAY"]
    assert (app["max_attempts"], app["retry_delay_ms"], app["backoff"]) == (2, 250, "exponential")
    assert cloudflare["retries"] == {"max_attempts": 5, "retry_delay_ms": 1000, "backoff": "constant"}

    values = _settings(
        "QUOTES_GATEWAY",
        "AI_GATEWAY",
        QUOTES_MAX_ATTEMPTS="3",
        QUOTES_RETRY_DELAY_MS="100",
        QUOTES_RETRY_BACKOFF="linear",
    )
    app, cloudflare = values["QUOTES_GATEWAY"], values["AI_GATEWAY"]
    assert (app["max_attempts"], app["retry_delay_ms"], app["backoff"]) == (3, 100, "linear")
    assert cloudflare["retries"] == {"max_attempts": None, "retry_delay_ms": None, "backoff": None}


@pytest.mark.system
def test_settings_upstream_http_is_one_object_for_every_remote_backend() -> None:
    values = _settings(
        "AI_HTTP",
        "WORKERS_AI",
        "OPENAI_COMPAT",
        "QUOTES_GATEWAY",
        AI_CONNECT_TIMEOUT="1.5",
        AI_TOTAL_TIMEOUT="60",
        AI_MAX_CONNECTIONS="8",
        OPENAI_BASE_URL="http://127.0.0.1:9/v1/",
    )
    assert values["AI_HTTP"] == {"connect_timeout_s": 1.5, "max_connections": 8}
    assert values["QUOTES_GATEWAY"]["total_timeout_s"] == 60.0  # the gateway's deadline, any backend
    assert set(values["WORKERS_AI"]) == {"account_id", "api_token", "base_url"}
    assert values["OPENAI_COMPAT"] == {"base_url": "http://127.0.0.1:9/v1", "api_key": ""}


@pytest.mark.system
def test_settings_retired_ai_read_timeout_starts_with_a_warning_naming_its_replacements() -> None:
    """AI_READ_TIMEOUT's waits are the gateway's deadlines now: a deploy that still sets it (even
    to a value it would once have refused) starts, and is told what to set instead."""
    result = _start("import django; django.setup()", AI_READ_TIMEOUT="soon")
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "AI_READ_TIMEOUT" in line]
    assert "WARNING" in line and "QUOTES_TTFT_TIMEOUT" in line and "QUOTES_IDLE_TIMEOUT" in line

    quiet = _start("import django; django.setup()")
    assert quiet.returncode == 0 and "AI_READ_TIMEOUT" not in quiet.stderr
