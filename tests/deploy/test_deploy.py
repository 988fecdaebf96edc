"""The deploy files, checked by the tools that read them and against each other: `manage.py check
--deploy` with nothing silenced, `nginx -t` on the site and its snippets, `systemd-analyze verify`
on the units, the numbers that must agree (nginx's upstream and timeouts, the units' stop timeout
and the drain, the Dockerfile's daphne and the unit's), and the Dockerfile's HEALTHCHECK run as a
process (no Docker engine here). Every system test starts daphne with the units' own command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core import checks

from harness.daphne import (
    INSTANCE_UNIT,
    ROOT,
    SINGLE_UNIT,
    command_args,
    environment,
    instruction,
    migrate,
    running_daphne,
)
from harness.services import free_port
from quotes.checks import MIDDLEWARE_MISSING

DEPLOY = ROOT / "deploy"
SITE = (DEPLOY / "nginx" / "persona-quotes.conf").read_text()
LOCATIONS = (DEPLOY / "nginx" / "persona-quotes-locations.conf").read_text()


def _run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.system
def test_check_deploy_passes_under_production_settings_with_nothing_else_silenced() -> None:
    """Only Django's three warnings that look for its middleware by dotted path are silenced
    (quotes.checks gives them again when a class is missing); a weakened setting still fails."""
    env = environment(DJANGO_ALLOWED_HOSTS="quotes.example.com", DJANGO_SECURE_HSTS_PRELOAD="true")
    env.pop("DJANGO_SECURE_SSL_REDIRECT")  # production's own default: on
    result = _run(sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (3 silenced)." in result.stdout
    env["DJANGO_SECURE_SSL_REDIRECT"] = "false"
    result = _run(sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 1 and "(security.W008)" in result.stderr, result.stdout + result.stderr


@pytest.mark.unit
def test_djangos_security_checks_see_its_middleware_run_without_thread_hops(settings: Any) -> None:
    """quotes.ops.middleware's classes are Django's own: its checks judge the settings as with
    Django's paths, and say so when one is missing."""
    assert list(MIDDLEWARE_MISSING) == settings.SILENCED_SYSTEM_CHECKS
    settings.SECURE_SSL_REDIRECT, settings.X_FRAME_OPTIONS = False, "SAMEORIGIN"
    assert {"security.W008", "security.W019"} <= security_ids()
    settings.MIDDLEWARE = [
        path for path in settings.MIDDLEWARE if "Security" not in path and "XFrame" not in path
    ]
    ids = security_ids()
    assert {"quotes.security.W001", "quotes.security.W002"} <= ids and not {
        "security.W008",
        "security.W019",
    } & ids


def security_ids() -> set[str]:
    messages = checks.run_checks(tags=[checks.Tags.security], include_deployment_checks=True)
    return {message.id for message in messages if not message.is_silenced() and message.id}


@pytest.mark.integration
def test_nginx_accepts_the_site_with_its_snippets(tmp_path: Path) -> None:
    """The site and its three snippets as docs/deployment.md installs them, with their paths in a
    temporary directory and a self-signed certificate in place of Let's Encrypt's."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    for snippet in ("locations", "metrics", "log"):
        shutil.copy(DEPLOY / "nginx" / f"persona-quotes-{snippet}.conf", tmp_path)
    certificate, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=quotes.example.com"]
    assert _run(*openssl, "-days", "1", "-keyout", str(key), "-out", str(certificate)).returncode == 0
    site = SITE.replace("/etc/nginx/snippets/", f"{tmp_path}/").replace("/var/log/nginx/", f"{tmp_path}/")
    site = re.sub(r"ssl_certificate .*;", f"ssl_certificate {certificate};", site)
    site = re.sub(r"ssl_certificate_key .*;", f"ssl_certificate_key {key};", site)
    (tmp_path / "site.conf").write_text(site)
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"pid {tmp_path}/nginx.pid;\nevents {{}}\nhttp {{ include {tmp_path}/site.conf; }}\n")
    result = _run(nginx, "-t", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(conf))
    assert result.returncode == 0 and "test is successful" in result.stderr, result.stderr


@pytest.mark.integration
def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    """`systemd-analyze verify` on the units, with this checkout's python in place of
    /srv/persona-quotes/.venv's and users that exist here: no error and no warning (a misspelt
    key is only a warning)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    (tmp_path / "env").write_text("")
    for unit in (DEPLOY / "systemd").iterdir():
        text = unit.read_text().replace("/srv/persona-quotes/.venv/bin/python", sys.executable)
        text = text.replace("/etc/persona-quotes/env", str(tmp_path / "env"))
        text = re.sub(r"^(User|Group)=.*$", r"\1=root", text, flags=re.M)
        (tmp_path / unit.name).write_text(text)
    names = [path.name.replace("@.", "@1.") for path in (DEPLOY / "systemd").iterdir()]
    result = _run("systemd-analyze", "verify", *(str(tmp_path / name) for name in sorted(names)))
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


@pytest.mark.unit
def test_the_deploy_files_agree_with_each_other_and_the_settings() -> None:
    upstream = re.search(r"upstream persona_quotes \{(.*?)\n\}", SITE, re.S)
    assert upstream is not None
    lines = [line.split("#")[0].strip() for line in upstream[1].splitlines()]
    # One visitor's requests (its resume and its Stop) reach one process: the page's cookie.
    assert "hash $cookie_csrftoken consistent;" in lines and "least_conn;" not in lines
    # Shared by nginx's workers: max_conns counts for them all (issue 41).
    assert any(re.fullmatch(r"zone persona_quotes \d+k;", line) for line in lines)
    servers = [line for line in lines if line.startswith("server ")]
    assert len(servers) >= 2
    for server in servers:
        params = dict(param.split("=") for param in server.removesuffix(";").split()[2:])
        assert params["max_fails"] == "0", server  # a restarting process stays in rotation
        cap = settings.QUOTES_MAX_OPEN_STREAMS  # in step: a few for pages and health checks
        assert cap < int(params["max_conns"]) <= cap + 8, server
    zones = set(re.findall(r"^limit_conn_zone \$binary_remote_addr zone=(\w+):", SITE, re.M))
    assert set(re.findall(r"^\s*limit_conn (\w+) \d+;", LOCATIONS, re.M)) == zones
    main = LOCATIONS[LOCATIONS.index("location / {") :]
    read_timeout = int(re.search(r"proxy_read_timeout (\d+)s;", main)[1])  # type: ignore[index]
    assert read_timeout > settings.QUOTES_POLICY.total_timeout_s  # a generation never outlives it
    assert "proxy_next_upstream error timeout http_503 non_idempotent;" in main
    for unit in (INSTANCE_UNIT, SINGLE_UNIT):
        text = (DEPLOY / unit).read_text()
        stop = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M)[1])  # type: ignore[index]
        assert stop >= settings.QUOTES_DRAIN_TIMEOUT_S + 15, unit  # the drain, then the rows and the model
        assert "OUTBOX" not in text and "StateDirectory" not in text, unit
        args = command_args(instruction(unit, "ExecStart="))
        assert args[1:3] == ["-m", "quotes.ops.server"] and args[-1] == "config.asgi:application", args
        assert "--proxy-headers" not in args
    # The container runs the single unit's daphne, on its own port.
    docker = command_args(instruction("Dockerfile", "CMD "))
    single = command_args(instruction(SINGLE_UNIT, "ExecStart="))
    assert docker[1:] == [{"127.0.0.1": "0.0.0.0", "8001": "8000"}.get(arg, arg) for arg in single[1:]]


@pytest.mark.system
def test_docker_healthcheck_passes_with_production_hosts_and_fails_with_healthz(tmp_path: Path) -> None:
    """ALLOWED_HOSTS without 127.0.0.1, the address the probe connects to: it sends a Host of
    theirs. A failing /healthz (its database gone) and a server that is not there fail it."""
    database = tmp_path / "db.sqlite3"
    env = environment(DJANGO_ALLOWED_HOSTS=".example.com", DATABASE_URL=f"sqlite:///{database}")
    migrate(env)
    port = free_port()
    healthcheck = instruction("Dockerfile", "HEALTHCHECK ")
    probe = command_args(healthcheck[healthcheck.index("CMD ") + 4 :].replace(":8000", f":{port}"))
    assert probe[0] == "python"
    probe[0] = sys.executable
    with running_daphne("Dockerfile", port, env, tmp_path / "daphne.log"):
        healthy = _run(*probe, env=env)
        database.rename(tmp_path / "gone.sqlite3")
        failing = _run(*probe, env=env)
    gone = _run(*probe, env=env)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert failing.returncode != 0 and "503" in failing.stderr, failing.stdout + failing.stderr
    assert gone.returncode != 0 and "did not answer" in gone.stderr, gone.stderr
