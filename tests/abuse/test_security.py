"""Who the client is, and which pages may ask on its behalf (issues 13, 20, 29; issue 35 point
2's server limits), through the real ASGI app (HTTP and the WebSocket), a real daphne started
from deploy/systemd and nginx with deploy/nginx; the upstream is the fake Workers AI.

- IPv6 clients count by their /64 (QUOTES_IPV6_PREFIX); IPv4-mapped addresses as IPv4.
- X-Forwarded-For and -Proto are believed only from QUOTES_TRUSTED_PROXIES.
- A page of another origin (another site, a sibling subdomain, another scheme or port) cannot
  start or stop a generation, over HTTP or the WebSocket; DJANGO_CSRF_TRUSTED_ORIGINS may.
- A lone surrogate is a 400, or an error frame.
- daphne itself refuses a WebSocket message over the app's 64 KiB, as every deploy file runs it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings

from harness.daphne import INSTANCE_UNIT, environment, migrate, running_daphne
from harness.services import deploy_site, free_port, nginx
from harness.workers_ai import FakeWorkersAI, backend_env
from quotes.models import Generation, Persona
from quotes.rows import writer
from tests.asgi import STREAM_URL, StreamedResponse, htmx_form_post, parse_sse, post_quote, request
from tests.fixtures import TEST_ACCOUNT_ID, TEST_API_TOKEN, saved

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    await saved(persona, cache_ttl=0)  # every request a generation of its own
    return fake


async def get(query: str, headers: dict[str, str] | None = None) -> StreamedResponse:
    """A GET of the stream, as a page's fetch() sends it (a GET must accept the stream)."""
    return await request(
        "GET", STREAM_URL, query=query, headers={"sec-fetch-dest": "empty", **(headers or {})}
    )


def ip_hash(ip: str) -> str:
    return hmac.new(django_settings.SECRET_KEY.encode(), ip.encode(), hashlib.sha256).hexdigest()[:32]


def assert_json_error(response: StreamedResponse, status: int, code: str) -> None:
    assert response.status == status, response.body[:300]
    assert response.headers["content-type"] == "application/json", response.headers
    assert response.json()["error"]["code"] == code, response.json()


def assert_streamed(response: StreamedResponse) -> None:
    assert response.status == 200, response.body[:300]
    assert response.headers["content-type"] == "text/event-stream"
    assert b"[DONE]" in response.body


async def hashes() -> list[str]:
    await writer().flush(5)
    return [row.client_hash async for row in Generation.objects.order_by("created_at")]


def socket_to(
    headers: list[tuple[bytes, bytes]], peer: tuple[str, int] = ("203.0.113.9", 4000)
) -> WebsocketCommunicator:
    from config.asgi import application

    communicator = WebsocketCommunicator(application, "/ws/quotes/", headers=headers)
    communicator.scope["client"] = peer  # as the server sets it
    return communicator


THIS_SITE = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]


# -- IPv6: one /64 is one client ---------------------------------------------------------------


@pytest.mark.integration
async def test_ipv6_addresses_of_one_64_are_one_client_and_mapped_ipv4_is_ipv4(
    fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "1/minute"

    first = await post_quote(client=("2001:db8:1:2::1", 1000))
    rotated = await post_quote(client=("2001:db8:1:2:ffff:ffff:ffff:fffe", 1000))
    next_network = await post_quote(client=("2001:db8:1:3::1", 1000))
    ipv4 = await post_quote(client=("198.51.100.7", 1000))
    mapped = await post_quote(client=("::ffff:198.51.100.7", 1000))

    settings.QUOTES_IPV6_PREFIX = 128  # a setting: every address its own client again
    own_prefix = [(await post_quote(client=(f"2001:db8:9:9::{n}", 1000))).status for n in range(1, 4)]

    assert [r.status for r in (first, rotated, next_network, ipv4, mapped)] == [200, 429, 200, 200, 429]
    assert rotated.headers["retry-after"].isdigit()
    assert own_prefix == [200] * 3
    hashed = [ip_hash("2001:db8:1:2::"), ip_hash("2001:db8:1:3::"), ip_hash("198.51.100.7")]
    assert (await hashes())[:3] == hashed


# -- forwarded client addresses: only from trusted proxies ----------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    ("peer", "forwarded", "trusted", "counted_as"),
    [
        pytest.param(("203.0.113.9", 4000), "198.51.100.1", None, "203.0.113.9", id="untrusted-peer"),
        pytest.param(("127.0.0.1", 4000), "198.51.100.1", None, "198.51.100.1", id="loopback-proxy"),
        # what the visitor wrote left of the proxy's own entry proves nothing
        pytest.param(
            ("127.0.0.1", 4000), "6.6.6.6, 198.51.100.1", None, "198.51.100.1", id="client-prefix-ignored"
        ),
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
        # a unix socket has no peer address: trusted by default, as only nginx can reach it
        pytest.param(None, "198.51.100.1", None, "198.51.100.1", id="unix-socket"),
        pytest.param(None, "198.51.100.1", ["127.0.0.1"], "", id="unix-socket-not-trusted"),
        pytest.param(("127.0.0.1", 4000), "not-an-address", None, "127.0.0.1", id="garbage-header"),
        pytest.param(("127.0.0.1", 4000), "198.51.100.1", [], "127.0.0.1", id="nothing-trusted"),
    ],
)
async def test_forwarded_for_is_believed_only_from_a_trusted_proxy(
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
async def test_forwarded_for_over_the_websocket(fake: FakeWorkersAI) -> None:
    for peer in (("203.0.113.9", 4000), ("127.0.0.1", 4000)):
        socket_ = socket_to([*THIS_SITE, (b"x-forwarded-for", b"198.51.100.1")], peer)
        assert (await socket_.connect())[0]
        await socket_.send_json_to({"type": "start", "persona": "test-watts", "topic": peer[0]})
        while (frame := await socket_.receive_json_from(timeout=10))["type"] not in ("done", "error"):
            pass
        assert frame["type"] == "done", frame
        await socket_.disconnect()

    assert await hashes() == [ip_hash("203.0.113.9"), ip_hash("198.51.100.1")]


@pytest.mark.integration
async def test_forwarded_proto_from_a_trusted_proxy_sets_the_scheme(fake: FakeWorkersAI) -> None:
    """An https page behind nginx: its same-origin Origin header must match."""
    https_page = {
        "origin": "https://testserver",
        "sec-fetch-site": "same-origin",
        "x-forwarded-proto": "https",
    }

    behind_proxy = await post_quote(client=("127.0.0.1", 4000), headers=https_page)
    forged = await post_quote(client=("203.0.113.9", 4000), headers=https_page)

    assert_streamed(behind_proxy)
    assert_json_error(forged, 403, "cross_site")  # http://testserver, as far as an untrusted peer goes


# -- another origin's pages cannot start a generation ----------------------------------------------


CROSS_SITE = [  # (Sec-Fetch-Site, Origin, an EventSource's Accept)
    pytest.param("cross-site", "https://evil.example", True, id="eventsource-from-another-site"),
    pytest.param("cross-site", None, False, id="img-or-link-from-another-site"),
    pytest.param(None, "https://evil.example", False, id="foreign-origin"),
    pytest.param(None, "null", False, id="opaque-origin"),
    pytest.param(None, "http://testserver.evil.example", False, id="lookalike-origin"),
    # a sibling subdomain is the same site, but another origin (its own code)
    pytest.param("same-site", None, True, id="img-from-a-sibling-subdomain"),
    pytest.param("same-site", "http://sibling.testserver", True, id="eventsource-from-a-sibling-subdomain"),
    pytest.param("same-site", "http://testserver", False, id="same-site-but-our-origin"),
    pytest.param(None, "https://testserver", False, id="our-host-on-another-scheme"),
    pytest.param(None, "http://testserver:8443", False, id="our-host-on-another-port"),
    pytest.param("same-origin, cross-site", None, False, id="a-value-no-browser-sends"),
]


@pytest.mark.integration
@pytest.mark.parametrize(("fetch_site", "origin", "sse"), CROSS_SITE)
async def test_cross_site_get_is_403_and_never_reaches_the_upstream(
    fake: FakeWorkersAI, fetch_site: str | None, origin: str | None, sse: bool
) -> None:
    headers = {"sec-fetch-site": fetch_site, "origin": origin, "accept": "text/event-stream" if sse else None}
    response = await get("persona=test-watts&topic=rain", {k: v for k, v in headers.items() if v is not None})

    assert_json_error(response, 403, "cross_site")
    assert "this site" in response.json()["error"]["message"]
    assert fake.requests == []
    assert not await Generation.objects.aexists()


@pytest.mark.integration
@pytest.mark.parametrize("fetch_site", ["cross-site", "same-site"])
async def test_cross_site_post_is_403_and_htmx_gets_its_error_event(
    fake: FakeWorkersAI, fetch_site: str
) -> None:
    posted = await post_quote(headers={"origin": "https://evil.example", "sec-fetch-site": fetch_site})
    htmx = await get("persona=test-watts", {"hx-request": "true", "sec-fetch-site": fetch_site})

    assert_json_error(posted, 403, "cross_site")
    assert htmx.status == 403 and htmx.headers["content-type"] == "text/event-stream"
    [event] = parse_sse(htmx.body)
    assert event["event"] == "error" and json.loads(event["data"])["code"] == "cross_site"
    assert fake.requests == []


@pytest.mark.integration
async def test_same_site_form_post_with_a_planted_csrf_cookie_and_a_stop_are_refused(
    fake: FakeWorkersAI,
) -> None:
    """A sibling subdomain can set the CSRF cookie for the parent domain and post the matching
    token; on plain http, without an Origin, Django's check passes on the token alone."""
    sibling = await htmx_form_post({"persona": "test-watts"}, **{"sec-fetch-site": "same-site"})
    stop = await request("POST", f"/api/quotes/{uuid.uuid4()}/stop", headers={"sec-fetch-site": "same-site"})
    own = await htmx_form_post({"persona": "test-watts"}, **{"sec-fetch-site": "same-origin"})

    assert sibling.status == 403
    [event] = parse_sse(sibling.body)
    assert event["event"] == "error" and json.loads(event["data"])["code"] == "cross_site"
    assert_json_error(stop, 403, "cross_site")
    assert own.status == 200, own.body[:300]
    assert len(fake.requests) == 1


@pytest.mark.integration
@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="curl"),
        pytest.param({"accept": "text/event-stream", "sec-fetch-site": "same-origin"}, id="eventsource"),
        pytest.param({"sec-fetch-site": "same-origin", "origin": "http://testserver"}, id="fetch"),
        pytest.param({"sec-fetch-site": "none"}, id="typed-into-the-address-bar"),
    ],
)
async def test_same_site_and_non_browser_requests_still_stream(
    fake: FakeWorkersAI, headers: dict[str, str]
) -> None:
    response = await get("persona=test-watts", headers)

    assert response.status == 200, response.body[:300]
    assert response.headers["content-type"] == "text/event-stream"
    assert len(fake.requests) == 1


@pytest.mark.integration
async def test_csrf_trusted_origins_may_start_a_generation(fake: FakeWorkersAI, settings: Any) -> None:
    settings.CSRF_TRUSTED_ORIGINS = ["https://quotes.example.com", "https://*.example.org"]

    listed = await post_quote(headers={"origin": "https://quotes.example.com", "sec-fetch-site": "same-site"})
    wildcard = await post_quote(headers={"origin": "https://www.example.org", "sec-fetch-site": "same-site"})
    other = await post_quote(headers={"origin": "https://example.net"})

    assert_streamed(listed)
    assert_streamed(wildcard)
    assert_json_error(other, 403, "cross_site")


# Channels' AllowedHostsOriginValidator let the port, scheme and allowed-host cases in: it matched
# the Origin's host against ALLOWED_HOSTS, whatever its scheme and port and the socket's host.
SUBDOMAINS = ("ALLOWED_HOSTS", [".example.com"])
TRUSTED = ("CSRF_TRUSTED_ORIGINS", ["https://www.example.org"])
ORIGINS = [  # (Origin, Host, Sec-Fetch-Site, a setting, accepted)
    pytest.param("https://evil.example", "127.0.0.1", None, None, False, id="another-site"),
    pytest.param("null", "127.0.0.1", None, None, False, id="opaque-origin"),
    pytest.param("http://127.0.0.1.evil.example", "127.0.0.1", None, None, False, id="lookalike"),
    pytest.param("http://127.0.0.1:9999", "127.0.0.1:8000", None, None, False, id="another-port"),
    pytest.param("https://127.0.0.1:8000", "127.0.0.1:8000", None, None, False, id="another-scheme"),
    pytest.param("http://localhost:8000", "127.0.0.1:8000", None, None, False, id="another-allowed-host"),
    pytest.param("http://127.0.0.1:8000", "127.0.0.1:8000", "same-site", None, False, id="same-site"),
    pytest.param(None, "127.0.0.1:8000", None, None, False, id="no-origin"),
    pytest.param("http://sibling.example.com", "quotes.example.com", None, SUBDOMAINS, False, id="sibling"),
    pytest.param("http://rebound.example", "rebound.example", None, None, False, id="dns-rebinding"),
    pytest.param("http://127.0.0.1:8000", "127.0.0.1:8000", None, None, True, id="this-site"),
    pytest.param("http://127.0.0.1:8000", "127.0.0.1:8000", "same-origin", None, True, id="same-origin"),
    pytest.param(
        "http://quotes.example.com", "quotes.example.com", None, SUBDOMAINS, True, id="own-subdomain"
    ),
    pytest.param("https://www.example.org", "127.0.0.1:8000", None, TRUSTED, True, id="trusted-origin"),
]


@pytest.mark.integration
@pytest.mark.parametrize(("origin", "host", "fetch_site", "setting", "accepted"), ORIGINS)
async def test_websocket_only_from_this_origin(
    persona: Persona,
    settings: Any,
    origin: str | None,
    host: str,
    fetch_site: str | None,
    setting: Any,
    accepted: bool,
) -> None:
    if setting is not None:
        setattr(settings, *setting)
    fields = {b"host": host, b"origin": origin, b"sec-fetch-site": fetch_site}
    socket_ = socket_to([(name, value.encode()) for name, value in fields.items() if value is not None])

    connected, _ = await socket_.connect()

    assert connected == accepted
    if connected:
        await socket_.disconnect()


# -- lone surrogates ----------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "body",
    [
        b'{"persona": "test-watts", "topic": "rain \\ud800"}',
        b'{"persona": "test-watts", "topic": "\\udfff"}',
        b'{"persona": "test-watts", "messages": [{"role": "user", "content": "and then? \\ud800"}]}',
    ],
    ids=["topic", "low-surrogate-alone", "message"],
)
async def test_lone_surrogate_over_http_is_a_400(fake: FakeWorkersAI, body: bytes) -> None:
    response = await post_quote(body)

    assert_json_error(response, 400, "invalid_unicode")
    assert fake.requests == []
    assert not await Generation.objects.aexists()


@pytest.mark.integration
async def test_a_surrogate_pair_is_a_character_and_a_lone_one_an_error_frame(fake: FakeWorkersAI) -> None:
    pair = await post_quote(b'{"persona": "test-watts", "topic": "rain \\ud83c\\udf27"}')
    socket_ = socket_to(THIS_SITE)
    assert (await socket_.connect())[0]
    replies = []
    for frame in [
        '{"type": "start", "persona": "test-watts", "topic": "\\ud800"}',
        '{"type": "start", "persona": "test-watts", "messages": [{"role": "user", "content": "x\\udc00"}]}',
    ]:
        await socket_.send_to(text_data=frame)
        replies.append(await socket_.receive_json_from(timeout=10))
    await socket_.disconnect()

    assert_streamed(pair)
    await writer().flush(5)
    assert [row.topic async for row in Generation.objects.all()] == ["rain \U0001f327"]
    assert [(r["type"], r["code"]) for r in replies] == [("error", "invalid_unicode")] * 2
    assert len(fake.requests) == 1


# -- the deploy files ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daphne(tmp_path_factory: pytest.TempPathFactory, fake_workers_ai_server: FakeWorkersAI) -> Iterator[str]:
    """daphne as deploy/systemd/persona-quotes@.service runs it (on 127.0.0.1 instead of its
    socket), in production mode on a fresh SQLite file, answering from the fake Workers AI. One
    quote an hour per client; 127.0.0.2 is its only trusted proxy, so connecting from another
    loopback address is a visitor reaching the port directly. Each test asks from addresses of
    its own."""
    tmp = tmp_path_factory.mktemp("daphne")
    port = free_port()
    env = environment(
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}",
        **backend_env(fake_workers_ai_server.api_base_url, TEST_ACCOUNT_ID, TEST_API_TOKEN),
        QUOTES_RATE_LIMIT="1/hour",
        QUOTES_CACHE_TTL="0",
        QUOTES_TRUSTED_PROXIES="127.0.0.2",
    )
    migrate(env)
    with running_daphne(INSTANCE_UNIT, port, env, tmp / "daphne.log"):
        yield f"http://127.0.0.1:{port}"


def post_from(base_url: str, source: str, forged_ip: str) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=20) as client:
        return client.post(
            base_url + STREAM_URL,
            json={"persona": "alan-watts"},
            headers={"X-Real-IP": forged_ip, "X-Forwarded-For": forged_ip},
        )


@pytest.mark.system
def test_daphne_ignores_a_forged_client_address_and_honours_the_trusted_proxy(
    daphne: str, fake_workers_ai: FakeWorkersAI
) -> None:
    # A visitor on the open port: each request claims another address, and is counted as its own.
    direct = [post_from(daphne, "127.0.0.1", f"198.51.100.{n}") for n in (1, 2)]
    # The trusted proxy forwards two different visitors: each has its own count.
    proxied = [post_from(daphne, "127.0.0.2", f"192.0.2.{n}") for n in (1, 2)]

    assert direct[0].status_code == 200, direct[0].text
    assert (direct[1].status_code, direct[1].json()["error"]["code"]) == (429, "rate_limited")
    assert [r.status_code for r in proxied] == [200, 200], [r.text for r in proxied]


@contextlib.contextmanager
def handshake(
    base_url: str, origin: str, source: str = "127.0.0.1"
) -> Iterator[tuple[bytes, socket.socket, Any]]:
    """A WebSocket handshake from `origin`: its status line, the connection and its reader."""
    host = base_url.removeprefix("http://")
    address, _, port = host.partition(":")
    with socket.create_connection((address, int(port)), timeout=20, source_address=(source, 0)) as sock:
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            f"GET /ws/quotes/ HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nOrigin: {origin}\r\n\r\n".encode()
        )
        reader = sock.makefile("rb")
        status = reader.readline()
        while reader.readline() not in (b"\r\n", b""):
            pass
        yield status, sock, reader


def handshake_status(base_url: str, origin: str) -> bytes:
    with handshake(base_url, origin) as (status, _, _):
        return status


@pytest.mark.system
def test_daphne_refuses_a_sibling_subdomain_over_http_and_the_websocket(
    daphne: str, fake_workers_ai: FakeWorkersAI
) -> None:
    stream = daphne + STREAM_URL + "?persona=alan-watts"
    with httpx.Client(timeout=20, transport=httpx.HTTPTransport(local_address="127.0.1.1")) as client:
        sibling = client.get(stream, headers={"Sec-Fetch-Site": "same-site", "Accept": "text/event-stream"})
        socket_status = handshake_status(daphne, "http://sibling.127.0.0.1.example")
        own = client.get(stream, headers={"Sec-Fetch-Site": "same-origin", "Accept": "text/event-stream"})

    assert sibling.status_code == 403 and sibling.json()["error"]["code"] == "cross_site", sibling.text
    assert b" 403 " in socket_status, socket_status
    assert own.status_code == 200, own.text
    assert len(fake_workers_ai.requests) == 1


@pytest.mark.system
def test_behind_nginx_a_page_on_another_port_is_this_origin_only_on_its_own_port(
    daphne: str, tmp_path: Path
) -> None:
    """deploy/nginx's proxy rules in front of the daphne: the app compares the page's Origin with
    the Host nginx passes on, which must keep the port the browser sent."""
    proxy_port = free_port()
    with nginx(
        tmp_path, site=deploy_site(proxy_port, [daphne.removeprefix("http://")]), port=proxy_port
    ) as proxy:
        own = handshake_status(proxy.url, proxy.url)
        other_port = handshake_status(proxy.url, f"http://127.0.0.1:{free_port()}")

    assert b" 101 " in own, own
    assert b" 403 " in other_port, other_port


def send_frame(sock: socket.socket, payload: bytes | int) -> None:
    """One masked text frame (FIN), as a browser sends it; for a length, its header alone."""
    mask = os.urandom(4)
    length = payload if isinstance(payload, int) else len(payload)
    masked = b"" if isinstance(payload, int) else bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    sock.sendall(b"\x81" + struct.pack("!BQ", 0x80 | 127, length) + mask + masked)


def read_frame(reader: Any) -> tuple[int, bytes] | None:
    """The server's next frame (unmasked): its opcode and payload; None if it dropped the connection."""
    try:
        head = reader.read(2)
        if len(head) < 2:
            return None
        first, second = head
        length = second & 0x7F
        if length >= 126:
            size = 2 if length == 126 else 8
            (length,) = struct.unpack("!H" if size == 2 else "!Q", reader.read(size))
        return first & 0x0F, reader.read(length)
    except ConnectionResetError:
        return None


@pytest.mark.system
def test_daphne_refuses_a_websocket_message_over_64_kib_before_the_app_sees_it(daphne: str) -> None:
    """Issue 35, point 2: the app's cap came after daphne had read up to 1 MiB per message."""
    with handshake(daphne, daphne, source="127.0.2.1") as (status, sock, reader):
        assert b" 101 " in status, status
        send_frame(sock, b"x" * 65536)  # the cap itself: the app reads it, and says what is wrong
        at_the_cap = read_frame(reader)
        sock.settimeout(5)
        send_frame(sock, 70 * 1024)  # the header says 70 KiB: refused on it, before any of them
        over = read_frame(reader)

    assert at_the_cap is not None and at_the_cap[0] == 0x1, at_the_cap
    assert json.loads(at_the_cap[1])["code"] == "invalid_frame", at_the_cap
    # daphne (autobahn) drops the connection at once, unanswered: no payload read, nothing for the app
    assert over is None, over
