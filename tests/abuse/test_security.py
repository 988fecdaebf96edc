"""Issue 13's ways around the limits, each tried through a real interface: the ASGI app (HTTP and
the WebSocket), and a real daphne started with the Dockerfile's own command. The upstream is the
fake Workers AI server on 127.0.0.1.

1. IPv6 clients are counted by their /64 (QUOTES_IPV6_PREFIX); IPv4-mapped addresses as IPv4.
2. X-Forwarded-For is believed only from QUOTES_TRUSTED_PROXIES (quotes.security).
3. A browser on another site cannot start a generation (Sec-Fetch-Site / Origin); issue 20's
   point 4: nor a page of another origin on this site (a sibling subdomain, another port).
11. A lone surrogate in a topic or a turn is a 400, not a crash in the backend.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings

from harness.daphne import migrate, running_daphne
from harness.services import deploy_site, free_port, nginx
from harness.workers_ai import FakeWorkersAI
from quotes.ai.backends import reset_backends
from quotes.models import Generation, Persona
from tests.asgi import AsgiStream, StreamedResponse, htmx_form_post, parse_sse, post_quote, request
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN
from tests.limits import at_start_of_window

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
STREAM_URL = "/api/quotes/stream"


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    yield fake_workers_ai
    await reset_backends()


def limit_to(settings: Any, count: int) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, rate_limit=(count, 60))


async def get(query: str, headers: dict[str, str] | None = None) -> StreamedResponse:
    """A GET of the stream, as a page's fetch() sends it (a GET must accept the stream)."""
    stream = AsgiStream(
        "GET", STREAM_URL, query=query, headers={"sec-fetch-dest": "empty", **(headers or {})}
    )
    await stream.start()
    return await stream.read_all()


def ip_hash(ip: str) -> str:
    return hmac.new(django_settings.SECRET_KEY.encode(), ip.encode(), hashlib.sha256).hexdigest()[:32]


def assert_json_error(response: StreamedResponse, status: int, code: str) -> dict[str, Any]:
    assert response.status == status, response.body[:300]
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"]
    return dict(error)


def assert_streamed(response: StreamedResponse) -> None:
    assert response.status == 200, response.body[:300]
    assert response.headers["content-type"] == "text/event-stream"
    assert b"[DONE]" in response.body


async def hashes() -> list[str]:
    return [row.client_hash async for row in Generation.objects.order_by("id")]


# -- 1. IPv6: one /64 is one client --------------------------------------------------------------


@pytest.mark.integration
async def test_ipv6_rotating_addresses_in_one_64_are_refused_like_one_address(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    limit_to(settings, 3)
    await at_start_of_window()
    for n in range(1, 4):
        assert_streamed(await post_quote(client=(f"2001:db8:1:2::{n}", 1000)))

    rotated = await post_quote(client=("2001:db8:1:2:ffff:ffff:ffff:fffe", 1000))
    next_network = await post_quote(client=("2001:db8:1:3::1", 1000))

    assert_json_error(rotated, 429, "rate_limited")
    assert rotated.headers["retry-after"].isdigit()
    assert_streamed(next_network)
    logged = await hashes()
    assert logged[:4] == [ip_hash("2001:db8:1:2::")] * 4  # the log counts the /64, too
    assert logged[4] == ip_hash("2001:db8:1:3::")


@pytest.mark.integration
async def test_ipv6_prefix_is_a_setting(persona: Persona, fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_IPV6_PREFIX = 128  # every address its own client again
    limit_to(settings, 1)
    await at_start_of_window()

    responses = [await post_quote(client=(f"2001:db8:1:2::{n}", 1000)) for n in range(1, 4)]

    for response in responses:
        assert_streamed(response)


@pytest.mark.integration
async def test_ipv4_mapped_ipv6_counts_as_the_ipv4_address(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    limit_to(settings, 1)
    await at_start_of_window()
    assert_streamed(await post_quote(client=("198.51.100.7", 1000)))

    mapped = await post_quote(client=("::ffff:198.51.100.7", 1000))

    assert_json_error(mapped, 429, "rate_limited")
    assert await hashes() == [ip_hash("198.51.100.7")] * 2


# -- 2. forwarded client addresses: only from trusted proxies ------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    ("peer", "forwarded", "trusted", "counted_as"),
    [
        # a visitor who reaches the server directly picks nothing
        pytest.param(("203.0.113.9", 4000), "198.51.100.1", None, "203.0.113.9", id="untrusted-peer"),
        # nginx on this host (loopback is trusted by default) says who the visitor is
        pytest.param(("127.0.0.1", 4000), "198.51.100.1", None, "198.51.100.1", id="loopback-proxy"),
        # what the visitor wrote left of the proxy's own entry proves nothing
        pytest.param(
            ("127.0.0.1", 4000), "6.6.6.6, 198.51.100.1", None, "198.51.100.1", id="client-prefix-ignored"
        ),
        # a chain of trusted proxies: the first address from the right that is not one of them
        pytest.param(
            ("10.0.0.5", 4000),
            "198.51.100.1, 10.0.0.2",
            ["10.0.0.0/8"],
            "198.51.100.1",
            id="chain-of-proxies",
        ),
        pytest.param(
            ("10.0.0.5", 4000), "[2001:db8:5::1]:4711", ["10.0.0.0/8"], "2001:db8:5::", id="ipv6-port"
        ),
        # a unix socket (no peer address): trusted by default, as only nginx can reach it
        pytest.param(None, "198.51.100.1", None, "198.51.100.1", id="unix-socket"),
        pytest.param(None, "198.51.100.1", ["127.0.0.1"], "", id="unix-socket-not-trusted"),
        pytest.param(("127.0.0.1", 4000), "not-an-address", None, "127.0.0.1", id="garbage-header"),
        pytest.param(("127.0.0.1", 4000), "198.51.100.1", [], "127.0.0.1", id="nothing-trusted"),
    ],
)
async def test_forwarded_for_is_believed_only_from_a_trusted_proxy_over_http(
    persona: Persona,
    fake: FakeWorkersAI,
    settings: Any,
    peer: tuple[str, int] | None,
    forwarded: str,
    trusted: list[str] | None,
    counted_as: str,
) -> None:
    if trusted is not None:
        settings.QUOTES_TRUSTED_PROXIES = trusted

    response = await post_quote(
        client=peer, headers={"x-forwarded-for": forwarded, "x-real-ip": "192.0.2.66"}
    )

    assert_streamed(response)
    assert await hashes() == [ip_hash(counted_as)]


@pytest.mark.integration
async def test_forwarded_for_is_believed_only_from_a_trusted_proxy_over_the_websocket(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    from config.asgi import application

    for peer, counted_as in ((("203.0.113.9", 4000), "203.0.113.9"), (("127.0.0.1", 4000), "198.51.100.1")):
        socket_ = WebsocketCommunicator(
            application,
            "/ws/quotes/",
            headers=[
                (b"origin", b"http://127.0.0.1"),
                (b"host", b"127.0.0.1"),
                (b"x-forwarded-for", b"198.51.100.1"),
            ],
        )
        socket_.scope["client"] = peer  # as the server would set it (read when the app starts)
        connected, _ = await socket_.connect()
        assert connected
        await socket_.send_json_to({"type": "start", "persona": persona.slug, "topic": counted_as})
        while (frame := await socket_.receive_json_from(timeout=10))["type"] not in ("done", "error"):
            pass
        assert frame["type"] == "done", frame
        await socket_.disconnect()

    assert await hashes() == [ip_hash("203.0.113.9"), ip_hash("198.51.100.1")]


@pytest.mark.integration
async def test_forwarded_proto_from_a_trusted_proxy_sets_the_scheme(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """An https page behind nginx: its same-origin Origin header must match (point 3 relies on it)."""
    https_origin = {"origin": "https://testserver", "sec-fetch-site": "same-origin"}

    behind_proxy = await post_quote(
        client=("127.0.0.1", 4000), headers={"x-forwarded-proto": "https", **https_origin}
    )
    forged = await post_quote(
        client=("203.0.113.9", 4000), headers={"x-forwarded-proto": "https", **https_origin}
    )

    assert_streamed(behind_proxy)
    assert_json_error(forged, 403, "cross_site")  # http://testserver, as far as an untrusted peer goes


@pytest.fixture
def dockerfile_daphne(tmp_path: Path, fake_workers_ai: FakeWorkersAI) -> Iterator[str]:
    """deploy/Dockerfile's own daphne command on 127.0.0.1 (instead of 0.0.0.0:8000), on a fresh
    SQLite file, answering from the fake Workers AI. 127.0.0.2 is its only trusted proxy, so
    connecting from 127.0.0.1 is a visitor reaching the port directly."""
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "AI_", "CLOUDFLARE_", "QUOTES_"))
    }
    env.update(
        DJANGO_DEBUG="true",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        AI_BACKEND="workers-ai",
        CLOUDFLARE_ACCOUNT_ID=TEST_ACCOUNT_ID,
        CLOUDFLARE_API_TOKEN=TEST_API_TOKEN,
        CLOUDFLARE_API_BASE_URL=fake_workers_ai.api_base_url,
        QUOTES_RATE_LIMIT="1/h",  # an hour: a minute could turn over between the two requests
        QUOTES_CACHE_TTL="0",
        QUOTES_TRUSTED_PROXIES="127.0.0.2",
    )
    migrate(env)
    with running_daphne("Dockerfile", port, env, tmp_path / "daphne.log"):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.system
def test_dockerfile_daphne_ignores_a_forged_client_address_and_honours_the_trusted_proxy(
    dockerfile_daphne: str, fake_workers_ai: FakeWorkersAI
) -> None:
    def ask(source: str, forged_ip: str) -> httpx.Response:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=20) as client:
            return client.post(
                dockerfile_daphne + STREAM_URL,
                json={"persona": "alan-watts"},
                headers={"X-Real-IP": forged_ip, "X-Forwarded-For": forged_ip},
            )

    # A visitor on the open port: each request claims another address, and is counted as its
    # own (1 per minute), so the second is refused.
    direct = [ask("127.0.0.1", f"198.51.100.{n}") for n in (1, 2)]
    # The trusted proxy (127.0.0.2) forwards two different visitors: each has its own count.
    proxied = [ask("127.0.0.2", f"192.0.2.{n}") for n in (1, 2)]

    assert direct[0].status_code == 200, direct[0].text
    assert direct[1].status_code == 429, direct[1].text
    assert direct[1].json()["error"]["code"] == "rate_limited"
    assert [r.status_code for r in proxied] == [200, 200], [r.text for r in proxied]


@pytest.mark.integration
@pytest.mark.parametrize("unit", ["persona-quotes.service", "persona-quotes@.service"])
def test_systemd_units_leave_proxy_headers_to_the_app(unit: str) -> None:
    """daphne's --proxy-headers believes whoever connects; the app's middleware decides instead."""
    text = (ROOT / "deploy" / "systemd" / unit).read_text()
    exec_start = text[text.index("ExecStart=") :].split("\n\n")[0]
    assert "-m quotes.server" in exec_start  # daphne, draining on SIGTERM (quotes/server.py)
    assert "--proxy-headers" not in exec_start


# -- 3. cross-site requests cannot start a generation --------------------------------------------


CROSS_SITE = [
    pytest.param(
        {"sec-fetch-site": "cross-site", "origin": "https://evil.example", "accept": "text/event-stream"},
        id="eventsource-from-another-site",
    ),
    pytest.param({"sec-fetch-site": "cross-site"}, id="img-or-link-from-another-site"),
    pytest.param({"origin": "https://evil.example"}, id="foreign-origin"),
    pytest.param({"origin": "null"}, id="opaque-origin"),
    pytest.param({"origin": "http://testserver.evil.example"}, id="lookalike-origin"),
    # issue 20, point 4: a sibling subdomain is the same site, but another origin (its own code)
    pytest.param(
        {"sec-fetch-site": "same-site", "accept": "text/event-stream"},
        id="img-or-link-from-a-sibling-subdomain",
    ),
    pytest.param(
        {"sec-fetch-site": "same-site", "origin": "http://sibling.testserver", "accept": "text/event-stream"},
        id="eventsource-from-a-sibling-subdomain",
    ),
    pytest.param(
        {"sec-fetch-site": "same-site", "origin": "http://testserver"}, id="same-site-but-our-origin"
    ),
    pytest.param({"origin": "https://testserver"}, id="our-host-on-another-scheme"),
    pytest.param({"origin": "http://testserver:8443"}, id="our-host-on-another-port"),
    pytest.param({"sec-fetch-site": "same-origin, cross-site"}, id="a-value-no-browser-sends"),
]


@pytest.mark.integration
@pytest.mark.parametrize("headers", CROSS_SITE)
async def test_cross_site_get_is_403_and_never_reaches_the_upstream(
    persona: Persona, fake: FakeWorkersAI, headers: dict[str, str]
) -> None:
    response = await get(f"persona={persona.slug}&topic=rain", headers)

    error = assert_json_error(response, 403, "cross_site")
    assert "this site" in error["message"]
    assert fake.requests == []
    assert not await Generation.objects.aexists()


@pytest.mark.integration
async def test_cross_site_json_post_is_403(persona: Persona, fake: FakeWorkersAI) -> None:
    response = await post_quote(headers={"origin": "https://evil.example", "sec-fetch-site": "cross-site"})

    assert_json_error(response, 403, "cross_site")
    assert fake.requests == []


@pytest.mark.integration
async def test_cross_site_htmx_request_gets_its_error_event(persona: Persona, fake: FakeWorkersAI) -> None:
    response = await get(
        f"persona={persona.slug}",
        {"hx-request": "true", "sec-fetch-site": "cross-site", "origin": "https://evil.example"},
    )

    assert response.status == 403
    assert response.headers["content-type"] == "text/event-stream"
    [event] = parse_sse(response.body)
    assert event["event"] == "error"
    assert json.loads(event["data"])["code"] == "cross_site"
    assert fake.requests == []


@pytest.mark.integration
async def test_same_site_gets_spend_no_quota(persona: Persona, fake: FakeWorkersAI, settings: Any) -> None:
    """Refused before the rate limit counts them: a sibling's requests cannot use up a visitor's
    budget either."""
    limit_to(settings, 1)
    await at_start_of_window()

    refused = [await get(f"persona={persona.slug}", {"sec-fetch-site": "same-site"}) for _ in range(3)]
    own = await get(f"persona={persona.slug}", {"sec-fetch-site": "same-origin"})

    for response in refused:
        assert_json_error(response, 403, "cross_site")
    assert own.status == 200, own.body[:300]
    assert len(fake.requests) == 1


@pytest.mark.integration
async def test_same_site_htmx_get_gets_its_error_event(persona: Persona, fake: FakeWorkersAI) -> None:
    response = await get(f"persona={persona.slug}", {"hx-request": "true", "sec-fetch-site": "same-site"})

    assert response.status == 403
    [event] = parse_sse(response.body)
    assert event["event"] == "error" and json.loads(event["data"])["code"] == "cross_site"
    assert fake.requests == []


@pytest.mark.integration
async def test_same_site_form_post_with_a_planted_csrf_cookie_is_refused(
    persona: Persona, fake: FakeWorkersAI
) -> None:
    """A sibling subdomain can set the CSRF cookie for the parent domain and post the matching
    token; on plain http, without an Origin, Django's check passes on the token alone."""
    sibling = await htmx_form_post({"persona": persona.slug}, **{"sec-fetch-site": "same-site"})
    own = await htmx_form_post({"persona": persona.slug}, **{"sec-fetch-site": "same-origin"})

    assert sibling.status == 403
    [event] = parse_sse(sibling.body)
    assert event["event"] == "error" and json.loads(event["data"])["code"] == "cross_site"
    assert own.status == 200, own.body[:300]
    assert len(fake.requests) == 1


@pytest.mark.integration
async def test_same_site_stop_is_refused(persona: Persona) -> None:
    response = await request(
        "POST", f"/api/quotes/{uuid.uuid4()}/stop", headers={"sec-fetch-site": "same-site"}
    )

    assert_json_error(response, 403, "cross_site")


SAME_SITE = [
    pytest.param({}, id="curl"),
    pytest.param(
        {"accept": "text/event-stream", "sec-fetch-site": "same-origin"}, id="same-origin-eventsource"
    ),
    pytest.param(
        {"sec-fetch-site": "same-origin", "origin": "http://testserver"}, id="same-origin-fetch-with-origin"
    ),
    pytest.param({"sec-fetch-site": "none"}, id="typed-into-the-address-bar"),
]


@pytest.mark.integration
@pytest.mark.parametrize("headers", SAME_SITE)
async def test_same_site_and_non_browser_requests_still_stream(
    persona: Persona, fake: FakeWorkersAI, headers: dict[str, str]
) -> None:
    response = await get(f"persona={persona.slug}", headers)

    assert response.status == 200, response.body[:300]
    assert response.headers["content-type"] == "text/event-stream"
    assert len(fake.requests) == 1


@pytest.mark.integration
async def test_csrf_trusted_origins_may_start_a_generation(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    settings.CSRF_TRUSTED_ORIGINS = ["https://quotes.example.com", "https://*.example.org"]

    listed = await post_quote(headers={"origin": "https://quotes.example.com", "sec-fetch-site": "same-site"})
    wildcard = await post_quote(
        {"persona": persona.slug, "topic": "snow"},
        headers={"origin": "https://www.example.org", "sec-fetch-site": "same-site"},
    )
    other = await post_quote(headers={"origin": "https://example.net"})

    assert_streamed(listed)
    assert_streamed(wildcard)
    assert_json_error(other, 403, "cross_site")


@pytest.mark.integration
@pytest.mark.parametrize(
    "origin",
    [b"https://evil.example", b"null", b"http://127.0.0.1.evil.example"],
)
async def test_websocket_from_another_origin_is_refused(persona: Persona, origin: bytes) -> None:
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", origin), (b"host", b"127.0.0.1")]
    )
    connected, _ = await socket_.connect()

    assert not connected


@pytest.mark.integration
@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([(b"origin", b"http://127.0.0.1:9999")], id="another-port"),
        pytest.param([(b"origin", b"https://127.0.0.1:8000")], id="another-scheme"),
        pytest.param([(b"origin", b"http://localhost:8000")], id="another-allowed-host"),
        pytest.param(
            [(b"origin", b"http://127.0.0.1:8000"), (b"sec-fetch-site", b"same-site")], id="same-site"
        ),
        pytest.param([], id="no-origin"),
    ],
)
async def test_websocket_from_another_origin_of_an_allowed_host_is_refused(
    persona: Persona, headers: list[tuple[bytes, bytes]]
) -> None:
    """Channels' AllowedHostsOriginValidator let these in: it matched the Origin's host against
    ALLOWED_HOSTS, whatever its scheme and port, and whichever allowed host the socket was for."""
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[*headers, (b"host", b"127.0.0.1:8000")]
    )
    connected, _ = await socket_.connect()

    assert not connected


@pytest.mark.integration
async def test_websocket_from_a_sibling_subdomain_is_refused(persona: Persona, settings: Any) -> None:
    settings.ALLOWED_HOSTS = [".example.com"]
    from config.asgi import application

    def socket_from(origin: bytes) -> WebsocketCommunicator:
        return WebsocketCommunicator(
            application, "/ws/quotes/", headers=[(b"origin", origin), (b"host", b"quotes.example.com")]
        )

    own, _ = await (own_socket := socket_from(b"http://quotes.example.com")).connect()
    sibling, _ = await socket_from(b"http://sibling.example.com").connect()

    assert own and not sibling
    await own_socket.disconnect()


@pytest.mark.integration
async def test_websocket_for_a_host_not_allowed_is_refused(persona: Persona) -> None:
    """Host and Origin agree, but the host is not one of ALLOWED_HOSTS (DNS rebinding)."""
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application,
        "/ws/quotes/",
        headers=[(b"origin", b"http://rebound.example"), (b"host", b"rebound.example")],
    )
    connected, _ = await socket_.connect()

    assert not connected


@pytest.mark.integration
async def test_websocket_from_a_trusted_origin_is_accepted(persona: Persona, settings: Any) -> None:
    settings.CSRF_TRUSTED_ORIGINS = ["https://www.example.org"]
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application,
        "/ws/quotes/",
        headers=[(b"origin", b"https://www.example.org"), (b"host", b"127.0.0.1:8000")],
    )
    connected, _ = await socket_.connect()

    assert connected
    await socket_.disconnect()


@pytest.mark.integration
@pytest.mark.parametrize("fetch_site", [None, b"same-origin"])
async def test_websocket_from_this_site_is_accepted(persona: Persona, fetch_site: bytes | None) -> None:
    from config.asgi import application

    headers = [(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")]
    if fetch_site is not None:
        headers.append((b"sec-fetch-site", fetch_site))
    socket_ = WebsocketCommunicator(application, "/ws/quotes/", headers=headers)
    connected, _ = await socket_.connect()

    assert connected
    await socket_.disconnect()


def websocket_handshake_status(base_url: str, origin: str) -> bytes:
    """The status line a real server answers a WebSocket handshake from `origin` with."""
    host = base_url.removeprefix("http://")
    address, _, port = host.partition(":")
    with socket.create_connection((address, int(port)), timeout=20) as sock:
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            f"GET /ws/quotes/ HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nOrigin: {origin}\r\n\r\n".encode()
        )
        return sock.makefile("rb").readline()


@pytest.mark.system
def test_dockerfile_daphne_refuses_a_sibling_subdomain_over_http_and_the_websocket(
    dockerfile_daphne: str, fake_workers_ai: FakeWorkersAI
) -> None:
    """The deployed server (one quote an hour per client): a sibling's EventSource GET and its
    socket are refused before anything is spent, and this site's own page still gets its quote."""
    stream = dockerfile_daphne + STREAM_URL + "?persona=alan-watts"
    with httpx.Client(timeout=20) as client:
        sibling = client.get(stream, headers={"Sec-Fetch-Site": "same-site", "Accept": "text/event-stream"})
        socket_status = websocket_handshake_status(dockerfile_daphne, "http://sibling.127.0.0.1.example")
        own = client.get(stream, headers={"Sec-Fetch-Site": "same-origin", "Accept": "text/event-stream"})

    assert sibling.status_code == 403 and sibling.json()["error"]["code"] == "cross_site", sibling.text
    assert b" 403 " in socket_status, socket_status
    assert own.status_code == 200, own.text
    assert len(fake_workers_ai.requests) == 1


@pytest.mark.system
def test_behind_nginx_a_page_on_another_port_is_this_origin_only_on_its_own_port(
    dockerfile_daphne: str, tmp_path: Path
) -> None:
    """deploy/nginx's proxy rules in front of the daphne: the app compares the page's Origin with
    the Host nginx passes on, which must keep the port the browser sent (nginx's $host drops
    it, and every page of a site on a port other than 443 looked like another origin's)."""
    proxy_port = free_port()
    site = deploy_site(proxy_port, [dockerfile_daphne.removeprefix("http://")])
    with nginx(tmp_path, site=site, port=proxy_port) as proxy:
        own = websocket_handshake_status(proxy.url, proxy.url)
        other_port = websocket_handshake_status(proxy.url, f"http://127.0.0.1:{free_port()}")

    assert b" 101 " in own, own
    assert b" 403 " in other_port, other_port


# -- 11. lone surrogates ----------------------------------------------------------------------------

SURROGATE_BODIES = [
    pytest.param(b'{"persona": "test-watts", "topic": "rain \\ud800"}', id="topic"),
    pytest.param(b'{"persona": "test-watts", "topic": "\\udfff"}', id="topic-low-surrogate-alone"),
    pytest.param(
        b'{"persona": "test-watts", "messages": [{"role": "user", "content": "and then? \\ud800"}]}',
        id="message",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize("body", SURROGATE_BODIES)
async def test_lone_surrogate_over_http_is_a_400(persona: Persona, fake: FakeWorkersAI, body: bytes) -> None:
    response = await post_quote(body)

    error = assert_json_error(response, 400, "invalid_unicode")
    assert "surrogate" in error["message"]
    assert fake.requests == []
    assert not await Generation.objects.aexists()


@pytest.mark.integration
async def test_a_surrogate_pair_is_a_character_and_passes(persona: Persona, fake: FakeWorkersAI) -> None:
    response = await post_quote(b'{"persona": "test-watts", "topic": "rain \\ud83c\\udf27"}')

    assert_streamed(response)
    row = await Generation.objects.aget()
    assert row.topic == "rain \U0001f327"


@pytest.mark.integration
@pytest.mark.parametrize(
    "frame",
    [
        '{"type": "start", "persona": "test-watts", "topic": "\\ud800"}',
        '{"type": "start", "persona": "test-watts", "messages": [{"role": "user", "content": "x\\udc00"}]}',
    ],
)
async def test_lone_surrogate_over_the_websocket_is_an_error_frame(
    persona: Persona, fake: FakeWorkersAI, frame: str
) -> None:
    from config.asgi import application

    socket_ = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    connected, _ = await socket_.connect()
    assert connected
    try:
        await socket_.send_to(text_data=frame)
        reply = await socket_.receive_json_from(timeout=10)
    finally:
        await socket_.disconnect()

    assert reply["type"] == "error" and reply["code"] == "invalid_unicode", reply
    assert fake.requests == []
    assert not await Generation.objects.aexists()
