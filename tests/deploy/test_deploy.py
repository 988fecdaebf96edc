"""Production settings, checked the way production starts: a fresh interpreter with the
environment set (settings are read once, at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

ROOT = Path(__file__).resolve().parents[2]
SECRET = "prod-test-" + "k3y" * 20
PRODUCTION = {
    "DJANGO_DEBUG": "false",
    "DJANGO_SECRET_KEY": SECRET,
    "DJANGO_ALLOWED_HOSTS": "quotes.example.com",
    "AI_BACKEND": "local",
}
SHOW_SETTINGS = """
import json, django
from django.conf import settings
django.setup()
print(json.dumps({name: getattr(settings, name, None) for name in %r}, default=str))
"""


def _env(**overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CLOUDFLARE_", "AI_"))}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)  # None: the variable is unset
        else:
            env[name] = value
    return env


def _run(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**_env(**env), "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _settings(*names: str, **env: str | None) -> dict[str, object]:
    result = _run(SHOW_SETTINGS % (names,), **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.system
@pytest.mark.parametrize(
    ("missing", "extra"),
    [
        ("DJANGO_SECRET_KEY", {}),
        ("DJANGO_ALLOWED_HOSTS", {}),
        ("CLOUDFLARE_ACCOUNT_ID", {"AI_BACKEND": "workers-ai", "CLOUDFLARE_API_TOKEN": "cfut_x"}),
        ("CLOUDFLARE_API_TOKEN", {"AI_BACKEND": "workers-ai", "CLOUDFLARE_ACCOUNT_ID": "acct"}),
    ],
)
def test_production_refuses_to_start_without(missing: str, extra: dict[str, str]) -> None:
    env: dict[str, str | None] = {**PRODUCTION, **extra}
    env[missing] = None
    result = _run("import django; django.setup()", **env)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and missing in result.stderr.splitlines()[-1]


def _check_deploy(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=_env(**PRODUCTION, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.system
def test_check_deploy_passes_clean_under_production_settings_with_nothing_silenced() -> None:
    """Django's deploy checks all run (its security, clickjacking and CSRF middleware are in
    MIDDLEWARE under their own names, so the HSTS, SSL and cookie checks that depend on them run
    too), and so do the app's own: quotes.E001 compares the inlined middleware with Django's
    (quotes/forks.py), quotes.W002 the pinned upstream code."""
    assert _settings("SILENCED_SYSTEM_CHECKS", **PRODUCTION) == {"SILENCED_SYSTEM_CHECKS": []}
    result = _check_deploy(DJANGO_SECURE_HSTS_PRELOAD="true")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


@pytest.mark.system
def test_check_deploy_asks_the_domains_owner_about_hsts_preload() -> None:
    """Preloading is a commitment for the whole domain: not made by default, and not silenced."""
    result = _check_deploy()
    assert result.returncode != 0
    assert "security.W021" in result.stderr and "1 issue (0 silenced)" in result.stderr


@pytest.mark.system
def test_check_deploy_sees_a_missing_security_middleware(tmp_path: Path) -> None:
    """Unsilenced, Django's W001 fires when its SecurityMiddleware is not in MIDDLEWARE."""
    (tmp_path / "without_security.py").write_text(
        "from config.settings import *  # noqa: F403\n"
        "MIDDLEWARE = [m for m in MIDDLEWARE if m != 'django.middleware.security.SecurityMiddleware']  # noqa: F405\n"
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={
            **_env(**PRODUCTION, DJANGO_SECURE_HSTS_PRELOAD="true"),
            "DJANGO_SETTINGS_MODULE": "without_security",
            "PYTHONPATH": f"{tmp_path}:{ROOT}",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "security.W001" in result.stderr, result.stdout + result.stderr


@pytest.mark.system
def test_production_settings_are_secure_by_default() -> None:
    values = _settings(
        "SECURE_SSL_REDIRECT",
        "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE",
        "SECURE_HSTS_SECONDS",
        "SECURE_PROXY_SSL_HEADER",
        "STORAGES",
        "SERVESTATIC_USE_FINDERS",
        "LOG_FORMAT",
        "CHANNEL_LAYERS",
        "QUOTES_LOG_CONTENT",
        **{**PRODUCTION, "REDIS_URL": None, "DATABASE_URL": None},  # the defaults, whatever CI set
    )
    assert values["SECURE_SSL_REDIRECT"] is True
    assert values["SESSION_COOKIE_SECURE"] is True and values["CSRF_COOKIE_SECURE"] is True
    assert values["SECURE_HSTS_SECONDS"] == 31_536_000
    assert values["SECURE_PROXY_SSL_HEADER"] is None  # only when told there is a proxy
    storages = values["STORAGES"]
    assert isinstance(storages, dict)
    assert storages["staticfiles"]["BACKEND"] == "servestatic.storage.CompressedManifestStaticFilesStorage"
    assert values["SERVESTATIC_USE_FINDERS"] is False
    assert values["LOG_FORMAT"] == "json"
    assert values["QUOTES_LOG_CONTENT"] is False
    assert values["CHANNEL_LAYERS"] == {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.mark.system
def test_proxy_origins_and_redis_come_from_the_environment() -> None:
    values = _settings(
        "SECURE_PROXY_SSL_HEADER",
        "CSRF_TRUSTED_ORIGINS",
        "SECURE_SSL_REDIRECT",
        "CHANNEL_LAYERS",
        "CACHES",
        **PRODUCTION,
        DJANGO_SECURE_PROXY_SSL_HEADER="true",
        DJANGO_CSRF_TRUSTED_ORIGINS="https://quotes.example.com,https://www.example.com",
        DJANGO_SECURE_SSL_REDIRECT="false",
        REDIS_URL="redis://127.0.0.1:6399/2",
    )
    assert values["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert values["CSRF_TRUSTED_ORIGINS"] == ["https://quotes.example.com", "https://www.example.com"]
    assert values["SECURE_SSL_REDIRECT"] is False
    assert values["CHANNEL_LAYERS"] == {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": ["redis://127.0.0.1:6399/2"]},
        }
    }
    caches = values["CACHES"]
    assert isinstance(caches, dict)
    assert caches["default"]["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
    assert caches["default"]["OPTIONS"]["serializer"] == "quotes.ai.cache.JSONSerializer"  # never pickle


@pytest.mark.system
def test_csrf_trusted_origins_need_a_scheme() -> None:
    result = _run(
        "import django; django.setup()", **PRODUCTION, DJANGO_CSRF_TRUSTED_ORIGINS="quotes.example.com"
    )
    assert result.returncode != 0 and "DJANGO_CSRF_TRUSTED_ORIGINS" in result.stderr


@pytest.mark.system
def test_collectstatic_writes_hashed_compressed_files(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"],
        cwd=ROOT,
        env=_env(**PRODUCTION, DJANGO_STATIC_ROOT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    hashed = json.loads((tmp_path / "staticfiles.json").read_text())["paths"]["css/site.css"]
    assert hashed != "css/site.css"
    assert (tmp_path / hashed).exists() and (tmp_path / f"{hashed}.gz").exists()


@pytest.mark.integration
@pytest.mark.django_db
def test_pages_carry_csp_without_unsafe_inline_and_security_headers(client: Client) -> None:
    response = client.get("/")
    policy = response.headers["Content-Security-Policy"]
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert "script-src 'self'" in policy and "style-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "same-origin"
    assert response.headers["X-Frame-Options"] == "DENY"


# --- the Dockerfile's HEALTHCHECK (run as a process: there is no Docker engine here) ----------


def _database_url() -> str:
    """The test database (migrated, with the seeded personas) as a URL for a subprocess."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


@pytest.mark.system
@pytest.mark.services
@pytest.mark.django_db
@pytest.mark.parametrize(
    "allowed_hosts",
    ["quotes.example.com", "quotes.example.com,www.example.com", ".example.com", "*"],
)
def test_docker_healthcheck_passes_with_production_allowed_hosts(allowed_hosts: str, tmp_path: Path) -> None:
    """The Dockerfile's HEALTHCHECK line, run against daphne started with the Dockerfile's CMD
    under production settings whose ALLOWED_HOSTS do not list 127.0.0.1 (the address the probe
    connects to): it must report healthy out of the box. The old probe sent Host 127.0.0.1 and
    got a 400."""
    from harness.daphne import command_args, environment, instruction, running_daphne
    from harness.services import free_port

    port = free_port()
    env = environment(DJANGO_ALLOWED_HOSTS=allowed_hosts, DATABASE_URL=_database_url())
    healthcheck = instruction("Dockerfile", "HEALTHCHECK ")
    probe = command_args(healthcheck[healthcheck.index("CMD ") + 4 :].replace(":8000", f":{port}"))
    assert probe[0] == "python"
    probe[0] = sys.executable

    with running_daphne("Dockerfile", port, env, tmp_path / "daphne.log"):
        healthy = subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        # A probe is not fooled: a failing /healthz (here, its database gone) is reported.
        broken = {**env, "DATABASE_URL": f"sqlite:///{tmp_path / 'missing' / 'db.sqlite3'}"}
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr

    with running_daphne("Dockerfile", port, broken, tmp_path / "daphne-broken.log"):
        unhealthy = subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert unhealthy.returncode != 0 and "503" in unhealthy.stderr, unhealthy.stdout + unhealthy.stderr


@pytest.mark.system
@pytest.mark.django_db
def test_healthcheck_command_reports_an_unreachable_server() -> None:
    from harness.services import free_port

    result = subprocess.run(
        [sys.executable, "manage.py", "healthcheck", "--url", f"http://127.0.0.1:{free_port()}/healthz"],
        cwd=ROOT,
        env=_env(**PRODUCTION, DJANGO_SECURE_SSL_REDIRECT="false"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "did not answer" in result.stderr
