"""daphne as the deploy files start it (a systemd unit's ExecStart, or the Dockerfile's CMD),
run here as a subprocess on a free 127.0.0.1 port: the tests read the flags from the files
themselves, so a change to a unit or to the Dockerfile is what gets tested."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tests.scaleout.services import stop_process, tail

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


def daphne_command(source: str, port: int) -> list[str]:
    """daphne's arguments as deploy/`source` runs it, on 127.0.0.1:`port` instead of its socket
    or public port."""
    prefix = "CMD " if source == "Dockerfile" else "ExecStart="
    args = command_args(instruction(source, prefix))
    assert args[0].endswith("python") and args[1:3] == ["-m", "quotes.server"], args
    args = args[2:]  # daphne's own arguments follow quotes.server (daphne, draining on SIGTERM)
    if "--unix-socket" in args:
        at = args.index("--unix-socket")
        args[at : at + 2] = ["-b", "127.0.0.1", "-p", str(port)]
    else:
        args[args.index("-b") + 1] = "127.0.0.1"
        args[args.index("-p") + 1] = str(port)
    return [sys.executable, "-m", *args]


def make_command(target: str, port: int) -> list[str]:
    """The command the Makefile's `target` runs (its one recipe line: `serve`, which `make run`
    ends in), on 127.0.0.1:`port`: what a developer's server is."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(f"{target}:")
    recipe = next(line.strip() for line in lines[start + 1 :] if line.startswith("\t"))
    args = shlex.split(recipe.replace("$(HOST)", "127.0.0.1").replace("$(PORT)", str(port)))
    assert args[0].endswith("python") and args[1:3] == ["-m", "quotes.server"], args
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
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(PRODUCTION)
    env.update(overrides)
    return env


#: The unit the production layout runs N of behind nginx (docs/deployment.md).
INSTANCE_UNIT = "systemd/persona-quotes@.service"


def start_daphne(
    port: int, env: dict[str, str], log: Path, *, source: str = INSTANCE_UNIT
) -> subprocess.Popen[bytes]:
    """daphne as deploy/`source` starts it (`python -m quotes.server ...`, draining on SIGTERM),
    on 127.0.0.1:`port`, its output appended to `log`. The scale-out check and the benchmarks
    start their processes here, so they run what the deploy files run."""
    with log.open("ab") as out:
        return subprocess.Popen(
            daphne_command(source, port), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def wait_until_healthy(
    url: str, process: subprocess.Popen[bytes], log: Path, *, timeout_s: float = 60.0
) -> None:
    """Until `url`/healthz answers 200 (what deploy/rolling-restart waits for); RuntimeError
    with the log's tail if the process exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daphne {url} did not become healthy:\n{tail(log)}")
        time.sleep(0.2)


def wait_until_answering(
    url: str, process: subprocess.Popen[bytes], log: Path, *, timeout_s: float = 60.0
) -> None:
    """Until `url` answers HTTP (any status: the server is up); RuntimeError with the log's tail
    if the process exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer:\n{tail(log)}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def running_daphne(
    source: str, port: int, env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """daphne started from deploy/`source`, once it answers HTTP (any status)."""
    process = start_daphne(port, env, log, source=source)
    try:
        wait_until_answering(f"http://127.0.0.1:{port}/api/quotes/stream", process, log)
        yield process
    finally:
        stop_process(process)


def deploy_upstream(addresses: list[str]) -> str:
    """deploy/nginx/persona-quotes.conf's `upstream persona_quotes` block (balancing, keep-alive),
    its servers pointed at `addresses` (host:port) with the parameters the deploy file gives its
    own (max_fails): what nginx does with a draining or restarting process is what the deploy
    file makes it do."""
    text = (ROOT / "deploy" / "nginx" / "persona-quotes.conf").read_text()
    block = re.search(r"upstream persona_quotes \{(.*?)\n\}", text, re.S)
    assert block is not None, "no upstream block in deploy/nginx/persona-quotes.conf"
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    directives = [line for line in lines if line]
    servers = [line for line in directives if line.startswith("server ")]
    params = servers[0].removesuffix(";").split()[2:] if servers else []
    others = [line for line in directives if not line.startswith("server ")]
    body = [f"server {address} {' '.join(params)};".replace(" ;", ";") for address in addresses]
    return "upstream persona_quotes {\n" + "\n".join(f"        {x}" for x in [*others, *body]) + "\n    }"


LOCATIONS_CONF = ROOT / "deploy" / "nginx" / "persona-quotes-locations.conf"


def deploy_site(
    port: int, addresses: list[str], *, listen: str = "", http: str = "", server: str = ""
) -> str:
    """nginx's http-context config for `addresses` (host:port daphnes) as deploy/nginx has it:
    persona-quotes.conf's `map $http_upgrade` block and its upstream block (deploy_upstream),
    and a plain-HTTP server on 127.0.0.1:`port` that includes persona-quotes-locations.conf.
    The scale-out check, the drain tests and the benchmarks all build their nginx here, so a
    change to the deploy files is what they run. `listen`: parameters of the listen directive
    (a benchmark's backlog); `http`: more http-context text (a log_format, other servers);
    `server`: more directives in the server block (an access log)."""
    text = (ROOT / "deploy" / "nginx" / "persona-quotes.conf").read_text()
    upgrade = re.search(r"^map \$http_upgrade \$connection_upgrade \{.*?\n\}", text, re.S | re.M)
    assert upgrade is not None, "no `map $http_upgrade` block in deploy/nginx/persona-quotes.conf"
    return f"""
{upgrade.group(0)}
{http}
    {deploy_upstream(addresses)}
    server {{
        listen 127.0.0.1:{port}{" " + listen if listen else ""};
        server_name 127.0.0.1;
        {server}
        include {LOCATIONS_CONF};
    }}
"""


# -- reading a deployed server's streams (httpx's lines) ---------------------------------------


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    """Poll `condition` until it holds; fail saying `what` never happened."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def events_of(lines: list[str]) -> list[dict[str, str]]:
    """SSE events (enough of the format for these streams: one data line each)."""
    events, current = [], {}
    for line in lines:
        if not line:
            if "data" in current:
                events.append({"event": "message", **current})
            current = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            if field == "id":  # every event's resume id (issue 14)
                continue
            current[field] = value.removeprefix(" ")
    return events


def text_of(events: list[dict[str, str]], *, html: bool = False) -> str:
    """The quote's text: from Workers AI's JSON events, or htmx's text fragments."""
    messages = [e["data"] for e in events if e["event"] == "message" and e["data"] != "[DONE]"]
    return "".join(messages if html else [json.loads(data)["response"] for data in messages])
