"""Streams across processes (issue 14, quotes.ai.gateway.shared_runs): two real daphne processes (A and
B, started with the systemd unit's own command, harness/daphne.py) sharing a real Redis and one
database, answering from the fake Workers AI on 127.0.0.1.

- A client cut mid-stream on A resumes on B with `Last-Event-ID`: exactly the text of one
  uninterrupted stream, one upstream call, one log row (A's).
- Two identical requests, one on A and one on B, make one upstream call.
- A drained (SIGTERM) with a stream still open at its deadline: the client, told to reconnect,
  resumes on B and gets a clean, retryable `generation_lost` (A closed the upstream: the
  generation is not carried on elsewhere), and B logs that resume.
- Stop asked of B for a stream on A (nginx sends each request where it likes): A stops it at
  once, its row says `stopped`; another client asking is told nothing.
- B follows A's call, and A's client stops before a token came: B calls the upstream itself
  (its row a miss).
- A killed (SIGKILL) mid-stream: B's follower and a resume on B end with `generation_lost`,
  never hang, and each has its row.

Each needs Redis (the `redis_server` fixture, a real redis-server: never skipped).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync

from harness.daphne import ROOT, environment, migrate, start_daphne, wait_for, wait_until_up
from harness.services import client_at, free_port, stop_process
from harness.sse import events_of, text_of
from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.gateway import redis_clients
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN

pytestmark = pytest.mark.system

UNIT = "systemd/persona-quotes@.service"
STREAM = "/api/quotes/stream"
QUOTE = {"persona": "alan-watts", "topic": "moving house"}
TOKENS = [f" word{n}" for n in range(40)]


class Daphne:
    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.process = process
        self.log = log


class Pair:
    def __init__(self, a: Daphne, b: Daphne, database: Path, redis_url: str) -> None:
        self.a, self.b, self.database, self.redis_url = a, b, database, redis_url

    def rows(self) -> list[tuple[str, str, str, str]]:
        with sqlite3.connect(self.database) as db:
            return list(
                db.execute(
                    "SELECT public_id, status, error_code, cache_status FROM quotes_generation ORDER BY id"
                )
            )


@pytest.fixture
def pair(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI, redis_server: str
) -> Iterator[Callable[[int], Pair]]:
    """Start A and B (answer cache TTL `cache_ttl`) on one SQLite file and one Redis."""
    processes: list[subprocess.Popen[bytes]] = []
    database = tmp_path / "db.sqlite3"

    def start(cache_ttl: int, **overrides: str) -> Pair:
        env = environment(
            DATABASE_URL=f"sqlite:///{database}",
            REDIS_URL=redis_server.rsplit("/", 1)[0] + "/5",  # a database of its own, emptied first
            DJANGO_ALLOWED_HOSTS="127.0.0.1",
            AI_BACKEND="workers-ai",
            CLOUDFLARE_ACCOUNT_ID=TEST_ACCOUNT_ID,
            CLOUDFLARE_API_TOKEN=TEST_API_TOKEN,
            CLOUDFLARE_API_BASE_URL=fake_workers_ai.api_base_url,
            QUOTES_CACHE_TTL=str(cache_ttl),
            QUOTES_RESUME_GRACE_S="10",
            QUOTES_MAX_ATTEMPTS="1",
            QUOTES_DRAIN_TIMEOUT_S="1",
            QUOTES_TRUSTED_PROXIES="127.0.0.1",  # so a test can speak for another client
            **overrides,
        )
        redis.Redis.from_url(env["REDIS_URL"]).flushdb()
        migrate(env)
        started = []
        for name in "ab":  # both start at once, then each is waited for
            port, log = free_port(), tmp_path / f"daphne-{name}.log"
            started.append(Daphne(f"http://127.0.0.1:{port}", start_daphne(port, env, log, source=UNIT), log))
            processes.append(started[-1].process)
        for daphne in started:
            wait_until_up(daphne.url + "/healthz", daphne.process, daphne.log, any_status=True)
        return Pair(started[0], started[1], database, env["REDIS_URL"])

    yield start
    for process in processes:
        stop_process(process, timeout=15)


def assert_stopped_on_a(servers: Pair, fake_workers_ai: FakeWorkersAI) -> None:
    """The run's one upstream call was closed, and its one row (A's) says its client stopped it."""
    [upstream] = fake_workers_ai.requests
    assert upstream.client_disconnected.wait(5)
    wait_for(lambda: len(servers.rows()) == 1, "A writes the row")
    [(_, status, code, _)] = servers.rows()
    assert (status, code) == ("cancelled", "stopped")


def ask_in_background(url: str) -> Callable[[], str]:
    """POST the quote request to `url` from a thread of its own; call the result for the body."""
    bodies: list[str] = []
    thread = threading.Thread(
        target=lambda: bodies.append(httpx.post(url + STREAM, json=QUOTE, timeout=30).text)
    )
    thread.start()

    def body() -> str:
        thread.join(30)
        assert bodies, f"no answer from {url}"
        return bodies[0]

    return body


def lines_until_tokens(lines: Iterator[str], count: int) -> list[str]:
    """Read SSE lines until `count` token events have been read (and their blank line)."""
    head: list[str] = []
    tokens = 0
    for line in lines:
        head.append(line)
        if line.startswith("data: {") and '"response"' in line:
            tokens += 1
        if not line and tokens >= count:
            return head
    raise AssertionError(f"the stream ended early: {head}")


def test_relay_a_stream_cut_on_one_process_resumes_on_the_other(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(Scenario(tokens=TOKENS, token_delay_s=0.05))
    servers = pair(0)

    with httpx.Client(timeout=30) as client:
        with client.stream("POST", servers.a.url + STREAM, json=QUOTE) as stream:
            quote_id = stream.headers["X-Quote-Id"]
            head = lines_until_tokens(stream.iter_lines(), 5)
        # The socket is closed: A keeps the run for its grace. The client comes back through B.
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
        resumed = client.post(servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id})

    assert resumed.status_code == 200, resumed.text
    events = events_of(head) + events_of(resumed.text.splitlines())
    assert text_of(events) == "".join(TOKENS)
    assert events[-1]["data"] == "[DONE]"
    ids = [line.removeprefix("id: ") for line in resumed.text.splitlines() if line.startswith("id: ")]
    assert int(ids[0].split(":")[1]) == int(last_id.split(":")[1]) + 1  # nothing twice, nothing left out
    assert len(fake_workers_ai.requests) == 1
    wait_for(lambda: len(servers.rows()) == 1, "A writes the row")
    assert [(row[0].replace("-", ""), *row[1:]) for row in servers.rows()] == [
        (quote_id.replace("-", ""), "ok", "", "bypass")
    ]


def test_relay_identical_requests_on_two_processes_make_one_upstream_call(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(Scenario(tokens=TOKENS, token_delay_s=0.05))
    servers = pair(3600)
    on_a = ask_in_background(servers.a.url)
    fake_workers_ai.wait_for_requests(1)  # A is calling the upstream: B's request is identical
    on_b = ask_in_background(servers.b.url)

    assert text_of(events_of(on_a().splitlines())) == "".join(TOKENS)
    assert text_of(events_of(on_b().splitlines())) == "".join(TOKENS)
    assert len(fake_workers_ai.requests) == 1
    wait_for(lambda: len(servers.rows()) == 2, "both rows")
    assert sorted((status, cache) for _, status, _, cache in servers.rows()) == [
        ("ok", "hit"),
        ("ok", "miss"),
    ]


def test_relay_a_stop_sent_to_the_other_process_stops_the_stream_at_once(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.script(Scenario(tokens=[" tick"] * 400, token_delay_s=0.05))  # 20 s unstopped
    servers = pair(0)

    with httpx.Client(timeout=30) as client:
        with client.stream("POST", servers.a.url + STREAM, json=QUOTE) as stream:
            quote_id = stream.headers["X-Quote-Id"]
            lines = stream.iter_lines()
            lines_until_tokens(lines, 3)
            stop_url = f"{servers.b.url}/api/quotes/{quote_id}/stop"
            someone_else = client.post(stop_url, headers={"X-Forwarded-For": "198.51.100.7"})
            stopped = client.post(stop_url)
            rest = list(lines)  # A's stream ends: the stop reached it
        again = client.post(stop_url)

    assert (someone_else.status_code, someone_else.json()["error"]["code"]) == (404, "unknown_stream")
    assert (stopped.status_code, stopped.json()) == (200, {"id": quote_id, "stopped": True})
    assert any('"code": "stopped"' in line or '"code":"stopped"' in line for line in rest), rest[-4:]
    assert (again.status_code, again.json()) == (200, {"id": quote_id, "stopped": False})
    assert_stopped_on_a(servers, fake_workers_ai)


def test_relay_a_stop_before_a_token_leaves_the_call_going_for_the_other_process(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    # A's upstream call is slow to start; B's identical request follows it; A's client stops
    # before a token came: the call goes on for B (a run lives while anyone reads it), one call.
    fake_workers_ai.script(Scenario(tokens=TOKENS, stall_before_s=2))
    servers = pair(3600)

    on_a = ask_in_background(servers.a.url)
    fake_workers_ai.wait_for_requests(1)
    on_b = ask_in_background(servers.b.url)
    # B follows A's run: its reader waits in XREAD BLOCK on A's stream. A's run is the one that
    # claimed the upstream call (its headers wait for the first token: the id comes from Redis).
    store = redis.Redis.from_url(servers.redis_url)
    wait_for(lambda: any(c.get("cmd") == "xread" for c in store.client_list()), "B follows A's call")
    [claim] = store.keys("quotes:flight:*")
    quote_id = str(uuid.UUID(store.get(claim).decode()))
    store.close()
    stopped = httpx.post(f"{servers.a.url}/api/quotes/{quote_id}/stop")
    body = on_b().splitlines()

    assert stopped.json() == {"id": quote_id, "stopped": True}
    assert len(fake_workers_ai.requests) == 1
    assert json.loads(on_a())["error"]["code"] == "stopped"  # before a token: a JSON error
    assert text_of(events_of(body)) == "".join(TOKENS)
    wait_for(lambda: len(servers.rows()) == 2, "both rows")
    assert sorted((status, code, cache) for _, status, code, cache in servers.rows()) == [
        ("cancelled", "stopped", "miss"),
        ("ok", "", "hit"),
    ]


def test_relay_a_killed_owner_ends_its_followers_with_generation_lost(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05))  # 20 s: A dies long before
    servers = pair(3600)

    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a,
        client.stream("POST", servers.b.url + STREAM, json=QUOTE) as follower,
    ):
        head = lines_until_tokens(on_a.iter_lines(), 3)
        follower_lines = follower.iter_lines()
        follower_head = lines_until_tokens(follower_lines, 3)
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
        servers.a.process.send_signal(signal.SIGKILL)
        servers.a.process.wait(10)
        resumed = client.post(servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id})
        follower_rest = list(follower_lines)  # ends: no hang (the client's timeout would say)

    assert len(fake_workers_ai.requests) == 1
    for lines in (follower_head + follower_rest, resumed.text.splitlines()):
        last = events_of(lines)[-1]
        assert last["event"] == "error", lines[-6:]
        assert json.loads(last["data"])["error"]["code"] == "generation_lost", last
    assert text_of(events_of(follower_head + follower_rest)[:-1])  # what came before, kept
    # B's follower and B's resume have their rows (A's own was never written: A was killed).
    wait_for(lambda: len(servers.rows()) == 2, "the follower's and the resume's rows")
    assert [(status, code) for _, status, code, _ in servers.rows()] == [("error", "generation_lost")] * 2


def test_relay_a_stream_cut_by_a_drain_resumes_on_the_other_process_to_a_clean_end(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05))  # 20 s: past A's 1 s drain
    servers = pair(0)

    with httpx.Client(timeout=30) as client:
        with client.stream("POST", servers.a.url + STREAM, json=QUOTE) as stream:
            lines = stream.iter_lines()
            head = lines_until_tokens(lines, 3)
            servers.a.process.send_signal(signal.SIGTERM)
            head += list(lines)  # A cuts it at its deadline
        reconnect = events_of(head)[-1]
        assert reconnect["event"] == "reconnect", head[-6:]
        last_id = json.loads(reconnect["data"])["last_event_id"]
        servers.a.process.wait(20)
        resumed = client.post(servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id})

    assert resumed.status_code == 200, resumed.text
    events = events_of(resumed.text.splitlines())
    assert not text_of(events[:-1])  # A had sent everything it had: nothing twice
    assert events[-1]["event"] == "error"
    error = json.loads(events[-1]["data"])["error"]
    assert error["code"] == "generation_lost", error
    assert len(fake_workers_ai.requests) == 1
    # A's row for the generation, and no other: the resume found it lost, and it has its row.
    wait_for(lambda: len(servers.rows()) == 1, "A's row")
    time.sleep(0.5)  # a row the resume would have queued is written by now
    assert [(status, code) for _, status, code, _ in servers.rows()] == [("cancelled", "server_draining")]


def test_relay_a_resume_of_a_run_elsewhere_open_at_the_drain_deadline_is_told_to_reconnect(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """A resume on A of B's run, opened before A drains, has no run on A to cut it: it reads
    B's run from Redis, and hears Reconnect there at A's deadline. B's run goes on: resumed on
    B from where A left off, the client has the whole text, once."""
    tokens = [f" word{n}" for n in range(200)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05))  # 10 s: past A's 1 s drain
    servers = pair(0)

    with httpx.Client(timeout=30) as client:
        with client.stream("POST", servers.b.url + STREAM, json=QUOTE) as on_b:
            head = lines_until_tokens(on_b.iter_lines(), 3)
            first_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
            headers = {"Last-Event-ID": first_id}
            with client.stream("POST", servers.a.url + STREAM, json=QUOTE, headers=headers) as on_a:
                assert on_a.status_code == 200
                lines = on_a.iter_lines()
                middle = lines_until_tokens(lines, 1)
                servers.a.process.send_signal(signal.SIGTERM)
                middle += list(lines)  # A cuts it at its deadline
        reconnect = events_of(middle)[-1]
        assert reconnect["event"] == "reconnect", middle[-6:]
        headers = {"Last-Event-ID": json.loads(reconnect["data"])["last_event_id"]}
        rest = client.post(servers.b.url + STREAM, json=QUOTE, headers=headers)

    assert rest.status_code == 200, rest.text
    events = events_of(head) + events_of(middle)[:-1] + events_of(rest.text.splitlines())
    assert text_of(events) == "".join(tokens)
    assert servers.a.process.wait(20) == 0
    assert len(fake_workers_ai.requests) == 1


def test_relay_a_draining_process_refuses_to_resume_a_run_it_does_not_hold(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """A resume that lands on a draining process (nginx picks either) is refused like a new
    stream when the run is elsewhere: served, it could outlive the drain's cut."""
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(*[Scenario(tokens=tokens, token_delay_s=0.05)] * 2)  # 20 s each
    servers = pair(0)

    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", servers.b.url + STREAM, json=QUOTE) as on_b,
        client.stream("POST", servers.a.url + STREAM, json={**QUOTE, "topic": "a"}) as on_a,
    ):
        head = lines_until_tokens(on_b.iter_lines(), 3)
        lines_until_tokens(on_a.iter_lines(), 1)  # A has a stream open: it drains for 1 s
        servers.a.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(servers.a.url + "/healthz", timeout=5).status_code == 503, "A drains")
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
        refused = client.post(servers.a.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id})

    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_draining"
    assert refused.headers["Retry-After"] == "1"
    servers.a.process.wait(20)
    # Counted like a refused new stream.
    assert ("busy", "server_draining") in [(status, code) for _, status, code, _ in servers.rows()]


# -- issue 19: the cross-process cases, with clients on distinct loopback addresses --------------


def test_shared_a_stop_by_one_client_leaves_another_process_reader_its_whole_quote(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(150)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.03))
    servers = pair(3600)

    with (
        client_at("127.0.0.2") as alice,
        client_at("127.0.0.3") as bob,
        alice.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a,
    ):
        quote_id = on_a.headers["X-Quote-Id"]
        alice_lines = on_a.iter_lines()
        lines_until_tokens(alice_lines, 3)
        with bob.stream("POST", servers.b.url + STREAM, json=QUOTE) as on_b:
            bob_lines = on_b.iter_lines()
            bob_head = lines_until_tokens(bob_lines, 5)  # B follows A's run
            stopped = alice.post(f"{servers.a.url}/api/quotes/{quote_id}/stop")
            alice_rest = list(alice_lines)
            bob_rest = list(bob_lines)

    assert stopped.json() == {"id": quote_id, "stopped": True}
    assert json.loads(events_of(alice_rest)[-1]["data"])["error"]["code"] == "stopped"
    bob_events = events_of(bob_head + bob_rest)
    assert bob_events[-1]["data"] == "[DONE]", bob_rest[-6:]
    assert text_of(bob_events) == "".join(tokens)
    assert len(fake_workers_ai.requests) == 1
    wait_for(lambda: len(servers.rows()) == 2, "both rows")
    assert sorted((status, code, cache) for _, status, code, cache in servers.rows()) == [
        ("cancelled", "stopped", "miss"),  # A's: its client stopped it (the upstream's cost is on it)
        ("ok", "", "hit"),
    ]


def test_shared_an_identical_request_after_the_owner_is_killed_gets_a_whole_quote(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05), Scenario(tokens=TOKENS))
    servers = pair(3600)

    with client_at("127.0.0.2") as alice, alice.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a:
        lines_until_tokens(on_a.iter_lines(), 3)
        servers.a.process.send_signal(signal.SIGKILL)
        servers.a.process.wait(10)
    time.sleep(5)
    with client_at("127.0.0.3") as bob:
        answer = bob.post(servers.b.url + STREAM, json=QUOTE)

    assert answer.status_code == 200, answer.text
    events = events_of(answer.text.splitlines())
    assert events[-1]["data"] == "[DONE]", events[-3:]
    assert text_of(events) == "".join(TOKENS)  # its own call, from the start: nothing of the dead one's
    assert len(fake_workers_ai.requests) == 2


def test_shared_a_killed_process_client_slots_come_back_within_seconds(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(*[Scenario(tokens=tokens, token_delay_s=0.05)] * 3)
    servers = pair(0, QUOTES_MAX_CONCURRENT_STREAMS="3")

    with client_at("127.0.0.2") as carol, contextlib.ExitStack() as streams:
        readers = []  # kept: an httpx line iterator dropped mid-stream closes its connection
        for n in range(3):
            stream = streams.enter_context(
                carol.stream("POST", servers.a.url + STREAM, json={**QUOTE, "topic": f"t{n}"})
            )
            readers.append(stream.iter_lines())
            lines_until_tokens(readers[-1], 1)
        full = carol.post(servers.b.url + STREAM, json={**QUOTE, "topic": "more"})
        assert (full.status_code, full.json()["error"]["code"]) == (429, "too_many_streams")
        servers.a.process.send_signal(signal.SIGKILL)
        servers.a.process.wait(10)

    killed = time.monotonic()
    answers = []
    with client_at("127.0.0.2") as carol:
        while time.monotonic() - killed < 30:
            # Each refused try must extend nothing: asked every second, the slots still come back.
            answer = carol.post(servers.b.url + STREAM, json={**QUOTE, "topic": "more"})
            answers.append(answer.status_code)
            if answer.status_code == 200:
                break
            assert answer.json()["error"]["code"] == "too_many_streams", answer.text
            time.sleep(1)
    assert answers[-1] == 200, f"the killed process's slots were still held 30 s later: {answers}"


def test_shared_concurrent_resumes_by_one_client_are_admitted_up_to_its_limit(  # 40 of them
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05))  # 20 s
    # The client's limit is under test, not the process's: 40 requests at once lag a loaded test
    # machine's loop, and its adaptive open-stream limit (quotes.ai.gateway.capacity) would
    # refuse some of them first, by chance.
    servers = pair(0, QUOTES_MAX_CONCURRENT_STREAMS="3", QUOTES_LOOP_LAG_TARGET_MS="0")
    store = redis.Redis.from_url(servers.redis_url)

    with client_at("127.0.0.2") as dave:
        with dave.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a:
            head = lines_until_tokens(on_a.iter_lines(), 3)
            time.sleep(0.5)  # what the client has seen is in Redis (published a round trip later)
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
    before = int(store.info("clients")["connected_clients"])
    statuses: list[tuple[int, str]] = []
    opened = threading.Barrier(41)
    release = threading.Event()

    def resume() -> None:
        with (
            client_at("127.0.0.2") as client,
            client.stream(
                "POST", servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id}
            ) as answer,
        ):
            code = "" if answer.status_code == 200 else json.loads(answer.read())["error"]["code"]
            statuses.append((answer.status_code, code))
            opened.wait(30)
            release.wait(30)

    threads = [threading.Thread(target=resume) for _ in range(40)]
    for thread in threads:
        thread.start()
    try:
        opened.wait(30)
        during = int(store.info("clients")["connected_clients"])
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
        store.close()

    admitted = [status for status in statuses if status[0] == 200]
    assert 1 <= len(admitted) <= 3, statuses
    assert sorted(set(statuses) - {(200, "")}) == [(429, "too_many_streams")], statuses
    # Bounded: the short calls' pool, and one reader per admitted resume (not one per request).
    assert during - before <= redis_clients.SHORT_CONNECTIONS + 3 + 2, (before, during)


def test_shared_resumes_of_a_lost_run_write_one_row_under_its_own_id(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05))
    servers = pair(0)

    with client_at("127.0.0.2") as erin:
        with erin.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a:
            quote_id = on_a.headers["X-Quote-Id"]
            lines = on_a.iter_lines()
            head = lines_until_tokens(lines, 3)
            time.sleep(0.5)  # what the client has seen is in Redis (published a round trip later)
            servers.a.process.send_signal(signal.SIGKILL)
            servers.a.process.wait(10)
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
        resumes = [
            erin.post(servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id})
            for _ in range(5)
        ]

    for resumed in resumes:
        assert resumed.status_code == 200, resumed.text
        last = events_of(resumed.text.splitlines())[-1]
        assert json.loads(last["data"])["error"]["code"] == "generation_lost", resumed.text[-300:]
    time.sleep(1)  # any row a resume queued is written by now
    wait_for(lambda: len(servers.rows()) >= 1, "the lost generation's row")
    assert [(row[0].replace("-", ""), row[1], row[2]) for row in servers.rows()] == [
        (quote_id.replace("-", ""), "error", "generation_lost")
    ]


def test_shared_a_killed_process_runs_get_their_rows_from_a_live_one(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """Issue 21, point 4: the generations of a process killed mid-stream, whose clients never
    come back, get their rows from the other process (from the facts in Redis), under their own
    ids, as generation_lost, exactly once."""
    tokens = [f" word{n}" for n in range(400)]
    fake_workers_ai.script(*[Scenario(tokens=tokens, token_delay_s=0.05)] * 3)
    servers = pair(0)

    ids = []
    with client_at("127.0.0.2") as frank, contextlib.ExitStack() as streams:
        readers = []  # kept: an httpx line iterator dropped mid-stream closes its connection
        for n in range(3):
            stream = streams.enter_context(
                frank.stream("POST", servers.a.url + STREAM, json={**QUOTE, "topic": f"t{n}"})
            )
            ids.append(stream.headers["X-Quote-Id"].replace("-", ""))
            readers.append(stream.iter_lines())
            lines_until_tokens(readers[-1], 2)
        time.sleep(0.5)  # what the clients have seen is in Redis
        servers.a.process.send_signal(signal.SIGKILL)
        servers.a.process.wait(10)
    time.sleep(4)  # the heartbeats expire
    with client_at("127.0.0.3") as grace:
        assert grace.post(servers.b.url + STREAM, json={**QUOTE, "topic": "later"}).status_code == 200

    wait_for(lambda: len(servers.rows()) == 4, "the killed process's rows", timeout_s=20)
    time.sleep(6)  # another sweep finds nothing more to write
    rows = {row[0].replace("-", ""): row[1:3] for row in servers.rows()}
    assert len(servers.rows()) == 4
    assert {public_id: rows.get(public_id) for public_id in ids} == dict.fromkeys(
        ids, ("error", "generation_lost")
    )


def test_shared_an_owner_paused_mid_stream_finishes_its_quote_with_its_own_row(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """Issue 28: A is paused (SIGSTOP) for 8 s mid-stream while B serves requests, whose sweep
    finds A's heartbeat gone and writes the run's row on its behalf (`generation_lost`); then A
    goes on. A's client gets the whole text, and the generation has one row: A's own, ok (a
    run's own row wins over one written on its behalf, docs/architecture.md)."""
    tokens = [f" word{n}" for n in range(60)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.05), *[Scenario(tokens=TOKENS[:3])] * 3)
    servers = pair(0)

    def row_of(quote_id: str) -> list[tuple[str, str]]:
        key = quote_id.replace("-", "")
        return [
            (status, code)
            for public_id, status, code, _ in servers.rows()
            if public_id.replace("-", "") == key
        ]

    with client_at("127.0.0.2") as alice, alice.stream("POST", servers.a.url + STREAM, json=QUOTE) as stream:
        quote_id = stream.headers["X-Quote-Id"]
        lines = stream.iter_lines()
        head = lines_until_tokens(lines, 2)
        paused_at = time.monotonic()
        servers.a.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(4)  # A's heartbeat expires
            with client_at("127.0.0.3") as bob:
                for n in range(3):  # B serves requests, and sweeps now and then
                    answer = bob.post(servers.b.url + STREAM, json={**QUOTE, "topic": f"b{n}"})
                    assert answer.status_code == 200
                    if row_of(quote_id):
                        break
                    time.sleep(2)
            wait_for(
                lambda: row_of(quote_id) == [("error", "generation_lost")],
                "B's sweep writes the paused run's row on its behalf",
                timeout_s=max(0.1, 8 - (time.monotonic() - paused_at)),
            )
            time.sleep(max(0.0, 8 - (time.monotonic() - paused_at)))
        finally:
            servers.a.process.send_signal(signal.SIGCONT)
        rest = list(lines)

    assert text_of(events_of(head + rest)) == "".join(tokens)
    wait_for(lambda: row_of(quote_id) == [("ok", "")], "A's own row replaces the one B wrote")


def test_shared_a_socket_that_resumed_a_run_held_elsewhere_stops_it_with_cancel(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """A stream cut on A, resumed over a WebSocket on B: the socket's cancel stops the run on A
    at once (its upstream closed, its row stopped), not after A's resume grace as abandoned."""
    fake_workers_ai.script(Scenario(tokens=[" tick"] * 400, token_delay_s=0.05))  # 20 s unstopped
    servers = pair(0)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", servers.a.url + STREAM, json=QUOTE) as stream,
    ):
        head = lines_until_tokens(stream.iter_lines(), 3)
    last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]

    resume = json.dumps({"type": "resume", "last_event_id": last_id})
    steps = [f"send:{resume}", "read:3", 'send:{"type": "cancel"}', "until:cancelled"]
    socket_url = servers.b.url.replace("http", "ws") + "/ws/quotes/"
    socket = subprocess.run(
        [sys.executable, "-m", "tests.ws_client", socket_url, servers.b.url, *steps],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    frames = [json.loads(line) for line in socket.stdout.splitlines()]

    assert socket.returncode == 0, (socket.stderr, frames)
    assert [frame["type"] for frame in frames[:3]] == ["token"] * 3, frames
    assert_stopped_on_a(servers, fake_workers_ai)  # within 5 s: A's grace is 10 s


def test_shared_a_stop_ends_the_clients_own_resume_on_another_process(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """Alice's stream on A is cut; she resumes it on B, then presses Stop (the stop reaches
    either process). Her resume on B is her own connection, not another reader: it ends with
    `stopped`, A's upstream closes and A's row says stopped."""
    fake_workers_ai.script(Scenario(tokens=[" tick"] * 400, token_delay_s=0.05))  # 20 s unstopped
    servers = pair(0)

    with client_at("127.0.0.2") as alice:
        with alice.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a:
            quote_id = on_a.headers["X-Quote-Id"]
            head = lines_until_tokens(on_a.iter_lines(), 3)
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
        with alice.stream(
            "POST", servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id}
        ) as on_b:
            resumed = on_b.iter_lines()
            lines_until_tokens(resumed, 3)
            stopped = alice.post(f"{servers.b.url}/api/quotes/{quote_id}/stop")
            rest = list(resumed)

    assert stopped.json() == {"id": quote_id, "stopped": True}
    assert json.loads(events_of(rest)[-1]["data"])["error"]["code"] == "stopped", rest[-4:]
    assert_stopped_on_a(servers, fake_workers_ai)


def test_shared_a_stop_ends_the_clients_own_resume_while_another_client_follows_the_run(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """As above, with Bob on B following the same run (an identical request): the run goes on
    for Bob to its end, and Alice's resume on B ends with `stopped` all the same."""
    tokens = [f" word{n}" for n in range(150)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.03))
    servers = pair(3600)

    with client_at("127.0.0.2") as alice, client_at("127.0.0.3") as bob:
        with alice.stream("POST", servers.a.url + STREAM, json=QUOTE) as on_a:
            quote_id = on_a.headers["X-Quote-Id"]
            head = lines_until_tokens(on_a.iter_lines(), 3)
        last_id = [line.removeprefix("id: ") for line in head if line.startswith("id: ")][-1]
        with (
            bob.stream("POST", servers.b.url + STREAM, json=QUOTE) as bobs,
            alice.stream(
                "POST", servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": last_id}
            ) as on_b,
        ):
            bob_lines = bobs.iter_lines()
            bob_head = lines_until_tokens(bob_lines, 5)  # B follows A's run
            resumed = on_b.iter_lines()
            lines_until_tokens(resumed, 3)
            stopped = alice.post(f"{servers.a.url}/api/quotes/{quote_id}/stop")
            rest = list(resumed)
            bob_rest = list(bob_lines)

    assert stopped.json() == {"id": quote_id, "stopped": True}
    assert json.loads(events_of(rest)[-1]["data"])["error"]["code"] == "stopped", rest[-4:]
    bob_events = events_of(bob_head + bob_rest)
    assert bob_events[-1]["data"] == "[DONE]", bob_rest[-6:]
    assert text_of(bob_events) == "".join(tokens)
    assert len(fake_workers_ai.requests) == 1


def test_shared_a_runs_events_in_redis_are_json_never_pickle(
    pair: Callable[[int], Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """What a process reads from Redis is data (JSON), never pickle: whatever can write to Redis
    must not be able to run code in the processes that read it."""
    fake_workers_ai.script(Scenario(tokens=TOKENS[:5]))
    servers = pair(0)

    answer = httpx.post(servers.a.url + STREAM, json=QUOTE, timeout=30)

    quote_id = answer.headers["X-Quote-Id"]
    entries = redis.Redis.from_url(servers.redis_url).xrange(f"quotes:live:{quote_id}")
    assert entries
    events = [event for _, fields in entries for event in json.loads(fields[b"d"])]
    assert events[0]["meta"]["generation_id"] == quote_id
    assert [event for event in events if isinstance(event, str)] == TOKENS[:5]
    assert events[-1] == {"done": None}
    facts = json.loads(entries[0][1][b"r"])
    assert (facts["topic"], facts["backend"]) == (QUOTE["topic"], "workers-ai")


def test_shared_a_runs_end_sent_while_redis_fails_is_sent_again(
    pair: Callable[..., Pair], fake_workers_ai: FakeWorkersAI
) -> None:
    """The round that carries a run's end fails (Redis holds writes longer than the socket
    timeout): the end is sent again once Redis takes it, so a reader elsewhere gets the whole
    quote, not `generation_lost` (the run was dropped, its stream left without an end)."""
    fake_workers_ai.script(Scenario(tokens=TOKENS[:6], stall_after_tokens=5, stall_s=3))
    servers = pair(0, REDIS_SOCKET_TIMEOUT="1")
    client = redis.Redis.from_url(servers.redis_url)
    body = ask_in_background(servers.a.url)

    def live_tokens() -> int:
        keys = client.keys("quotes:live:*")
        entries = client.xrange(keys[0]) if keys else []
        return sum(isinstance(e, str) for _, f in entries for e in json.loads(f[b"d"]))

    wait_for(lambda: live_tokens() > 0, "A sends tokens to Redis", timeout_s=30)
    client.client_pause(9000, all=False)  # writes wait 9 s: the round with the end times out
    lines = body().splitlines()
    assert text_of(events_of(lines)) == "".join(TOKENS[:6])

    [key] = client.keys("quotes:live:*")
    wait_for(
        lambda: {"done": None} in [e for _, f in client.xrange(key) for e in json.loads(f[b"d"])],
        "A sends the run's end once Redis takes writes again",
        timeout_s=30,
    )
    first_id = next(line.removeprefix("id: ") for line in lines if line.startswith("id: "))
    resumed = httpx.post(servers.b.url + STREAM, json=QUOTE, headers={"Last-Event-ID": first_id}, timeout=10)
    assert resumed.status_code == 200, resumed.text
    assert text_of(events_of(resumed.text.splitlines())) == "".join(TOKENS[1:6])  # after the first


def test_redis_clients_close_with_the_loop_that_made_them(settings: Any, redis_server: str) -> None:
    """Loops that end (asgiref's async_to_sync under a sync test, asyncio.run under `manage.py
    quote`) close the clients they made: no socket left open, nothing to warn when collected."""
    settings.REDIS_URL = redis_server
    probe = redis.Redis.from_url(redis_server)
    # Connections opened from here on, but the probe's own: an earlier test's may close meanwhile.
    opened_before = max(int(client["id"]) for client in probe.client_list())

    def ours() -> list[int]:
        return [int(c["id"]) for c in probe.client_list() if int(c["id"]) > opened_before]

    async def use() -> None:
        await redis_clients.client().ping()
        await redis_clients.reader().ping()

    async_to_sync(use)()
    async_to_sync(use)()  # another loop: the first one's clients are not used again
    asyncio.run(use())
    redis_clients.forget()
    gc.collect()
    wait_for(lambda: not ours(), "every client's connections closed")
