"""Settings as production starts them: config/settings.py run under a given environment in a fresh
interpreter (one for every environment of ENVIRONMENTS, with runpy, as an import runs it:
`start_ups`; `manage.py check` starts Django itself once), and the README's configuration table
read against it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = {"DJANGO_SECRET_KEY": "prod-test-" + "k3y" * 20, "DJANGO_ALLOWED_HOSTS": "quotes.example.com"}
#: Documented in the README's table but read by a library, not by config/settings.py.
READ_ELSEWHERE = {
    "OMP_WAIT_POLICY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
}
#: A bad value for each of these (on top of PRODUCTION) stops start-up with a message naming it.
BAD = [
    ("DJANGO_SECRET_KEY", "dev-only-insecure-key-change-me-0123456789abcdef"),  # config/settings.py's, public
    ("AI_BACKEND", "gpt"),
    ("QUOTES_RATE_LIMIT", "20"),
    ("QUOTES_FEEDBACK_RATE_LIMIT", "lots"),
    ("LOCAL_MODEL_SLOTS", "0"),
    ("QUOTES_RESUME_GRACE_S", "-1"),
    ("AI_GATEWAY_CACHE_TTL", "0"),  # under 60 (0 once slipped through as "unset")
    ("QUOTES_TRUSTED_PROXIES", "nginx"),
    ("DJANGO_CSRF_TRUSTED_ORIGINS", "quotes.example.com"),
    ("AI_TOTAL_TIMEOUT", "soon"),
    ("QUOTES_MAX_OPEN_STREAMS", "lots"),
    ("QUOTES_DAILY_SPEND_LIMIT_USD", "ten"),
    # Issue 39: nonsense that was taken (NaN, Infinity and 1e400 meant "no ceiling").
    ("QUOTES_DAILY_SPEND_LIMIT_USD", "NaN"),
    ("QUOTES_DAILY_SPEND_LIMIT_USD", "Infinity"),
    ("QUOTES_DAILY_SPEND_LIMIT_USD", "1e400"),
    ("QUOTES_MAX_OPEN_STREAMS", "0"),
    ("QUOTES_MAX_OPEN_STREAMS", "-1"),
    ("QUOTES_MAX_CONCURRENT_STREAMS", "0"),
    ("AI_TOTAL_TIMEOUT", "-1"),
    ("AI_TOTAL_TIMEOUT", "nan"),
    ("QUOTES_DRAIN_TIMEOUT_S", "-5"),
    ("QUOTES_RATE_LIMIT", "0/minute"),
    ("QUOTES_RATE_LIMIT", "1/0second"),
]
#: What a refusal says of each variable's form, and what is taken.
FORMS = {
    "QUOTES_DAILY_SPEND_LIMIT_USD": "must be an amount of US dollars from 0 to 1000000",
    "QUOTES_MAX_OPEN_STREAMS": "must be a whole number from 1 to 1000000",
    "QUOTES_MAX_CONCURRENT_STREAMS": "must be a whole number from 1 to 1000000",
    "AI_TOTAL_TIMEOUT": "must be a number from 0.1 to 3600",
    "QUOTES_DRAIN_TIMEOUT_S": "must be a number from 0 to 3600",
    "QUOTES_RATE_LIMIT": "must be a rate such as 20/minute",
}
ENVIRONMENTS: dict[str, dict[str, str]] = {
    "production": PRODUCTION,
    "behind a proxy, on Redis": {
        **PRODUCTION,
        "DJANGO_SECURE_PROXY_SSL_HEADER": "true",
        "DJANGO_CSRF_TRUSTED_ORIGINS": "https://quotes.example.com",
        "REDIS_URL": "redis://127.0.0.1:6399/2",
    },
    **{name: {k: v for k, v in PRODUCTION.items() if k != name} for name in PRODUCTION},  # missing
    **{f"{name}={value}": {**PRODUCTION, name: value} for name, value in BAD},
    "short rates": {
        **PRODUCTION,
        "QUOTES_RATE_LIMIT": "20/m",
        "QUOTES_FEEDBACK_RATE_LIMIT": "100 per 2 hours",
    },
}

RUN_EACH = """
import json, os, runpy, sys, traceback
base, environments, names = json.loads(sys.stdin.read())
out = {}
for name, env in environments.items():
    os.environ.clear()
    os.environ.update({**base, **env})
    try:
        values = runpy.run_path("config/settings.py")
    except Exception as exc:
        out[name] = {"error": traceback.format_exception_only(exc)[-1].strip()}
    else:
        out[name] = {"values": {key: values.get(key) for key in names}}
print(json.dumps(out, default=repr))
"""
SHOWN = ["DEBUG", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS"]
SHOWN += ["SECURE_PROXY_SSL_HEADER", "CSRF_TRUSTED_ORIGINS", "CACHES", "STORAGES", "QUOTES_LOG_CONTENT"]
SHOWN += ["QUOTES_RATE_LIMIT", "QUOTES_FEEDBACK_RATE_LIMIT"]


def _base_env() -> dict[str, str]:
    """This environment without any of the app's variables (production mode unless set)."""
    prefixes = ("DJANGO_", "CLOUDFLARE_", "AI_", "QUOTES_", "OPENAI_", "LOCAL_MODEL_", "DATABASE_", "REDIS_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


@pytest.fixture(scope="module")
def start_ups() -> dict[str, dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, "-c", RUN_EACH],
        input=json.dumps([_base_env(), ENVIRONMENTS, SHOWN]),
        cwd=ROOT,
        env={**_base_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.system
@pytest.mark.parametrize(
    ("case", "named"),
    [(name, name) for name in PRODUCTION] + [(f"{name}={value}", name) for name, value in BAD],
)
def test_a_missing_or_bad_value_stops_start_up_naming_the_variable(
    start_ups: dict[str, dict[str, Any]], case: str, named: str
) -> None:
    error = start_ups[case].get("error", "it started")
    assert error.startswith("django.core.exceptions.ImproperlyConfigured: ") and named in error, error
    if named in FORMS and "=" in case:
        assert f"{named} {FORMS[named]}" in error and repr(case.split("=", 1)[1]) in error, error


@pytest.mark.system
def test_a_rate_in_the_short_form_other_limiters_teach_is_taken(start_ups: dict[str, dict[str, Any]]) -> None:
    values = start_ups["short rates"]["values"]
    assert (values["QUOTES_RATE_LIMIT"], values["QUOTES_FEEDBACK_RATE_LIMIT"]) == ("20/minute", "100/2 hour")


@pytest.mark.system
def test_production_is_secure_by_default_and_takes_its_proxy_and_redis_from_the_environment(
    start_ups: dict[str, dict[str, Any]],
) -> None:
    values = start_ups["production"]["values"]
    assert values["DEBUG"] is False and values["QUOTES_LOG_CONTENT"] is False
    assert values["SECURE_SSL_REDIRECT"] and values["SESSION_COOKIE_SECURE"] and values["CSRF_COOKIE_SECURE"]
    assert values["SECURE_HSTS_SECONDS"] == 31_536_000
    assert values["SECURE_PROXY_SSL_HEADER"] is None  # only when told there is a proxy
    assert values["STORAGES"]["staticfiles"]["BACKEND"].endswith("CompressedManifestStaticFilesStorage")
    assert values["CACHES"]["default"]["BACKEND"].endswith("LocMemCache")
    proxied = start_ups["behind a proxy, on Redis"]["values"]
    assert proxied["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert proxied["CSRF_TRUSTED_ORIGINS"] == ["https://quotes.example.com"]
    for alias in ("default", "counters"):
        cache = proxied["CACHES"][alias]
        assert cache["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
        assert cache["LOCATION"] == "redis://127.0.0.1:6399/2"
        assert cache["OPTIONS"]["serializer"] == "quotes.cache.JSONSerializer"  # never pickle


@pytest.mark.system
def test_manage_py_refuses_to_start_production_without_its_secret() -> None:
    env = {**_base_env(), "DJANGO_ALLOWED_HOSTS": "quotes.example.com"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: DJANGO_SECRET_KEY must be"), last
    assert "make run" in last


# -- the README's table ----------------------------------------------------------------------------


@pytest.mark.unit
def test_readme_table_has_one_row_for_each_variable_settings_reads() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    cells = re.findall(r"^\| (`[A-Z].*?) \|", section, flags=re.MULTILINE)  # a row's names: `A`, `B`
    rows = [name for cell in cells for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)]
    # Every variable config/settings.py reads: `env.<cast>("NAME", ...)`.
    read = set(
        re.findall(r'\benv\.\w+\(\s*"([A-Z][A-Z0-9_]*)"', (ROOT / "config" / "settings.py").read_text())
    )
    assert 30 <= len(read) <= 40  # the walk found the readers; issue 34: at most 40 variables
    assert sorted({name for name in rows if rows.count(name) > 1}) == []
    assert sorted(read - set(rows)) == [], "read by config/settings.py, missing from the README's table"
    assert sorted(set(rows) - read - READ_ELSEWHERE) == [], "in the README's table, read by nothing"
