"""A quote survives the network going away mid-stream, on both transports: the page's connections
are cut and chromium goes offline, then online again, and the page ends on the whole quote, written
once. Chromium's offline mode leaves a response already streaming alone, so the cut is made on the
TCP connections: the page talks to daphne through a proxy in this process, which cuts them all."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from playwright.sync_api import BrowserContext, Page, expect

from harness.workers_ai import FakeWorkersAI, Scenario

from .conftest import Site, besides, card_state

pytestmark = pytest.mark.system

TOKENS = tuple(f"word{i} " for i in range(60))
#: What chromium logs for the cut connection and for the tries made while offline.
CUT_LOGS = (
    "ERR_INCOMPLETE_CHUNKED_ENCODING",
    "ERR_INTERNET_DISCONNECTED",
    "Failed to fetch",
    "network error",
)


class CuttableProxy:
    """A TCP proxy to 127.0.0.1:`port` whose open connections can all be cut at once."""

    def __init__(self, port: int) -> None:
        self.target, self.lock, self.open = port, threading.Lock(), list[socket.socket]()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                with self.lock:
                    self.open += [client, server]
                for source, sink in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
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


@pytest.fixture
def proxy(workers_site: Site) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(int(workers_site.url.rsplit(":", 1)[1]))
    yield proxy
    proxy.listener.close()
    proxy.cut()


@pytest.mark.parametrize("transport", ["htmx", "fetch"])
def test_resume_in_browser_offline_then_online_ends_on_the_whole_quote(
    workers_site: Site,
    proxy: CuttableProxy,
    fake: FakeWorkersAI,
    page: Page,
    context: BrowserContext,
    problems: list[str],
    transport: str,
) -> None:
    fake.default = Scenario(tokens=TOKENS, token_delay_s=0.05)
    page.goto(f"{proxy.url}/personas/alan-watts/" + ("?transport=fetch" if transport == "fetch" else ""))
    text = page.get_by_test_id("quote-text")
    expect(text).to_contain_text("word3 ")

    context.set_offline(True)
    proxy.cut()
    seen = text.text_content() or ""
    time.sleep(1.0)  # the upstream writes on (some 20 tokens) while the page is cut off
    assert (text.text_content() or "") == seen  # the cut is real: nothing reached the page
    assert "word59" not in seen
    context.set_offline(False)

    card_state(page, "^done$", timeout=20_000)
    expect(text).to_have_text("".join(TOKENS).strip())  # every word, once
    assert len(fake.requests) == 1  # resumed, not asked again
    assert workers_site.last_row() == ("ok", "", "".join(TOKENS))
    assert besides(problems, *CUT_LOGS) == []  # the browser logs the cut and the offline tries only
