"""The production layout, with every part under the test's hand: two daphne processes started as
deploy/systemd/persona-quotes@.service starts them (harness/daphne.py), nginx in front with
deploy/nginx's upstream block and location rules (harness/services.py builds the site), one
PostgreSQL and one Redis from the Debian packages, and the fake Workers AI upstream
(harness/workers_ai.py) streaming `tokens` at `tokens_per_second`.

Each part can fail on demand: PostgreSQL stopped (`pg_ctl stop -m fast`) or made read-only, Redis
stopped (and started again, empty, on its port) or paused (SIGSTOP), a daphne killed (SIGKILL) or
restarted the way deploy/rolling-restart does it (SIGTERM, its drain, started again), the
upstream hung before its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psycopg

from harness.daphne import ROOT, collectstatic, manage, production_base_env, start_daphne, wait_until_healthy
from harness.services import (
    DB_NAME,
    Nginx,
    Postgres,
    RedisServer,
    ServiceError,
    client_at,
    deploy_site,
    free_port,
    nginx,
    postgres,
    redis_server,
    stop_process,
)
from harness.workers_ai import FakeWorkersAI, Scenario, backend_env

METRICS_TOKEN = secrets.token_urlsafe(24)
METRICS_CONF = ROOT / "deploy" / "nginx" / "persona-quotes-metrics.conf"
#: How long an upstream hang lasts when it is not ended first (longer than any run of the suite).
HUNG_S = 600.0
PERSONA = "alan-watts"


@dataclass
class Daphne:
    """One daphne process that can be killed or restarted on the same port (nginx's upstream
    block names the port)."""

    name: str
    port: int
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Started; `wait_healthy` waits for its /healthz."""
        self.process = start_daphne(self.port, self.env, self.log)

    def wait_healthy(self) -> None:
        assert self.process is not None
        wait_until_healthy(self.url, self.process, self.log)

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the drain), and its exit status once it has exited."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


@dataclass
class Settings:
    """What the layout is started with; the faults run on top of it."""

    #: QUOTES_TTFT_TIMEOUT: the whole wait for a first token (a hung upstream's bound)
    ttft_timeout_s: float = 3.0
    tokens: int = 40
    tokens_per_second: float = 20.0
    #: more environment for the daphnes (NAME: value)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Restart:
    """One process restarted by deploy/rolling-restart's step: its exit status, how long its
    drain and exit took, and how long until it was healthy again."""

    name: str
    exit_code: int
    drain_s: float
    back_s: float


class Layout:
    def __init__(
        self,
        *,
        settings: Settings,
        pg: Postgres,
        redis: RedisServer,
        fake: FakeWorkersAI,
        daphnes: list[Daphne],
        proxy: Nginx,
        metrics_urls: list[str],
    ) -> None:
        self.settings = settings
        self.pg = pg
        self.redis = redis
        self.fake = fake
        self.daphnes = daphnes
        self.proxy = proxy
        self.metrics_urls = metrics_urls
        self.env = daphnes[0].env
        self.scenario = Scenario()
        self.use_tokens(settings.tokens, settings.tokens_per_second)

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def text(self) -> str:
        """A whole quote, as the upstream sends it now."""
        return "".join(map(str, self.scenario.tokens))

    def use_tokens(self, tokens: int, tokens_per_second: float) -> None:
        """Each quote is `tokens` tokens long, streamed at `tokens_per_second`, from now on."""
        self.settings.tokens, self.settings.tokens_per_second = tokens, tokens_per_second
        self.scenario = Scenario(
            tokens=[f" w{n}" for n in range(tokens)], token_delay_s=1 / tokens_per_second
        )
        self.fake.default = self.scenario

    # -- the faults ---------------------------------------------------------------------------

    def upstream_hung(self, hung: bool) -> None:
        """The upstream takes requests and sends nothing (before its first token) while hung."""
        self.fake.default = replace(self.scenario, stall_before_s=HUNG_S) if hung else self.scenario

    def database_read_only(self, read_only: bool) -> None:
        """The database refuses writes, as after a failover to a replica: new sessions are
        read-only, and every open session of the app is ended, so none keeps the old setting."""
        self.pg.psql(
            f"ALTER DATABASE {DB_NAME} SET default_transaction_read_only = {'on' if read_only else 'off'}",
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = '{DB_NAME}' AND pid <> pg_backend_pid()",
        )

    def restart(self, daphne: Daphne) -> Restart:
        """deploy/rolling-restart's step for one process: SIGTERM (it drains, then exits), then
        started again, and the next step only once its /healthz answers 200."""
        started = time.monotonic()
        exit_code = daphne.terminate()
        drained = time.monotonic()
        daphne.start()
        daphne.wait_healthy()
        return Restart(daphne.name, exit_code, drained - started, time.monotonic() - drained)

    def rolling_restart(self) -> list[Restart]:
        return [self.restart(daphne) for daphne in self.daphnes]

    def warm_up(self) -> None:
        """A quote from each process, so that the first test finds them warm (their personas
        loaded, their connection pools open)."""
        for daphne in self.daphnes:
            response = httpx.post(
                daphne.url + "/api/quotes/stream", json={"persona": PERSONA, "topic": "warm"}, timeout=30
            )
            if response.status_code != 200 or not response.text.endswith("data: [DONE]\n\n"):
                raise ServiceError(f"daphne {daphne.name}'s warm-up quote failed: {response.text[:300]}")

    # -- a visitor ----------------------------------------------------------------------------

    def visitor(self, address: str) -> httpx.Client:
        """A browser's worth of client from `address`: it has loaded the persona page and keeps
        the csrftoken cookie the page set. The cookie is Secure (TLS ends at nginx in production)
        and this nginx speaks plain HTTP, so it is sent as a browser on https would send it."""
        client = client_at(address)
        page = client.get(f"{self.url}/personas/{PERSONA}/")
        page.raise_for_status()
        token = page.cookies.get("csrftoken")
        assert token, f"the persona page set no csrftoken cookie: {page.headers}"
        client.cookies.clear()
        client.cookies.set("csrftoken", token)
        return client

    # -- looking at it ------------------------------------------------------------------------

    def sql(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg.url.replace("postgres://", "postgresql://", 1), connect_timeout=5) as db:
            return db.execute(query, params).fetchall()

    def last_row_id(self) -> int:
        return int(self.sql("SELECT coalesce(max(id), 0) FROM quotes_generation")[0][0])

    async def healthz(self) -> list[int]:
        """Each process's /healthz status (0: no answer within a second)."""

        async def one(client: httpx.AsyncClient, daphne: Daphne) -> int:
            try:
                return (await client.get(daphne.url + "/healthz")).status_code
            except httpx.HTTPError:
                return 0

        async with httpx.AsyncClient(timeout=1) as client:
            return list(await asyncio.gather(*(one(client, daphne) for daphne in self.daphnes)))

    def wait_until_healthy(self, timeout_s: float = 20.0) -> None:
        """Until every process's /healthz says 200 (a run starts from a whole layout)."""
        deadline = time.monotonic() + timeout_s
        while (statuses := asyncio.run(self.healthz())) != [200] * len(self.daphnes):
            if time.monotonic() > deadline:
                raise ServiceError(f"the processes are not healthy: /healthz {statuses}")
            time.sleep(0.2)

    def log_marks(self) -> list[int]:
        return [daphne.log.stat().st_size if daphne.log.exists() else 0 for daphne in self.daphnes]

    def log_records_since(self, marks: list[int]) -> list[dict[str, Any]]:
        """The JSON log records the daphnes wrote since `marks` (log_marks())."""
        records = []
        for daphne, mark in zip(self.daphnes, marks, strict=True):
            with daphne.log.open("rb") as log:
                log.seek(mark)
                text = log.read().decode(errors="replace")
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    record = {"level": "RAW", "message": line}
                if isinstance(record, dict):
                    records.append({"process": daphne.name, **record})
        return records


def nginx_site(port: int, daphnes: list[Daphne], metrics_ports: list[int]) -> str:
    """deploy/nginx's site in front of `daphnes`, and one port per process for Prometheus, as
    deploy/nginx/persona-quotes.conf sets them up."""
    metrics = "".join(
        f"""
    server {{
        listen 127.0.0.1:{metrics_port};
        set $persona_quotes_host 127.0.0.1;
        include {METRICS_CONF};
        location = /metrics {{ proxy_pass {d.url}; }}
    }}"""
        for d, metrics_port in zip(daphnes, metrics_ports, strict=True)
    )
    return deploy_site(port, [d.url.removeprefix("http://") for d in daphnes], http=metrics)


@contextlib.contextmanager
def started(settings: Settings | None = None) -> Iterator[Layout]:
    """The whole layout, migrated and healthy; everything stopped and removed afterwards."""
    settings = settings or Settings()
    with tempfile.TemporaryDirectory(prefix="persona-quotes-layout-") as tmp, FakeWorkersAI() as fake:
        workdir = Path(tmp)
        with postgres(workdir) as pg, redis_server(workdir) as redis:
            env = production_base_env(
                database_url=pg.url,
                redis_url=redis.url,
                **backend_env(fake.api_base_url, "acct-layout", "cfut_LAYOUT-" + secrets.token_hex(16)),
                # Clients ask from 127.0.0.0/8, quote after quote: no rate limit in the way.
                QUOTES_RATE_LIMIT="100000/minute",
                QUOTES_CACHE_TTL="3600",  # topics are unique: misses
                QUOTES_TTFT_TIMEOUT=f"{settings.ttft_timeout_s:g}",
                QUOTES_METRICS_TOKEN=METRICS_TOKEN,
                **settings.env,
            )
            manage(env, "migrate", "--noinput", "-v0")
            collectstatic(env)
            daphnes = [Daphne(name, free_port(), env, workdir / f"daphne-{name}.log") for name in ("A", "B")]
            try:
                for daphne in daphnes:
                    daphne.start()
                for daphne in daphnes:
                    daphne.wait_healthy()
                port, metrics_ports = free_port(), [free_port(), free_port()]
                site = nginx_site(port, daphnes, metrics_ports)
                with nginx(workdir, site=site, port=port, worker_connections=4096) as proxy:
                    layout = Layout(
                        settings=settings,
                        pg=pg,
                        redis=redis,
                        fake=fake,
                        daphnes=daphnes,
                        proxy=proxy,
                        metrics_urls=[f"http://127.0.0.1:{p}" for p in metrics_ports],
                    )
                    layout.warm_up()
                    yield layout
            finally:
                for daphne in daphnes:
                    daphne.stop()
