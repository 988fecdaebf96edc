"""daphne as the deploy files start it (a systemd unit's ExecStart, or the Dockerfile's CMD),
run here as a subprocess on a free 127.0.0.1 port: the tests and the benchmarks read the flags
from the files themselves, so a change to a unit or to the Dockerfile is what gets tested. Any
other server (the benchmarks' uvicorn, LiteLLM, `make run`'s) is started and waited for here too
(`start`, `running`)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.services import free_port, stop_process, tail
from harness.workers_ai import FakeWorkersAI, backend_env

ROOT = Path(__file__).resolve().parents[1]

#: Production settings, whatever the test run's own environment says.
PRODUCTION = {
    "DJANGO_DEBUG": "false",
    "DJANGO_SECRET_KEY": "deployed-test-" + "k3y" * 20,
    "DJANGO_SECURE_SSL_REDIRECT": "false",  # plain HTTP on 127.0.0.1 here
    "AI_BACKEND": "local",
}


def instruction(source: str, prefix: str) -> str:
    """The text of `prefix` (e.g. `ExecStart=`, `CMD `) in deploy/`source`, continuation lines joined."""
    lines = (ROOT / "deploy" / source).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    text = lines[start].removeprefix(prefix)
    while text.endswith("\\"):
        start += 1
        text = text[:-1] + " " + lines[start]
    return text.strip()


def command_args(text: str) -> list[str]:
    """A Dockerfile exec-form array, or a shell-style command line."""
    return list(json.loads(text)) if text.startswith("[") else shlex.split(text)


#: The unit the production layout runs N of behind nginx (docs/deployment.md), and the one a
#: single process runs as (a TCP port, no nginx in front).
INSTANCE_UNIT = "systemd/persona-quotes@.service"
SINGLE_UNIT = "systemd/persona-quotes.service"
APP = "config.asgi:application"


def daphne_command(source: str, port: int, application: str = APP) -> list[str]:
    """daphne's arguments as deploy/`source` runs it, on 127.0.0.1:`port` instead of its socket
    or public port. The app runs under `quotes.ops.server` (daphne, draining on SIGTERM) as
    deployed; another `application` (the benchmarks' naive proxy) under plain daphne with the
    same flags, so both pay for the same server."""
    prefix = "CMD " if source == "Dockerfile" else "ExecStart="
    args = command_args(instruction(source, prefix))
    assert args[0].endswith("python") and args[1:3] == ["-m", "quotes.ops.server"], args
    assert args[-1] == APP, args
    args = args[2:]  # daphne's own arguments follow quotes.ops.server (daphne, draining on SIGTERM)
    if "--unix-socket" in args:
        at = args.index("--unix-socket")
        args[at : at + 2] = ["-b", "127.0.0.1", "-p", str(port)]
    else:
        args[args.index("-b") + 1] = "127.0.0.1"
        args[args.index("-p") + 1] = str(port)
    if application != APP:
        args[0], args[-1] = "daphne", application
    return [sys.executable, "-m", *args]


def make_command(target: str, port: int) -> list[str]:
    """The command the Makefile's `target` runs (its one recipe line: `serve`, which `make run`
    ends in), on 127.0.0.1:`port`: what a developer's server is."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(f"{target}:")
    recipe = next(line.strip() for line in lines[start + 1 :] if line.startswith("\t"))
    args = shlex.split(recipe.replace("$(HOST)", "127.0.0.1").replace("$(PORT)", str(port)))
    assert args[0].endswith("python") and args[1:3] == ["-m", "quotes.ops.server"], args
    return [sys.executable, *args[1:]]


def environment(**overrides: str) -> dict[str, str]:
    prefixes = (
        "DJANGO_",
        "CLOUDFLARE_",
        "AI_",
        "QUOTES_",
        "OPENAI_",
        "DATABASE_URL",
        "REDIS_URL",
        "LOCAL_MODEL_",
        "OTEL_",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(PRODUCTION)
    env.update(overrides)
    return env


def production_base_env(*, database_url: str, redis_url: str, **settings: str) -> dict[str, str]:
    """`environment` on PostgreSQL and Redis with the workers-ai backend, behind nginx (the
    scale-out check, the fault suite and the benchmarks' layout), then `settings`."""
    layout = {
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "DJANGO_SECURE_PROXY_SSL_HEADER": "true",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "AI_BACKEND": "workers-ai",
    }
    return environment(**{**layout, **settings})


def manage(env: dict[str, str], *args: str, cwd: Path = ROOT) -> None:
    """manage.py `args` under `env` (in the source tree `cwd`); RuntimeError with its output if
    it fails."""
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}{result.stderr}")


#: A SQLite file migrated once per process and source tree, which `migrate` copies.
_MIGRATED: dict[Path, Path] = {}


def migrate(env: dict[str, str], *, cwd: Path = ROOT) -> None:
    """The database of `env`, migrated (a fresh SQLite file, or a server's database). A SQLite
    file that does not exist yet is a copy of one migrated once by this process: migrating
    starts Django and runs every migration (over a second), a copy takes milliseconds, and a
    system test starts several sites."""
    url = env.get("DATABASE_URL", "")
    target = Path(cwd) / url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    if target is None or target.exists():
        manage(env, "migrate", "--noinput", "-v0", cwd=cwd)
        return
    template = _MIGRATED.get(Path(cwd))
    if template is None:
        folder = tempfile.mkdtemp(prefix="quotes-migrated-")
        atexit.register(shutil.rmtree, folder, True)
        template = Path(folder) / "db.sqlite3"
        manage({**env, "DATABASE_URL": f"sqlite:///{template}"}, "migrate", "--noinput", "-v0", cwd=cwd)
        _MIGRATED[Path(cwd)] = template
    shutil.copyfile(template, target)


def collectstatic(env: dict[str, str]) -> None:
    """collectstatic into STATIC_ROOT (staticfiles/ in the source tree), as a release does, unless
    its manifest is newer than every file under static/: production pages need the manifest."""
    manifest = ROOT / "staticfiles" / "staticfiles.json"
    sources = (path.stat().st_mtime for path in (ROOT / "static").rglob("*") if path.is_file())
    if not manifest.exists() or max(sources, default=0) > manifest.stat().st_mtime:
        manage(env, "collectstatic", "--noinput", "-v0")


def start(
    command: Sequence[str], env: dict[str, str], log: Path, *, cwd: Path | str = ROOT
) -> subprocess.Popen[bytes]:
    """`command` in a subprocess, its output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(list(command), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def start_daphne(
    port: int, env: dict[str, str], log: Path, *, source: str = INSTANCE_UNIT
) -> subprocess.Popen[bytes]:
    """daphne as deploy/`source` starts it (`python -m quotes.ops.server ...`, draining on SIGTERM),
    on 127.0.0.1:`port`, its output appended to `log`."""
    return start(daphne_command(source, port), env, log)


def wait_until_up(
    url: str,
    process: subprocess.Popen[bytes],
    log: Path,
    *,
    any_status: bool = False,
    timeout_s: float = 60.0,
) -> None:
    """Until GET `url` answers 200 (or, `any_status`, anything: the server is up); RuntimeError
    with the log's tail if the process exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200 or any_status:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer:\n{tail(log)}")
        time.sleep(0.2)


def wait_until_healthy(
    url: str, process: subprocess.Popen[bytes], log: Path, *, timeout_s: float = 60.0
) -> None:
    """Until `url`/healthz answers 200 (what deploy/rolling-restart waits for)."""
    wait_until_up(url + "/healthz", process, log, timeout_s=timeout_s)


@contextlib.contextmanager
def running(
    command: Sequence[str],
    port: int,
    env: dict[str, str],
    log: Path,
    *,
    path: str = "/healthz",
    any_status: bool = False,
    cwd: Path | str = ROOT,
    timeout_s: float = 60.0,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`command`, a server on 127.0.0.1:`port`: (the process, its URL) once GET `path` answers
    (200, or anything with `any_status`); stopped on the way out."""
    process = start(command, env, log, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url + path, process, log, any_status=any_status, timeout_s=timeout_s)
        yield process, url
    finally:
        stop_process(process, timeout=15)


@contextlib.contextmanager
def running_daphne(
    source: str, port: int, env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """daphne started from deploy/`source`, once /healthz answers (any status: a test may start
    it with no database; a request to the API would count against the rate limit under test)."""
    command = daphne_command(source, port)
    with running(command, port, env, log, any_status=True) as (process, _):
        yield process


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    """Poll `condition` until it holds; fail saying `what` never happened."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


# -- a site on SQLite: the browser tests' and the system tests' one-process server ----------------

ACCOUNT_ID = "acct-test"
#: A secret-looking credential the Workers AI sites run with: it must never reach a page.
API_TOKEN = "cfut_BROWSER-4c1d9e8f7a6b5c4d3e2f1a0b9c8d7e6fQQ"


@dataclass
class Site:
    url: str
    db_path: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def query(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.db_path) as connection:
            return connection.execute(sql, params).fetchall()

    def last_row(self, columns: str = "error_code, text") -> tuple[Any, ...]:
        """The newest generation's status and `columns`, once it is no longer `running`."""
        sql = f"SELECT status, {columns} FROM quotes_generation ORDER BY id DESC LIMIT 1"
        wait_for(lambda: [r[0] for r in self.query(sql)] not in ([], ["running"]), "a finished row")
        return self.query(sql)[0]


@contextmanager
def start_site(tmp_dir: Path, **settings: str) -> Iterator[Site]:
    """A fresh SQLite file, migrated, and the app served on it by daphne as deploy/ runs it."""
    db_path = tmp_dir / "db.sqlite3"
    defaults = {
        "DJANGO_DEBUG": "true",  # static files from the source tree (no collectstatic); the same CSP
        "DATABASE_URL": f"sqlite:///{db_path}",
        "LOCAL_MODEL_PRELOAD": "true",
        # Sites are shared by tests: no answer cache, no rate limit to speak of. Tests of those opt in.
        "QUOTES_CACHE_TTL": "0",
        "QUOTES_RATE_LIMIT": "1000/minute",
        "QUOTES_MAX_CONCURRENT_STREAMS": "50",
        "QUOTES_DRAIN_TIMEOUT_S": "1",
    }
    env = environment(**{**defaults, **settings})
    migrate(env)
    port, log_path = free_port(), tmp_dir / "daphne.log"
    command = daphne_command(SINGLE_UNIT, port)
    with running(command, port, env, log_path, path="/", any_status=True) as (process, url):
        yield Site(url, db_path, log_path, process)


def workers_ai_env(fake: FakeWorkersAI) -> dict[str, str]:
    return {**backend_env(fake.api_base_url, ACCOUNT_ID, API_TOKEN), "LOCAL_MODEL_PRELOAD": "false"}
