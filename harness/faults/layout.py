"""The production layout, with every part under the test's hand: two daphne processes started as
deploy/systemd/persona-quotes@.service starts them (harness/daphne.py), nginx in front with
deploy/nginx's location rules and upstream block (harness/scaleout.py builds the site), one
PostgreSQL and one Redis from the Debian packages (harness/services.py), and the fake
Workers AI upstream (harness/workers_ai.py) streaming `tokens` at `tokens_per_second`.

Each part can fail on demand: PostgreSQL stopped (`pg_ctl stop -m fast`) or made read-only, Redis
stopped (and started again, empty, on its port) or paused (SIGSTOP), a daphne killed (SIGKILL)
and started again on its port, the upstream hung before its first token.
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
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis as redis_py
from prometheus_client.parser import text_string_to_metric_families

from harness.daphne import manage, production_base_env, start_daphne, wait_until_healthy
from harness.scaleout import nginx_site
from harness.services import (
    DB_NAME,
    Nginx,
    Postgres,
    RedisServer,
    ServiceError,
    free_port,
    nginx,
    postgres,
    redis_server,
    stop_process,
)
from harness.workers_ai import FakeWorkersAI, Scenario

from .load import Load

METRICS_TOKEN = secrets.token_urlsafe(24)
#: How long an upstream hang lasts when it is not ended first (longer than any run of the suite).
HUNG_S = 600.0
#: Refused requests are counted into rows of these statuses (quotes/ai/refusals.py).
REFUSAL_STATUSES = ("rate_limited", "busy")


@dataclass
class Daphne:
    """One daphne process that can be killed and started again on the same port (nginx's
    upstream block names the port)."""

    name: str
    port: int
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = start_daphne(self.port, self.env, self.log)
        wait_until_healthy(self.url, self.process, self.log)

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

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


class Layout:
    def __init__(
        self,
        *,
        workdir: Path,
        settings: Settings,
        pg: Postgres,
        redis: RedisServer,
        fake: FakeWorkersAI,
        daphnes: list[Daphne],
        proxy: Nginx,
        metrics_urls: list[str],
    ) -> None:
        self.workdir = workdir
        self.settings = settings
        self.pg = pg
        self.redis = redis
        self.fake = fake
        self.daphnes = daphnes
        self.proxy = proxy
        self.metrics_urls = metrics_urls
        self.scenario = Scenario()
        self.use_tokens(settings.tokens, settings.tokens_per_second)

    @property
    def url(self) -> str:
        return self.proxy.url

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

    def database_read_only(self, read_only: bool) -> str:
        """The database refuses writes, as after a failover to a replica: new sessions are
        read-only (`ALTER DATABASE ... SET default_transaction_read_only`), and every open session
        of the app is ended (`pg_terminate_backend`), so none keeps the old setting. The SQL used."""
        setting = "on" if read_only else "off"
        commands = (
            f"ALTER DATABASE {DB_NAME} SET default_transaction_read_only = {setting}",
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = '{DB_NAME}' AND pid <> pg_backend_pid()",
        )
        self.pg.psql(*commands)
        return "; ".join(commands)

    def expire_persona_caches(self) -> None:
        """Every process forgets its personas at its next request (their version value in the
        shared cache changes, as when an editor saves one): what the 30 s expiry of quotes.personas
        does in a longer database outage, now."""
        client = self.redis_client()
        try:
            for key in client.scan_iter(match="*quotes:personas:version"):
                # The cache keeps a str value as JSON (quotes.ai.cache.JSONSerializer).
                client.set(key, json.dumps(uuid.uuid4().hex))
        finally:
            client.close()

    def warm_up(self, clients: int = 10) -> None:
        """A quote for each of `clients` clients through nginx, so that the first fault finds
        the processes as a fault would in production: warm (their personas loaded, their
        connection pools open), with streams under way rather than still starting."""
        load = Load(self.url, clients)
        asyncio.run(load.run(lambda _: asyncio.sleep(0.1)))
        failed = [quote for quote in load.quotes if quote.outcome != "done"]
        if failed:
            raise ServiceError(f"the warm-up quotes failed: {failed[:3]}")

    # -- looking at it ------------------------------------------------------------------------

    def sql(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg.url.replace("postgres://", "postgresql://", 1), connect_timeout=5) as db:
            return db.execute(query, params).fetchall()

    def last_row_id(self) -> int:
        return int(self.sql("SELECT coalesce(max(id), 0) FROM quotes_generation")[0][0])

    def refusals_counted(self) -> int:
        """Refused requests counted in the log (one row per client, reason and window)."""
        rows = self.sql(
            "SELECT coalesce(sum(request_count), 0) FROM quotes_generation WHERE status = ANY(%s)",
            [list(REFUSAL_STATUSES)],
        )
        return int(rows[0][0])

    def redis_client(self) -> redis_py.Redis:
        return redis_py.Redis.from_url(self.redis.url, socket_timeout=5)

    def slots_held(self) -> dict[str, int]:
        """Client slots in Redis (admission's leases), by key: how many each holds."""
        client = self.redis_client()
        try:
            return {key.decode(): int(client.zcard(key)) for key in client.scan_iter(match="quotes:slots:*")}
        finally:
            client.close()

    async def healthz(self) -> list[int]:
        """Each process's /healthz status (0: no answer within a second)."""

        async def one(client: httpx.AsyncClient, daphne: Daphne) -> int:
            try:
                return (await client.get(daphne.url + "/healthz")).status_code
            except httpx.HTTPError:
                return 0

        async with httpx.AsyncClient(timeout=1) as client:
            return list(await asyncio.gather(*(one(client, daphne) for daphne in self.daphnes)))

    async def outbox_depths(self) -> list[float | None]:
        """Each process's quotes_log_outbox_depth as Prometheus scrapes it (on its nginx port,
        with the token): the log rows waiting for the database. None: no such metric, or no
        answer (within a second)."""

        async def one(client: httpx.AsyncClient, url: str) -> float | None:
            try:
                response = await client.get(
                    url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
                )
            except httpx.HTTPError:
                return None
            if response.status_code != 200:
                return None  # nginx's 502 while the process is down
            for family in text_string_to_metric_families(response.text):
                if family.name == "quotes_log_outbox_depth":
                    return sum(sample.value for sample in family.samples)
            return None

        async with httpx.AsyncClient(timeout=1) as client:
            return list(await asyncio.gather(*(one(client, url) for url in self.metrics_urls)))

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


@contextlib.contextmanager
def started(settings: Settings | None = None) -> Iterator[Layout]:
    """The whole layout, migrated and healthy; everything stopped and removed afterwards."""
    settings = settings or Settings()
    with (
        tempfile.TemporaryDirectory(prefix="persona-quotes-faults-") as tmp,
        FakeWorkersAI() as fake,
    ):
        workdir = Path(tmp)
        with postgres(workdir) as pg, redis_server(workdir) as redis:
            env = production_base_env(
                database_url=pg.url,
                redis_url=redis.url,
                DJANGO_STATIC_ROOT=str(workdir / "static"),
                CLOUDFLARE_ACCOUNT_ID="acct-faults",
                CLOUDFLARE_API_TOKEN="cfut_FAULTS-" + secrets.token_hex(16),
                CLOUDFLARE_API_BASE_URL=fake.api_base_url,
                # Every client asks from 127.0.0.0/24: one network, many clients, no limit in the way.
                QUOTES_RATE_LIMIT="100000/m",
                QUOTES_NETWORK_RATE_LIMIT="1000000/m",
                QUOTES_CACHE_TTL="3600",  # topics are unique: misses, each claimed across processes
                QUOTES_TTFT_TIMEOUT=f"{settings.ttft_timeout_s:g}",
                QUOTES_METRICS_TOKEN=METRICS_TOKEN,
                # Where rows wait while the database cannot take them (quotes/ai/gateway/rows.py).
                QUOTES_OUTBOX_DIR=str(workdir / "outbox"),
                **settings.env,
            )
            manage(env, "migrate", "--noinput", "-v0")
            manage(env, "collectstatic", "--noinput", "-v0")
            daphnes = [Daphne(name, free_port(), env, workdir / f"daphne-{name}.log") for name in ("A", "B")]
            try:
                for daphne in daphnes:
                    daphne.start()
                port, metrics_ports = free_port(), [free_port(), free_port()]
                site = nginx_site(port, daphnes, metrics_ports)  # what it reads of each: .url
                with nginx(workdir, site=site, port=port) as proxy:
                    layout = Layout(
                        workdir=workdir,
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
