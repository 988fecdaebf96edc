"""A quote survives the network going away mid-stream (issue 14): the page's connection is cut
and chromium goes offline, then online again, and the page ends with the whole quote, written
once. Daphne in a subprocess on AI_BACKEND=workers-ai, the fake upstream in this process, both
transports of the page.

Chromium's offline mode (Playwright's `context.set_offline`) fails new requests but leaves a
response already streaming alone (checked: the text went on growing offline). So the cut is
made where a network cut happens, on the TCP connections: the page talks to daphne through a
small proxy in this process, which closes every connection it carries at the moment of the
cut, while the browser is offline for the tries that follow.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, expect

from harness.workers_ai import FakeWorkersAI, Scenario

from .conftest import DaphneServer, start_daphne, watch_console, workers_ai_env

pytestmark = pytest.mark.system

TOKENS = tuple(f"word{i} " for i in range(60))
QUOTE = "".join(TOKENS).strip()
#: What chromium logs for the cut connection and for a try while offline.
CUT_LOGS = (
    "ERR_INCOMPLETE_CHUNKED_ENCODING",
    "ERR_INTERNET_DISCONNECTED",
    "Failed to fetch",
    "htmx:sse:error: network error",
)


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeWorkersAI]:
    with FakeWorkersAI() as fake:
        yield fake


@pytest.fixture(scope="module")
def site(upstream: FakeWorkersAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaphneServer]:
    # The defaults that matter here: a 10 s grace after a drop, the finished events kept.
    with start_daphne(tmp_path_factory.mktemp("daphne-resume"), **workers_ai_env(upstream)) as server:
        yield server


class CuttableProxy:
    """A TCP proxy to 127.0.0.1:`port` whose open connections can all be cut at once."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            cut, self.open = self.open, []
        for sock in cut:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


@pytest.fixture
def proxy(site: DaphneServer) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(int(site.url.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


def rows(site: DaphneServer) -> list[tuple[object, ...]]:
    return site.query("SELECT status, error_code, text FROM quotes_generation ORDER BY id")


@pytest.mark.parametrize("transport", ["htmx", "fetch"])
def test_resume_in_browser_offline_then_online_ends_with_the_whole_quote(
    site: DaphneServer,
    proxy: CuttableProxy,
    upstream: FakeWorkersAI,
    page: Page,
    context: BrowserContext,
    transport: str,
) -> None:
    upstream.reset()
    upstream.default = Scenario(tokens=TOKENS, token_delay_s=0.05)
    site.execute("DELETE FROM quotes_generation")
    problems = watch_console(page)
    page.goto(f"{proxy.url}/personas/alan-watts/" + ("?transport=fetch" if transport == "fetch" else ""))
    text = page.get_by_test_id("quote-text")
    expect(text).to_contain_text("word3 ")

    context.set_offline(True)
    proxy.cut()
    seen_offline = text.text_content() or ""
    time.sleep(1.0)  # the upstream writes on (about 20 tokens) while the page is cut off
    # The cut is real: nothing more reached the page while it was offline.
    assert (text.text_content() or "") == seen_offline
    assert not seen_offline.strip().endswith(QUOTE[-10:])
    context.set_offline(False)

    expect(page.get_by_test_id("quote-card")).to_have_attribute("data-state", "done", timeout=20_000)
    expect(text).to_have_text(QUOTE)  # every word, once
    assert len(upstream.requests) == 1  # resumed, not asked again
    assert rows(site) == [("ok", "", "".join(TOKENS))]
    # The browser logs the cut and the tries made while offline; nothing else.
    assert [p for p in problems if not any(cut in p for cut in CUT_LOGS)] == []


def test_resume_on_real_daphne_after_closing_the_socket(site: DaphneServer, upstream: FakeWorkersAI) -> None:
    """No browser: a client reads a few events from daphne, closes its socket (daphne sends the
    app `http.disconnect`), and resumes with Last-Event-ID on a new connection."""
    upstream.reset()
    upstream.default = Scenario(tokens=TOKENS, token_delay_s=0.02)
    site.execute("DELETE FROM quotes_generation")
    received: list[str] = []
    last_id = ""
    with (
        httpx.Client(base_url=site.url, timeout=10) as client,
        client.stream("POST", "/api/quotes/stream", json={"persona": "alan-watts"}) as response,
    ):
        assert response.status_code == 200
        generation_id = response.headers["x-generation-id"]
        for line in response.iter_lines():
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: "):
                received.append(json.loads(line[6:])["response"])
            if len(received) == 5:
                break  # leaving the block closes the socket mid-stream
    assert last_id.startswith(generation_id + ".")

    with httpx.Client(base_url=site.url, timeout=30) as client:
        rest = client.get("/api/quotes/stream", headers={"Last-Event-ID": last_id, "Sec-Fetch-Dest": "empty"})
    tokens = [
        json.loads(line[6:]).get("response", "")
        for line in rest.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]

    assert rest.status_code == 200 and rest.text.endswith("data: [DONE]\n\n")
    assert "".join(received + tokens) == "".join(TOKENS)
    assert len(upstream.requests) == 1
    assert rows(site) == [("ok", "", "".join(TOKENS))]
