"""The daily spend ceiling, tried as an attacker would (issue 38), through a real daphne on the
fake Workers AI: every way a generation ends counts what the upstream billed, a quote is priced
by the model the site asked for, and a hung Redis never leaves the shared counter wrong.

- Quotes stopped after their first token: the upstream sent no usage, so each settles an estimate
  (its prompt as the reservation counts it, plus the text streamed), never $0, and the ceiling
  refuses once those pass it (before: 12 of 12 served, $0 spent).
- An OpenAI-compatible server that names another model in its chunks (vLLM's own name): the row
  shows that name, but is priced by the catalog's price for the model asked for (before: $0).
- Redis stopped (SIGSTOP, 6 s) between reservations and settlements, and a reservation taken
  while it hung: once it answers again the shared counter holds exactly the rows' costs, give or
  take one reservation (before: it read less than the rows cost, once below zero).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import redis

from harness.daphne import ACCOUNT_ID, Site, start_site, wait_for, workers_ai_env
from harness.services import RedisServer, redis_server
from harness.workers_ai import FakeWorkersAI, Scenario

pytestmark = pytest.mark.system

#: The seeded personas' model (quotes/migrations/0002): $0.152 per M input tokens, $0.287 per M
#: output tokens on Cloudflare's pricing page.
PRICE_IN, PRICE_OUT = Decimal("0.152"), Decimal("0.287")
TICKS = tuple(f" tick{n}" for n in range(60))


def spend_today(site: Site) -> Decimal:
    text = httpx.get(f"{site.url}/metrics", timeout=10).text
    match = re.search(r"^quotes_spend_today_usd (\S+)$", text, re.M)
    assert match, text[:500]
    return Decimal(match[1])


def row_costs(site: Site) -> list[tuple[str, str, Decimal, int]]:
    """(status, error code, cost, cost estimated) of every row, once none is running."""
    wait_for(lambda: not site.query("SELECT 1 FROM quotes_generation WHERE status = 'running'"), "rows done")
    rows = site.query(
        "SELECT status, error_code, cost_usd, cost_estimated FROM quotes_generation ORDER BY id"
    )
    return [(status, code, Decimal(str(cost or 0)), estimated) for status, code, cost, estimated in rows]


def stopped_after_first_token(client: httpx.Client, site: Site) -> int:
    """A quote asked for, stopped with the Stop endpoint once its first token came: its status."""
    with client.stream("POST", f"{site.url}/api/quotes/stream", json={"persona": "alan-watts"}) as response:
        if response.status_code != 200:
            response.read()
            assert response.json()["error"]["code"] == "budget_exhausted", response.text
            return response.status_code
        quote = response.headers["x-quote-id"]
        for line in response.iter_lines():
            if line.startswith('data: {"response":" tick'):
                break
        stop = client.post(f"{site.url}/api/quotes/{quote}/stop")
        assert stop.json() == {"id": quote, "stopped": True}
    return 200


def test_quotes_stopped_after_their_first_token_spend_an_estimate_and_meet_the_ceiling(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    ceiling = Decimal("0.001")  # about five stopped quotes: each bills a prompt of ~1,100 tokens
    fake_workers_ai.default = Scenario(tokens=TICKS, token_delay_s=0.05, usage=(300, 60))
    settings = {"QUOTES_DAILY_SPEND_LIMIT_USD": str(ceiling), "QUOTES_METRICS_ALLOW": "127.0.0.1/32"}
    with (
        start_site(tmp_path, **workers_ai_env(fake_workers_ai), **settings) as site,
        httpx.Client(timeout=30) as client,
    ):
        statuses = [stopped_after_first_token(client, site) for _ in range(12)]
        rows = row_costs(site)
        spent = spend_today(site)

    served = statuses.count(200)
    assert 1 <= served < 12 and statuses == [200] * served + [503] * (12 - served), statuses
    assert len(fake_workers_ai.requests) == served  # a refused quote never reaches Cloudflare
    assert [(status, code, estimated) for status, code, _, estimated in rows] == [
        ("cancelled", "stopped", 1)
    ] * served
    costs = [cost for *_, cost, _ in rows]
    # Each bills its prompt (at least the few-shot frame's ~1,000 characters as tokens) and a token.
    assert all(cost > 1000 * PRICE_IN / 10**6 for cost in costs), costs
    assert sum(costs) <= ceiling and spent == pytest.approx(sum(costs), abs=Decimal("1e-8") * served)


def test_an_upstream_that_names_another_model_is_priced_by_the_model_asked_for(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    """AI_BACKEND=openai on Workers AI's OpenAI-compatible route; the server echoes vLLM's name."""
    fake_workers_ai.default = Scenario(usage=(100_000, 40), served_model="meta-llama/Llama-3.1-8B-Instruct")
    cost = (100_000 * PRICE_IN + 40 * PRICE_OUT) / 10**6  # $0.0152
    env = {
        **workers_ai_env(fake_workers_ai),
        "AI_BACKEND": "openai",
        "OPENAI_BASE_URL": fake_workers_ai.openai_base_url(ACCOUNT_ID),
        "OPENAI_API_KEY": "sk-test-0123456789abcdef",
        "QUOTES_DAILY_SPEND_LIMIT_USD": "0.04",  # two quotes and a reservation's room
        "QUOTES_METRICS_ALLOW": "127.0.0.1/32",
    }
    with start_site(tmp_path, **env) as site, httpx.Client(timeout=30) as client:
        answers = [
            client.post(f"{site.url}/api/quotes/stream", json={"persona": "alan-watts"}) for _ in range(6)
        ]
        rows = row_costs(site)
        models = {model for (model,) in site.query("SELECT model FROM quotes_generation")}
        spent = spend_today(site)

    assert [a.status_code for a in answers] == [200, 200, 200, 503, 503, 503]
    assert models == {"meta-llama/Llama-3.1-8B-Instruct"}  # shown as the server named it
    assert [(status, cost, estimated) for status, _, cost, estimated in rows] == [("ok", cost, 0)] * 3
    assert spent == pytest.approx(3 * cost)


@pytest.fixture
def hung_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def test_a_redis_hung_between_reservations_and_settlements_leaves_the_counter_at_the_rows_costs(
    fake_workers_ai: FakeWorkersAI, hung_redis: RedisServer, tmp_path: Path
) -> None:
    release = threading.Event()
    # Each quote writes a token, then waits for the test: its reservation is taken, its cost not yet.
    fake_workers_ai.default = Scenario(tokens=TICKS[:3], usage=(1000, 3), stall_after_tokens=1, hold=release)
    env = {
        **workers_ai_env(fake_workers_ai),
        "REDIS_URL": hung_redis.url,
        "QUOTES_DAILY_SPEND_LIMIT_USD": "5",
    }
    store = redis.Redis.from_url(hung_redis.url)
    with start_site(tmp_path, **env) as site, httpx.Client(timeout=60) as client:
        results: list[int] = []

        def quote() -> None:
            with client.stream("POST", f"{site.url}/api/quotes/stream", json={"persona": "alan-watts"}) as r:
                r.read()
                results.append(r.status_code)

        threads = [threading.Thread(target=quote) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(fake_workers_ai.requests) == 4, "four quotes reserved and streaming")
        [key] = store.keys("*quotes:spend:*")
        reserved = int(store.get(key) or 0)
        assert reserved > 0

        hung_redis.pause()
        started = time.monotonic()
        late = threading.Thread(target=quote)  # a reservation taken while Redis hangs
        late.start()
        wait_for(
            lambda: len(fake_workers_ai.requests) == 5, "a quote reserved while Redis hangs", timeout_s=30
        )
        release.set()  # every quote ends, and settles, while Redis hangs
        for thread in [*threads, late]:
            thread.join(30)
        rows = row_costs(site)
        time.sleep(max(0.0, 6 - (time.monotonic() - started)))
        hung_redis.resume()

        costs = sum(cost for *_, cost, _ in rows)
        units = int(costs * 10**9)
        one_reservation = reserved // 4
        wait_for(
            lambda: units <= int(store.get(key) or 0) <= units + one_reservation, "the counter paid back", 20
        )
        counter = int(store.get(key) or 0)
        store.close()

    assert results == [200] * 5
    assert [(status, estimated) for status, _, _, estimated in rows] == [("ok", 0)] * 5
    assert units <= counter <= units + one_reservation, (counter, units, one_reservation)
