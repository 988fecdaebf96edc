"""Real PostgreSQL, Redis and nginx servers on 127.0.0.1, in a temporary directory, for the tests
and the benchmarks; free ports, and loopback addresses for clients of their own.

Each server runs from the Debian package on a free port and is stopped (and its files removed)
on exit. `scripts/test-services` (the suite's second run) runs:

    python -m harness.services -- pytest -q     # runs pytest with DATABASE_URL/REDIS_URL set

PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user (created by
the Debian package) and its commands run through `runuser`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_CONF = ROOT / "deploy" / "nginx" / "persona-quotes.conf"
LOCATIONS_CONF = ROOT / "deploy" / "nginx" / "persona-quotes-locations.conf"
START_TIMEOUT_S = 30.0
DB_NAME = "persona_quotes"
DB_USER = "persona_quotes"
DB_PASSWORD = "persona-quotes-test"  # a throwaway cluster on 127.0.0.1, gone after the run


class ServiceError(RuntimeError):
    pass


def free_port() -> int:
    """A port nothing listens on now (connecting to it is refused until a server takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def client_address(index: int) -> str:
    """Loopback address `index`, each in a /24 of its own (127.1.0.2, 127.1.1.2, ...; 127.0.0.1 is
    the servers'): a client of its own to the app (its own rate count and slots, and its own
    network's), as a visitor on another network is. Linux answers on every address of 127.0.0.0/8.
    A test of neighbours picks addresses of one /24 itself."""
    return f"127.{1 + index // 256 % 254}.{index % 256}.2"


def client_at(address: str, timeout: float = 30) -> httpx.Client:
    """A client whose connections come from `address` (127.0.0.x)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout)


def wait_for_port(port: int, *, process: subprocess.Popen[bytes] | None, name: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        if process is not None and process.poll() is not None:
            raise ServiceError(f"{name} exited with {process.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise ServiceError(
                f"{name} did not listen on port {port} within {START_TIMEOUT_S:g} s:\n{tail(log)}"
            )
        time.sleep(0.05)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


# --- PostgreSQL -----------------------------------------------------------------------------------


def _postgres_bin() -> Path:
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]), reverse=True
    )
    if not candidates:
        raise ServiceError("PostgreSQL is not installed: apt-get install -y postgresql")
    return candidates[0].parent


@dataclass
class Postgres:
    url: str
    port: int
    data_dir: Path
    #: the server's binaries; the directory of its socket and its log; its command-line settings
    bin_dir: Path
    base: Path
    options: str

    def _run(self, *command: str) -> str:
        as_root = os.geteuid() == 0
        full = ["runuser", "-u", "postgres", "--", *command] if as_root else list(command)
        result = subprocess.run(full, cwd=self.base, capture_output=True, text=True)
        if result.returncode != 0:
            log = self.base / "postgres.log"
            raise ServiceError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}\n{tail(log)}")
        return result.stdout

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop: `fast` rolls back open transactions and closes every connection."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def start(self) -> None:
        """pg_ctl start, as the cluster was first started (its port, socket directory, settings)."""
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.base / "postgres.log"),
            "-o",
            self.options,
            "-w",
            "-t",
            "30",
            "start",
        )

    def psql(self, *commands: str, database: str = "postgres") -> str:
        """Run SQL `commands` as the superuser over the unix socket; their output, unaligned."""
        args = [str(self.bin_dir / "psql"), "-h", str(self.base), "-p", str(self.port), "-U", "postgres"]
        args += ["-d", database, "-v", "ON_ERROR_STOP=1", "-At"]
        for command in commands:
            args += ["-c", command]
        return self._run(*args)


@contextlib.contextmanager
def postgres(workdir: Path) -> Iterator[Postgres]:
    """A fresh cluster: a database and an owner that may create the test database."""
    bin_dir = _postgres_bin()
    as_root = os.geteuid() == 0
    base = workdir / "postgres"
    base.mkdir()
    data_dir = base / "data"
    if as_root:
        # runuser needs to reach the directory: make the whole path traversable, the cluster its own.
        for parent in (workdir, base):
            parent.chmod(0o755)
        shutil.chown(base, "postgres", "postgres")

    port = free_port()
    options = (
        f"-p {port} -k {base} -c listen_addresses=127.0.0.1 "
        # A throwaway cluster: durability only costs time here.
        "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
    )
    url = f"postgres://{DB_USER}:{DB_PASSWORD}@127.0.0.1:{port}/{DB_NAME}"
    server = Postgres(url=url, port=port, data_dir=data_dir, bin_dir=bin_dir, base=base, options=options)
    server._run(
        str(bin_dir / "initdb"),
        "-D",
        str(data_dir),
        "-U",
        "postgres",
        "--auth-local=trust",
        "--auth-host=scram-sha-256",
        "--encoding=UTF8",
        "--no-sync",
    )
    server.start()
    try:
        server.psql(
            f"CREATE ROLE {DB_USER} LOGIN CREATEDB PASSWORD '{DB_PASSWORD}'",
            f"CREATE DATABASE {DB_NAME} OWNER {DB_USER}",
        )
        yield server
    finally:
        with contextlib.suppress(ServiceError):
            server.stop("immediate")


# --- Redis ----------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A redis-server that a test may stop, start again (empty, on the same port) and pause."""

    url: str
    port: int
    command: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        wait_for_port(self.port, process=self.process, name="redis-server", log=self.log)

    def stop(self) -> None:
        if self.process is not None:
            self.resume()  # a stopped (SIGSTOP) process would not hear the SIGTERM
            stop_process(self.process)
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server holds every connection open and answers nothing (a hung Redis)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    executable = shutil.which("redis-server")
    if executable is None:
        raise ServiceError("redis-server is not installed: apt-get install -y redis-server")
    base = workdir / "redis"
    base.mkdir()
    port, log = free_port(), base / "redis.log"
    command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = RedisServer(
        url=f"redis://127.0.0.1:{port}/0", port=port, command=[*command, "--dir", str(base)], log=log
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def redis(workdir: Path) -> Iterator[str]:
    with redis_server(workdir) as server:
        yield server.url


# --- nginx ----------------------------------------------------------------------------------------


@dataclass
class Nginx:
    url: str
    port: int
    log_dir: Path


@contextlib.contextmanager
def nginx(workdir: Path, *, site: str, port: int, worker_connections: int = 256) -> Iterator[Nginx]:
    """nginx in the foreground with `site` (server and upstream blocks) as its whole http config.
    Each proxied stream takes two of the `worker_connections` (the client's and daphne's)."""
    executable = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(executable).exists():
        raise ServiceError("nginx is not installed: apt-get install -y nginx")
    base = workdir / "nginx"
    base.mkdir()
    base.chmod(0o755)  # the worker (nobody, when started as root) reaches its temp paths
    temp = {name: base / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    conf = base / "nginx.conf"
    conf.write_text(
        f"""
worker_processes 1;
daemon off;
pid {base}/nginx.pid;
error_log {base}/error.log info;
worker_rlimit_nofile {2 * worker_connections + 64};
events {{ worker_connections {worker_connections}; }}
http {{
    access_log {base}/access.log;
    client_body_temp_path {temp["client_body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    types {{ text/html html; text/css css; application/javascript js; }}
    default_type application/octet-stream;
{site}
}}
"""
    )
    log = base / "stderr.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [executable, "-p", str(base), "-e", str(base / "error.log"), "-c", str(conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_port(port, process=process, name="nginx", log=base / "error.log")
        yield Nginx(url=f"http://127.0.0.1:{port}", port=port, log_dir=base)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGQUIT)  # graceful: finish open requests, then exit
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                stop_process(process)


def deploy_upstream(addresses: list[str]) -> str:
    """deploy/nginx/persona-quotes.conf's `upstream persona_quotes` block (the hash on the
    csrftoken cookie, keep-alive), its servers pointed at `addresses` (host:port) with the
    parameters the deploy file gives its own (max_fails, max_conns): what nginx does with a
    visitor, a draining or restarting process or a full one is what the deploy file makes it do."""
    text = DEPLOY_CONF.read_text()
    block = re.search(r"upstream persona_quotes \{(.*?)\n\}", text, re.S)
    assert block is not None, "no upstream block in deploy/nginx/persona-quotes.conf"
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    directives = [line for line in lines if line]
    servers = [line for line in directives if line.startswith("server ")]
    params = servers[0].removesuffix(";").split()[2:] if servers else []
    others = [line for line in directives if not line.startswith("server ")]
    body = [f"server {address} {' '.join(params)};".replace(" ;", ";") for address in addresses]
    return "upstream persona_quotes {\n" + "\n".join(f"        {x}" for x in [*others, *body]) + "\n    }"


def deploy_site(
    port: int, addresses: list[str], *, listen: str = "", http: str = "", server: str = ""
) -> str:
    """nginx's http-context config for `addresses` (host:port daphnes) as deploy/nginx has it:
    persona-quotes.conf's `map $http_upgrade` block, its `limit_conn_zone` lines (the locations
    use them) and its upstream block (deploy_upstream), and a plain-HTTP server on
    127.0.0.1:`port` that includes persona-quotes-locations.conf. Every nginx of the tests and
    the benchmarks is built here, so a change to the deploy files
    is what they run. `listen`: parameters of the listen directive
    (a benchmark's backlog); `http`: more http-context text (a log_format, other servers);
    `server`: more directives in the server block (an access log)."""
    text = DEPLOY_CONF.read_text()
    upgrade = re.search(r"^map \$http_upgrade \$connection_upgrade \{.*?\n\}", text, re.S | re.M)
    assert upgrade is not None, "no `map $http_upgrade` block in deploy/nginx/persona-quotes.conf"
    zones = "\n".join(re.findall(r"^limit_conn_zone .*;$", text, re.M))
    return f"""
{upgrade.group(0)}
{zones}
{http}
    {deploy_upstream(addresses)}
    server {{
        listen 127.0.0.1:{port}{" " + listen if listen else ""};
        server_name 127.0.0.1;
        {server}
        include {LOCATIONS_CONF};
    }}
"""


# --- the command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command with DATABASE_URL and REDIS_URL pointing at a fresh PostgreSQL and Redis."
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run, after --")
    with tempfile.TemporaryDirectory(prefix="persona-quotes-services-") as tmp:
        workdir = Path(tmp)
        try:
            with postgres(workdir) as pg, redis(workdir) as redis_url:
                print(f"==> PostgreSQL on 127.0.0.1:{pg.port}, Redis at {redis_url}", flush=True)
                env = {**os.environ, "DATABASE_URL": pg.url, "REDIS_URL": redis_url}
                return subprocess.run(command, env=env).returncode
        except ServiceError as exc:
            print(f"test-services: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
