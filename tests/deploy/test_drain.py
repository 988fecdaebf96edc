"""Drain on deploy: a real daphne process, started with the systemd unit's own command
(`python -m quotes.server`, harness/daphne.py), streaming from the fake Workers AI, gets SIGTERM
mid-stream.

- It takes no new stream (503 server_draining with Retry-After) and /healthz says "draining".
- A stream that ends before the drain's deadline (QUOTES_DRAIN_TIMEOUT_S) ends whole.
- A stream still open at the deadline ends with `event: reconnect` (no [DONE]), its upstream
  is closed and its log row says cancelled / server_draining; the process then exits.
- The WebSocket's stream ends the same way: a `reconnect` frame, then close code 1012.
- Behind nginx with the project's proxy rules, a draining process's refusals are retried on
  the other process: no visitor sees them.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daphne import (
    environment,
    migrate,
    running_daphne,
    start_daphne,
    wait_for,
    wait_until_healthy,
)
from harness.services import deploy_site, free_port, nginx, stop_process, tail
from harness.sse import events_of, text_of
from harness.workers_ai import FakeWorkersAI, Scenario
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN

pytestmark = pytest.mark.system

UNIT = "systemd/persona-quotes@.service"
STREAM = "/api/quotes/stream"
QUOTE = {"persona": "alan-watts", "topic": "moving house"}


class Server:
    def __init__(
        self,
        url: str,
        process: subprocess.Popen[bytes],
        database: Path,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = url
        self.process = process
        self.database = database
        self.log = log
        self.env = env or {}

    def rows(self) -> list[tuple[str, str]]:
        with sqlite3.connect(self.database) as db:
            return list(db.execute("SELECT status, error_code FROM quotes_generation ORDER BY id"))


@pytest.fixture
def serve(tmp_path: Path, fake_workers_ai: FakeWorkersAI) -> Iterator[Callable[[float], Server]]:
    """Start the unit's daphne with a drain deadline of `drain_s` seconds (on a fresh SQLite
    file, answering from the fake Workers AI)."""
    started: list[Iterator[subprocess.Popen[bytes]]] = []
    database = tmp_path / "db.sqlite3"

    def start(drain_s: float) -> Server:
        env = environment(
            DATABASE_URL=f"sqlite:///{database}",
            DJANGO_ALLOWED_HOSTS="127.0.0.1",
            AI_BACKEND="workers-ai",
            CLOUDFLARE_ACCOUNT_ID=TEST_ACCOUNT_ID,
            CLOUDFLARE_API_TOKEN=TEST_API_TOKEN,
            CLOUDFLARE_API_BASE_URL=fake_workers_ai.api_base_url,
            QUOTES_CACHE_TTL="0",
            QUOTES_DRAIN_TIMEOUT_S=str(drain_s),
        )
        if not database.exists():
            migrate(env)
        port = free_port()
        log = tmp_path / f"daphne-{len(started)}.log"
        context = running_daphne(UNIT, port, env, log)
        process = context.__enter__()
        started.append(context)
        return Server(f"http://127.0.0.1:{port}", process, database, log, env)

    yield start
    for context in started:
        context.__exit__(None, None, None)


@pytest.fixture
def serve_local(tmp_path: Path) -> Iterator[Callable[[], Server]]:
    """Start the unit's daphne on the embedded model (loaded at start-up), with no drain grace at
    all: each call a fresh process, on a database of its own."""
    numbers = itertools.count()
    with contextlib.ExitStack() as running:

        def start() -> Server:
            directory = tmp_path / f"server-{next(numbers)}"
            directory.mkdir()
            database = directory / "db.sqlite3"
            env = environment(
                DATABASE_URL=f"sqlite:///{database}",
                DJANGO_ALLOWED_HOSTS="127.0.0.1",
                AI_BACKEND="local",
                LOCAL_MODEL_PRELOAD="true",
                QUOTES_CACHE_TTL="0",
                QUOTES_DRAIN_TIMEOUT_S="0",
            )
            migrate(env)
            port, log = free_port(), directory / "daphne.log"
            process = running.enter_context(running_daphne(UNIT, port, env, log))
            return Server(f"http://127.0.0.1:{port}", process, database, log)

        yield start


def deployed_site(port: int, *servers: Server) -> str:
    """nginx in front of `servers` as deploy/ has it: its upstream block and its locations."""
    return deploy_site(port, [s.url.removeprefix("http://") for s in servers])


def test_sigterm_refuses_new_streams_and_lets_an_open_one_finish(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(12)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.25))  # 3 s, inside the 20 s
    server = serve(20)

    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + STREAM, json=QUOTE) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        head = [next(lines)]  # the first token's event
        server.process.send_signal(signal.SIGTERM)

        def draining() -> bool:
            return httpx.get(server.url + "/healthz", timeout=5).status_code == 503

        wait_for(draining, "/healthz answers 503")
        health = httpx.get(server.url + "/healthz", timeout=5)
        refused = httpx.post(server.url + STREAM, json=QUOTE, timeout=5)
        rest = list(lines)

    assert health.json() == {"status": "draining"}
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_draining"
    assert int(refused.headers["Retry-After"]) > 0
    events = events_of(head + rest)
    assert events[-1] == {"event": "message", "data": "[DONE]"}
    assert text_of(events) == "".join(tokens)
    assert len(fake_workers_ai.requests) == 1  # the refused stream never went upstream

    server.process.wait(timeout=30)  # with no stream left, the process exits by itself
    assert server.process.returncode == 0, tail(server.log)
    # The refusal is counted like an over-capacity one (a "busy" refusal row), the stream logged.
    assert sorted(server.rows()) == [("busy", "server_draining"), ("ok", "")]
    # Issue 20: the drain's refusals (the stream's, /healthz's) are expected, logged at INFO;
    # nothing is an ERROR. The stream's is answered before Django's handler (issue 22:
    # quotes.middleware.StreamAdmissionGate), so its line is the access line alone.
    lines = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
    refusals = [line for line in lines if line["logger"] == "django.request" and line["status_code"] == 503]
    refusals += [line for line in lines if line["logger"] == "quotes.request" and line["status"] == 503]
    assert {line.get("path") or line["message"].partition(": ")[2] for line in refusals} == {
        STREAM,
        "/healthz",
    }, refusals
    assert {line["level"] for line in refusals} == {"INFO"}, refusals
    assert [line for line in lines if line["level"] in ("ERROR", "CRITICAL")] == []


def test_every_refusal_of_a_draining_process_is_counted_up_to_its_exit(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI
) -> None:
    """A draining process refuses new streams until the moment it stops, and a refusal's count
    reaches its row a second later (quotes.ai.refusals): the last second's refusals were lost
    when the process exited. Here a client keeps asking until the port closes."""
    fake_workers_ai.script(Scenario(tokens=[f" w{n}" for n in range(6)], token_delay_s=0.25))
    server = serve(20)
    refused = 0
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + STREAM, json=QUOTE) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
        server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(server.url + "/healthz", timeout=5).status_code == 503, "draining")
        reader = threading.Thread(target=lambda: list(lines))
        reader.start()
        with httpx.Client(timeout=5) as asker:
            while True:
                try:
                    answer = asker.post(server.url + STREAM, json=QUOTE)
                except httpx.TransportError:
                    break  # the process has stopped
                assert answer.status_code == 503, answer.text
                refused += 1
        reader.join(timeout=30)

    server.process.wait(timeout=30)
    assert server.process.returncode == 0, tail(server.log)
    with sqlite3.connect(server.database) as db:
        [(counted,)] = db.execute("SELECT SUM(request_count) FROM quotes_generation WHERE status = 'busy'")
    assert refused > 10  # the client kept asking through the drain
    # The last refusal may be counted and its answer cut by the exit before the client reads it.
    assert refused <= counted <= refused + 1


def test_a_generation_waiting_out_its_resume_grace_ends_as_drained(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI
) -> None:
    """A client that dropped leaves its generation running for the resume grace (10 s by
    default), with no connection to cut. A drain must end it like a cut stream, not let the
    process's exit break its upstream (an error row) or lose its row."""
    fake_workers_ai.script(Scenario(tokens=[f" w{n}" for n in range(200)], token_delay_s=0.1))
    server = serve(1)
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + STREAM, json=QUOTE) as stream:
        assert stream.status_code == 200
        next(stream.iter_lines())
    # The client is gone; the generation goes on in its grace.
    [upstream] = fake_workers_ai.requests
    time.sleep(0.3)
    assert not upstream.client_disconnected.is_set()
    server.process.send_signal(signal.SIGTERM)

    server.process.wait(timeout=30)
    assert server.process.returncode == 0, tail(server.log)
    assert upstream.client_disconnected.wait(5)
    assert server.rows() == [("cancelled", "server_draining")]


#: How each SSE client asks: the JSON API, EventSource (GET), the page's htmx.
SSE_CLIENTS: dict[str, dict[str, Any]] = {
    "api": {"method": "POST", "json": QUOTE},
    "eventsource": {"method": "GET", "params": QUOTE, "headers": {"Accept": "text/event-stream"}},
    "htmx": {"method": "POST", "json": QUOTE, "headers": {"HX-Request": "true"}},
}


@pytest.mark.parametrize("client_kind", list(SSE_CLIENTS))
def test_a_stream_open_at_the_drain_deadline_is_told_to_reconnect(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI, client_kind: str
) -> None:
    tokens = [f" word{n}" for n in range(200)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.1))  # 20 s, past the 1 s deadline
    server = serve(1)
    ask = dict(SSE_CLIENTS[client_kind])

    with (
        httpx.Client(timeout=30) as client,
        client.stream(ask.pop("method"), server.url + STREAM, **ask) as stream,
    ):
        assert stream.status_code == 200
        quote_id = stream.headers["X-Quote-Id"]
        lines = stream.iter_lines()
        head = [next(lines)]
        server.process.send_signal(signal.SIGTERM)
        rest = list(lines)  # the body ends: the process cut the stream

    events = events_of(head + rest)
    last = events[-1]
    assert last["event"] == "reconnect", events[-3:]
    assert last["retry"].isdigit()
    reconnect = json.loads(last["data"])
    assert reconnect["retry_ms"] == int(last["retry"])
    assert reconnect["last_event_id"].startswith(f"{quote_id}.")
    # Resume from the last event the client got (its id: line), never a later or another one.
    ids = [line.removeprefix("id: ") for line in head + rest if line.startswith("id: ")]
    assert reconnect["last_event_id"] == ids[-1]
    assert all(e["data"] != "[DONE]" and e["event"] != "done" for e in events)
    text = text_of(events[:-1], html=client_kind == "htmx")
    assert text and "".join(tokens).startswith(text) and text != "".join(tokens)
    # The upstream was closed, not left to run on.
    assert fake_workers_ai.requests[0].client_disconnected.wait(5)

    server.process.wait(timeout=1 + 20)
    assert server.process.returncode == 0, tail(server.log)
    assert server.rows() == [("cancelled", "server_draining")]


# -- the WebSocket, with a client small enough to read here (RFC 6455: text frames, close) -------


class WebSocket:
    def __init__(self, port: int, path: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.reader = self.sock.makefile("rb")
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Origin: http://127.0.0.1:{port}\r\n\r\n".encode()
        )
        status = self.reader.readline()
        assert b" 101 " in status, status
        while self.reader.readline() not in (b"\r\n", b""):
            pass

    def send_json(self, payload: object) -> None:
        data, mask = json.dumps(payload).encode(), os.urandom(4)
        assert len(data) < 126
        masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(data))
        self.sock.sendall(bytes([0x81, 0x80 | len(data)]) + mask + masked)

    def receive(self) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame from the server (unmasked, unfragmented)."""
        head = self.reader.read(2)
        assert len(head) == 2, "the connection closed without a close frame"
        length = head[1] & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self.reader.read(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self.reader.read(8))
        return head[0] & 0x0F, self.reader.read(length)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def test_a_websocket_stream_open_at_the_drain_deadline_gets_reconnect_then_close_1012(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI
) -> None:
    tokens = [f" word{n}" for n in range(200)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.1))
    server = serve(1)
    port = int(server.url.rsplit(":", 1)[1])
    socket_ = WebSocket(port, "/ws/quotes/")
    try:
        socket_.send_json({"type": "start", **QUOTE})
        frames: list[dict[str, object]] = []
        while not any(frame["type"] == "token" for frame in frames):
            opcode, payload = socket_.receive()
            assert opcode == 0x1, (opcode, payload)
            frames.append(json.loads(payload))
        server.process.send_signal(signal.SIGTERM)
        # Meanwhile, a start on another socket is refused, and that socket closed with 1012.
        wait_for(lambda: httpx.get(server.url + "/healthz", timeout=5).status_code == 503, "draining")
        late = WebSocket(port, "/ws/quotes/")
        try:
            late.send_json({"type": "start", **QUOTE})
            refusal = late.receive()
            refusal_close = late.receive()
        finally:
            late.close()
        while True:
            opcode, payload = socket_.receive()
            if opcode == 0x8:  # close
                close_code = struct.unpack("!H", payload[:2])[0]
                break
            frames.append(json.loads(payload))
    finally:
        socket_.close()

    assert close_code == 1012  # service restart
    assert refusal[0] == 0x1 and json.loads(refusal[1])["code"] == "server_draining"
    assert refusal_close[0] == 0x8 and struct.unpack("!H", refusal_close[1][:2])[0] == 1012
    meta = next(frame for frame in frames if frame["type"] == "meta")
    last = frames[-1]
    assert last["type"] == "reconnect", frames[-3:]
    assert isinstance(last["retry_ms"], int)
    assert str(last["last_event_id"]).startswith(f"{meta['id']}.")
    assert not any(frame["type"] == "done" for frame in frames)
    assert fake_workers_ai.requests[0].client_disconnected.wait(5)

    server.process.wait(timeout=1 + 20)
    assert server.process.returncode == 0, tail(server.log)
    assert sorted(server.rows()) == [("busy", "server_draining"), ("cancelled", "server_draining")]


def test_behind_nginx_new_streams_go_to_the_other_process_while_one_drains(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    """The rolling restart's middle: process A drains (a stream still open on it), B serves.
    nginx (deploy/nginx/persona-quotes-locations.conf) sends every new stream to B, even those
    it first tried on A."""
    tokens = [f" word{n}" for n in range(12)]
    fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.25))  # A's stream: 3 s
    a, b = serve(20), serve(20)
    proxy_port = free_port()
    site = deployed_site(proxy_port, a, b)
    with (
        nginx(tmp_path, site=site, port=proxy_port) as proxy,
        httpx.Client(timeout=30) as client,
        client.stream("POST", a.url + STREAM, json=QUOTE) as stream,
    ):
        lines = stream.iter_lines()
        head = [next(lines)]
        a.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(a.url + "/healthz", timeout=5).status_code == 503, "A drains")
        # nginx has no idea which process drains: with the two tied, it tries A about every
        # other time.
        answers = [client.post(proxy.url + STREAM, json={**QUOTE, "topic": f"n{n}"}) for n in range(4)]
        rest = list(lines)

    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert all(text_of(events_of(r.text.splitlines())) for r in answers)
    assert text_of(events_of(head + rest)) == "".join(tokens)  # A's own stream ended whole
    a.process.wait(timeout=30)
    assert a.process.returncode == 0, tail(a.log)
    assert b.process.poll() is None


def test_a_rolling_restart_behind_nginx_always_leaves_nginx_a_process(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    """deploy/rolling-restart's steps behind nginx with deploy/nginx's upstream block: A is
    restarted (nginx finds it refusing connections meanwhile, as it would find it answering
    503s while it drains), then B drains with a stream still open on it. A new stream must go
    to the restarted A. With `max_fails=3 fail_timeout=10s` nginx had counted A's refusals as
    failures and still kept A out: B's 503 left it no process, and the visitor got nginx's own
    502 ("no live upstreams"); bench/rolling_restart.py lost 2,390 of 3,942 quotes that way."""
    a, b = serve(20), serve(20)
    proxy_port = free_port()
    site = deployed_site(proxy_port, a, b)
    restarted: subprocess.Popen[bytes] | None = None
    tokens = [f" word{n}" for n in range(16)]
    try:
        with nginx(tmp_path, site=site, port=proxy_port) as proxy, httpx.Client(timeout=30) as client:
            a.process.send_signal(signal.SIGTERM)  # systemctl restart: the old A drains and exits
            assert a.process.wait(timeout=30) == 0, tail(a.log)
            # Meanwhile new streams come: nginx tries the stopped A about every other time.
            during = [client.post(proxy.url + STREAM, json={**QUOTE, "topic": f"d{n}"}) for n in range(8)]
            restarted = start_daphne(int(a.url.rsplit(":", 1)[1]), a.env, a.log)
            wait_until_healthy(a.url, restarted, a.log)  # the script's next step: B
            fake_workers_ai.script(Scenario(tokens=tokens, token_delay_s=0.25))  # B's stream: 4 s
            with client.stream("POST", b.url + STREAM, json=QUOTE) as stream:
                lines = stream.iter_lines()
                head = [next(lines)]
                b.process.send_signal(signal.SIGTERM)
                wait_for(lambda: httpx.get(b.url + "/healthz", timeout=5).status_code == 503, "B drains")
                after = client.post(proxy.url + STREAM, json={**QUOTE, "topic": "after"})
                rest = list(lines)
    finally:
        if restarted is not None:
            stop_process(restarted)

    assert [r.status_code for r in during] == [200] * 8, [r.text for r in during]
    assert after.status_code == 200, after.text
    assert text_of(events_of(after.text.splitlines())) == "Stay hungry, stay foolish."
    assert text_of(events_of(head + rest)) == "".join(tokens)  # B's own stream ended whole
    assert b.process.wait(timeout=30) == 0, tail(b.log)


def test_a_stream_cut_before_its_first_token_is_refused_like_a_new_one(
    serve: Callable[[float], Server], fake_workers_ai: FakeWorkersAI
) -> None:
    """Nothing sent yet at the deadline (the model still thinking): a 503 server_draining with
    Retry-After, as a refused stream gets, rather than a stream that says nothing."""
    fake_workers_ai.script(Scenario(stall_before_s=20))
    server = serve(1)

    def terminate_once_upstream_asked() -> None:
        fake_workers_ai.wait_for_requests(1, timeout_s=30)
        server.process.send_signal(signal.SIGTERM)

    signaller = threading.Thread(target=terminate_once_upstream_asked)
    signaller.start()
    try:
        response = httpx.post(server.url + STREAM, json=QUOTE, timeout=30)
    finally:
        signaller.join()

    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "server_draining"
    assert int(response.headers["Retry-After"]) > 0
    assert fake_workers_ai.requests[0].client_disconnected.wait(5)
    server.process.wait(timeout=1 + 20)
    assert server.process.returncode == 0, tail(server.log)
    assert server.rows() == [("cancelled", "server_draining")]


def test_the_embedded_model_stops_cleanly_when_its_stream_is_cut(serve_local: Callable[[], Server]) -> None:
    """The local backend (llama.cpp in process): cut mid-quote by a drain with no grace at all,
    the model's threads stop and the process exits cleanly, with its log row written."""
    for _ in range(3):  # a quote the model ended before the cut is not this case: again, elsewhere
        server = serve_local()
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", server.url + STREAM, json=QUOTE) as stream,
        ):
            assert stream.status_code == 200, stream.read()
            lines = stream.iter_lines()
            head = [next(lines)]
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        events = events_of(head + rest)
        if events[-1]["data"] != "[DONE]":
            break

    assert events[-1]["event"] == "reconnect", events[-3:]
    server.process.wait(timeout=30)
    output = server.log.read_text()
    assert server.process.returncode == 0, tail(server.log)
    assert "Traceback" not in output and '"level": "ERROR"' not in output, tail(server.log)
    assert server.rows() == [("cancelled", "server_draining")]
