"""What a client may spend, and what spends it, through the real ASGI app (HTTP, and the
WebSocket consumer in-process); the upstream is the fake Workers AI on 127.0.0.1.

- A network (an IPv4 /24, an IPv6 /48) has a budget of its own across its clients (issue 20).
- Invalid requests count against the client and its network; a made-up slug costs no query
  (issues 20, 29); share and stop are rate-limited (issue 29).
- Issue 35, point 1: another site's page cannot spend a visitor's budget. The cross-site check
  comes first everywhere; bad input counts only from this site or from no browser; a 406 never.
- Issue 35, point 5: feedback, share and stop have a per-network budget; issue 39, point 3: six
  times a client's, and a Stop of one's own quote is never refused.
- Issue 35, point 2: sockets are admitted: a bounded number per client and per network; one
  that starts nothing, or keeps sending refused frames, is closed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connection
from django.db.backends.signals import connection_created

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes import personas
from quotes.models import Generation, Persona, Vote
from quotes.services import persona_save
from tests.asgi import (
    CSRF,
    FORM_URL,
    STREAM_URL,
    htmx_form_post,
    post_quote,
    post_stream,
    read_events,
    request,
)
from tests.fixtures import saved

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.services]

SAFARI = "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 Version/15.6 Safari/605.1.15"


@pytest.fixture
async def fake(fake: FakeWorkersAI, persona: Persona) -> FakeWorkersAI:
    await saved(persona, cache_ttl=0)  # every request a generation of its own
    # Loaded now: a refusal is counted against this test's persona, not an earlier test's, which
    # quotes.personas still holds (its database row gone, the count's write fails until flush gives up).
    await personas.get_active(persona.slug)
    return fake


def body(topic: str = "rain") -> dict[str, str]:
    return {"persona": "test-watts", "topic": topic}


@pytest.mark.parametrize(
    ("neighbours", "stranger"),
    [
        ([f"2001:db8:7:{n}::1" for n in range(1, 7)] + ["2001:db8:7:ffff::9"], "2001:db8:8::1"),
        ([f"198.51.100.{n}" for n in range(1, 8)], "198.51.101.1"),
    ],
    ids=["ipv6-48", "ipv4-24"],
)
async def test_a_network_has_its_own_budget_across_its_clients(
    fake: FakeWorkersAI, settings: Any, neighbours: list[str], stranger: str
) -> None:
    settings.QUOTES_RATE_LIMIT = "1/minute"  # a network: six times that

    answers = [await post_quote(body(f"t{n}"), client=(ip, 40000)) for n, ip in enumerate(neighbours)]
    elsewhere = await post_quote(body("x"), client=(stranger, 40000))

    assert [answer.status for answer in answers] == [200] * 6 + [429]
    refused = answers[-1].json()["error"]
    assert refused["code"] == "rate_limited" and "network" in refused["message"]
    assert int(answers[-1].headers["retry-after"]) > 0
    assert elsewhere.status == 200  # another network has a budget of its own


async def test_invalid_requests_count_against_the_client_and_its_network(
    fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "1/minute"

    unknown = await post_quote({"persona": "nobody"}, client=("198.51.100.1", 1))
    bad_json = await post_quote(b"{not json", client=("198.51.100.1", 1))
    neighbours = [await post_quote({"persona": "nobody"}, client=(f"198.51.100.{n}", 1)) for n in range(2, 7)]
    valid = await post_quote(body(), client=("198.51.100.7", 1))

    assert (unknown.status, unknown.json()["error"]["code"]) == (404, "unknown_persona")
    assert (bad_json.status, bad_json.json()["error"]["code"]) == (429, "rate_limited")
    assert [answer.status for answer in neighbours] == [404] * 5
    assert valid.status == 429 and "network" in valid.json()["error"]["message"]
    assert fake.requests == []


@pytest.fixture
def persona_queries() -> Iterator[list[str]]:
    """The queries that read personas, on every connection opened meanwhile (a look-up runs on a
    worker thread, on a connection of its own)."""
    seen: list[str] = []
    recording = [True]

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if recording[0] and 'FROM "quotes_persona"' in sql:
            seen.append(sql)
        return execute(sql, params, many, context)

    def instrument(sender: Any, connection: Any, **kwargs: Any) -> None:
        if record not in connection.execute_wrappers:
            connection.execute_wrappers.append(record)

    connection_created.connect(instrument)
    yield seen
    recording[0] = False
    connection_created.disconnect(instrument)


def rename_behind_the_orm(old: str, new: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE quotes_persona SET slug = %s WHERE slug = %s", [new, old])


async def test_made_up_slugs_cost_no_query_each_and_are_known_until_personas_change(
    fake: FakeWorkersAI, settings: Any, persona_queries: list[str]
) -> None:
    settings.QUOTES_RATE_LIMIT = "20/minute"

    answers = [await post_quote({"persona": f"nobody-{n}"}) for n in range(26)]
    queries = len(persona_queries)
    # The persona becomes "ghost" behind the ORM (no signal): the slugs held are those loaded...
    await sync_to_async(rename_behind_the_orm)("test-watts", "ghost")
    remembered = await post_quote({"persona": "ghost"}, client=("192.0.2.9", 1))
    # ...until persona data changes through the app (an editor's save), which reloads them.
    await sync_to_async(persona_save)(persona=await Persona.objects.aget(slug="ghost"))
    found = await post_quote({"persona": "ghost"}, client=("192.0.2.9", 1))

    assert [answer.status for answer in answers] == [404] * 20 + [429] * 6
    assert queries <= 1  # the active slugs, loaded together (once, or already), for all 26
    assert (remembered.status, found.status) == (404, 200)


@pytest.mark.parametrize("action", ["stop", "share"])
async def test_share_and_stop_are_rate_limited(persona: Persona, settings: Any, action: str) -> None:
    settings.QUOTES_FEEDBACK_RATE_LIMIT = "2/minute"
    csrf = {"cookie": f"csrftoken={CSRF}", "x-csrftoken": CSRF}

    answers = [await request("POST", f"/api/quotes/{uuid.uuid4()}/{action}", headers=csrf) for _ in range(3)]

    assert [answer.status for answer in answers] == [404, 404, 429]
    assert answers[-1].json()["error"]["code"] == "rate_limited"
    assert int(answers[-1].headers["retry-after"]) > 0


async def test_one_address_cannot_spend_its_neighbours_budgets_and_a_stop_of_ones_own_is_never_refused(
    fake: FakeWorkersAI, persona: Persona, settings: Any
) -> None:
    """Issue 39, point 3: the network had one client's budget, so thirty stops from one address
    refused its neighbours' Stop, and their generations ran on, paid."""
    settings.QUOTES_FEEDBACK_RATE_LIMIT = "3/minute"
    fake.default = Scenario(tokens=["tick"] * 200, token_delay_s=0.02)
    spender, neighbour = ("198.51.100.1", 1), ("198.51.100.2", 1)
    misses = [await request("POST", f"/api/quotes/{uuid.uuid4()}/stop", client=spender) for _ in range(4)]
    assert [answer.status for answer in misses] == [404, 404, 404, 429]  # its own budget, spent
    for who in (neighbour, spender):  # its neighbour's Stop, and its own Stop of its own quote
        stream = post_stream(body(), client=who)
        await read_events(stream, 2)
        quote = stream.response.headers["x-quote-id"]  # type: ignore[union-attr]
        stopped = await request("POST", f"/api/quotes/{quote}/stop", client=who)
        assert (stopped.status, stopped.json()) == (200, {"id": quote, "stopped": True})
        await stream.read_all()
    rows = [row async for row in Generation.objects.order_by("id")]
    assert [(row.status, row.error_code) for row in rows] == [("cancelled", "stopped")] * 2
    # Ratings and shares: the spender's budget is its own; the network has six times it.
    csrf = {"cookie": f"csrftoken={CSRF}", "x-csrftoken": CSRF}
    share = f"/api/quotes/{rows[0].public_id}/share"
    shares = [await request("POST", share, client=spender, headers=csrf) for _ in range(4)]
    assert [answer.status for answer in shares] == [404, 404, 404, 429]  # (a cancelled quote is not shared)
    assert (await request("POST", share, client=neighbour, headers=csrf)).status == 404


# -- issue 35, point 1: what another site's page can spend -------------------------------------

CROSS_SITE_IMAGE = {"sec-fetch-site": "cross-site", "sec-fetch-dest": "image", "user-agent": SAFARI}
OLD_SAFARI = {"user-agent": SAFARI}  # no fetch metadata (Safari before 16.4): it might be any page's
EVIL_TEXT = {"origin": "https://evil.example", "content-type": "text/plain", "user-agent": SAFARI}
OWN_JSON = {"sec-fetch-site": "same-origin", "content-type": "application/json", "user-agent": SAFARI}


@pytest.mark.parametrize(
    ("ask", "status", "counts"),
    [
        # the repro: <img src=".../quotes/stream"> on any page (it was 405, and counted)
        pytest.param(("GET", FORM_URL, CROSS_SITE_IMAGE, b""), 403, False, id="cross-site-img-of-the-form"),
        pytest.param(("GET", STREAM_URL, CROSS_SITE_IMAGE, b""), 403, False, id="cross-site-img-of-the-api"),
        pytest.param(
            ("GET", STREAM_URL, {"sec-fetch-site": "same-site"}, b""), 403, False, id="sibling-subdomain"
        ),
        pytest.param(("GET", FORM_URL, OLD_SAFARI, b""), 405, False, id="old-safari-img-of-the-form"),
        pytest.param(("GET", STREAM_URL, OLD_SAFARI, b""), 406, False, id="old-safari-img-of-the-api"),
        pytest.param(("GET", STREAM_URL, {}, b""), 406, False, id="a-406-never-counts"),
        pytest.param(("POST", STREAM_URL, EVIL_TEXT, b"{}"), 403, False, id="cross-site-text-post"),
        # from no browser (curl), or from this site's own page: bad input is not free
        pytest.param(("PUT", STREAM_URL, {}, b""), 405, True, id="curl-put"),
        pytest.param(("POST", STREAM_URL, OWN_JSON, b"{not json"), 400, True, id="own-page-bad-json"),
    ],
)
async def test_bad_input_counts_only_from_this_site_or_no_browser(
    fake: FakeWorkersAI, ask: tuple[str, str, dict[str, str], bytes], status: int, counts: bool
) -> None:
    """At the default 20 a minute: 21 of each, then the visitor's own quote from the page."""
    method, path, headers, payload = ask
    answers = [(await request(method, path, body=payload, headers=headers)).status for _ in range(21)]
    own = await htmx_form_post({"persona": "test-watts"}, **{"sec-fetch-site": "same-origin"})

    if counts:
        assert (answers, own.status) == ([status] * 20 + [429], 429)
    else:
        assert answers == [status] * 21  # never a 429: nothing was counted
        assert own.status == 200, own.body[:300]
        assert len(fake.requests) == 1


async def test_cross_site_images_from_a_whole_network_spend_nothing(fake: FakeWorkersAI) -> None:
    """Six visitors of one /24 on a page with 21 <img> tags each: the network's budget is whole."""
    for n in range(1, 7):
        for _ in range(21):
            answer = await request("GET", FORM_URL, headers=CROSS_SITE_IMAGE, client=(f"198.51.100.{n}", 1))
            assert answer.status == 403
    own = await post_quote(body(), client=("198.51.100.9", 1))
    assert own.status == 200


async def test_feedback_refuses_another_site_then_the_type_then_counts(persona: Persona) -> None:
    """31 cross-site text/plain votes were 415 x 30, then 429, and the visitor's own vote 429."""
    quote = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")
    url = f"/api/quotes/{quote.public_id}/feedback"
    cross_site = {
        "origin": "https://evil.example",
        "sec-fetch-site": "cross-site",
        "content-type": "text/plain",
    }

    elsewhere = [
        (await request("POST", url, body=b'{"value": -1}', headers=cross_site)).status for _ in range(31)
    ]
    wrong_type = [
        (await request("POST", url, body=b"{}", headers={"content-type": "text/plain"})).status
        for _ in range(31)
    ]
    own = await request("POST", url, json_body={"value": 1}, headers={"sec-fetch-site": "same-origin"})

    assert elsewhere == [403] * 31
    assert wrong_type == [415] * 31  # refused before the count: costs no query either
    assert own.status == 200 and own.json()["feedback"] == 1


# -- issue 35, point 5: a network's votes ---------------------------------------------------------


async def test_a_network_cannot_cast_fifty_votes_from_fifty_64s(persona: Persona) -> None:
    """Default settings: one /48 held 65,536 voters, each with a budget of its own."""
    quote = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")

    url = f"/api/quotes/{quote.public_id}/feedback"

    answers = [
        await request("POST", url, json_body={"value": -1}, client=(f"2001:db8:66:{n:x}::1", 1))
        for n in range(50)
    ]
    elsewhere = await request("POST", url, json_body={"value": 1}, client=("2001:db8:77::1", 1))

    statuses = [answer.status for answer in answers]
    assert 429 in statuses and "network" in answers[statuses.index(429)].json()["error"]["message"]
    assert statuses.count(200) == await Vote.objects.filter(value=-1).acount() < 50
    assert elsewhere.status == 200


# -- issue 35, point 2: sockets are admitted ----------------------------------------------------


def socket_from(ip: str) -> WebsocketCommunicator:
    from config.asgi import application

    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    socket.scope["client"] = (ip, 40000)  # as the server sets it
    return socket


async def test_sockets_are_bounded_per_client_and_per_network(settings: Any) -> None:
    settings.QUOTES_MAX_SOCKETS = 1  # a network: six
    held = [socket_from(f"2001:db8:5:{n}::1") for n in range(1, 7)]
    try:
        assert [(await socket.connect())[0] for socket in held] == [True] * 6
        second = await socket_from("2001:db8:5:1::2").connect()  # the first /64's second socket
        seventh = await socket_from("2001:db8:5:7::1").connect()  # the network's seventh
        elsewhere = await (other := socket_from("2001:db8:6::1")).connect()
        await other.disconnect()
        await held.pop(0).disconnect()  # a socket closed is given back
        after_close = await (last := socket_from("2001:db8:5:7::1")).connect()
        held.append(last)
    finally:
        for socket in held:
            await socket.disconnect()

    assert second == (False, 4008) and seventh == (False, 4008)  # refused at the handshake (403)
    assert elsewhere[0] and after_close[0]


async def test_an_idle_socket_is_closed_but_not_while_it_streams(fake: FakeWorkersAI, settings: Any) -> None:
    settings.QUOTES_SOCKET_IDLE_S = 0.3
    fake.default = Scenario(tokens=["tick "] * 12, token_delay_s=0.05)  # 0.6 s: longer than idle
    idle, busy = socket_from("198.51.100.1"), socket_from("198.51.100.2")
    assert (await idle.connect())[0] and (await busy.connect())[0]
    await busy.send_json_to({"type": "start", "persona": "test-watts"})
    frames = []
    while not frames or frames[-1]["type"] not in ("done", "error"):
        frames.append(await busy.receive_json_from(timeout=5))  # a close here fails the test

    idle_closed = await idle.receive_output(timeout=2)
    busy_closed = await busy.receive_output(timeout=2)  # idle again once its quote is done
    await idle.disconnect()
    await busy.disconnect()

    assert frames[-1]["type"] == "done" and "".join(f.get("text", "") for f in frames).count("tick") == 12
    assert idle_closed == {"type": "websocket.close", "code": 4008}
    assert busy_closed == {"type": "websocket.close", "code": 4008}


async def test_refused_frames_close_the_socket(persona: Persona, settings: Any) -> None:
    refusing, oversized = socket_from("198.51.100.1"), socket_from("198.51.100.2")
    assert (await refusing.connect())[0] and (await oversized.connect())[0]
    codes = []
    for frame in [
        "{not json",
        '{"type": "nope"}',
        "[]",
        '{"type": "start"}',
        '{"type": "start", "persona": 1}',
    ]:
        await refusing.send_to(text_data=frame)
        codes.append((await refusing.receive_json_from(timeout=5))["code"])
    closed = await refusing.receive_output(timeout=2)
    await oversized.send_to(text_data="x" * (settings.QUOTES_MAX_FRAME_BYTES + 1))
    too_large = await oversized.receive_json_from(timeout=5)
    oversized_closed = await oversized.receive_output(timeout=2)
    await refusing.disconnect()
    await oversized.disconnect()

    assert codes == ["invalid_frame", "invalid_frame", "invalid_frame", "missing_persona", "invalid_persona"]
    assert closed == {"type": "websocket.close", "code": 4008}
    assert (too_large["type"], too_large["code"]) == ("error", "frame_too_large")
    assert oversized_closed == {"type": "websocket.close", "code": 4009}


async def test_socket_starts_and_resumes_count_refused_frames_do_not(
    fake: FakeWorkersAI, settings: Any
) -> None:
    settings.QUOTES_RATE_LIMIT = "2/minute"
    socket = socket_from("198.51.100.1")
    assert (await socket.connect())[0]
    replies = []
    unknown = f"{uuid.uuid4()}.{'0' * 16}:1"
    start = {"type": "start", **body()}
    for frame in [
        {"type": "resume", "last_event_id": unknown},
        {"type": "nope"},
        {"type": "nope"},
        start,
        start,
    ]:
        await socket.send_json_to(frame)
        while (reply := await socket.receive_json_from(timeout=5))["type"] not in ("done", "error"):
            pass
        replies.append(reply.get("code", reply["type"]))
    await socket.disconnect()

    assert replies == ["resume_unavailable", "invalid_frame", "invalid_frame", "done", "rate_limited"]
    assert len(fake.requests) == 1
