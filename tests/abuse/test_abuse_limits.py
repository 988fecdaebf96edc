"""Issue 20, points 5 and 6, through the stream endpoint of the real ASGI app (the upstream is the
fake Workers AI on 127.0.0.1):

- a second, coarser rate limit per network (an IPv6 /48, an IPv4 /24) with its own higher budget,
  so that whoever holds a /48 does not get 65,536 clients' budgets;
- invalid requests (an unknown persona, bad JSON) count against the client's rate limit, and an
  unknown slug is answered from the active slugs held in memory instead of costing a query each.

Issue 29, points 7 and 8: made-up slugs cost no query each, refused requests count against the
network's limit too, the WebSocket counts its refused frames, and share and stop are rate-limited.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connection
from django.db.backends.signals import connection_created

from harness.workers_ai import FakeWorkersAI
from quotes.models import Persona
from quotes.services import persona_save
from tests.asgi import CSRF, post_quote, request
from tests.limits import configure

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.services]


@pytest.fixture
def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> FakeWorkersAI:
    return fake_workers_ai


def body(topic: str) -> dict[str, str]:
    return {"persona": "test-watts", "topic": topic}


@pytest.mark.parametrize(
    ("neighbours", "stranger"),
    [
        ([f"2001:db8:7:{n}::1" for n in range(1, 6)] + ["2001:db8:7:ffff::9"], "2001:db8:8::1"),
        ([f"198.51.100.{n}" for n in range(1, 7)], "198.51.101.1"),
    ],
    ids=["ipv6-48", "ipv4-24"],
)
async def test_abuse_a_network_has_its_own_budget_across_its_clients(
    persona: Persona, fake: FakeWorkersAI, settings: Any, neighbours: list[str], stranger: str
) -> None:
    configure(settings, rate_limit=(2, 3600), network_rate_limit=(5, 3600), cache_ttl=0)

    # Six clients of one network (distinct /64s, or distinct IPv4 addresses), one request each:
    # each is well within its own limit, and the sixth is over the network's.
    answers = [await post_quote(body(f"t{n}"), client=(ip, 40000)) for n, ip in enumerate(neighbours)]
    elsewhere = await post_quote(body("x"), client=(stranger, 40000))

    assert [answer.status for answer in answers] == [200] * 5 + [429]
    refused = answers[-1].json()["error"]
    assert refused["code"] == "rate_limited" and "network" in refused["message"]
    assert int(answers[-1].headers["retry-after"]) > 0
    assert elsewhere.status == 200  # another network has a budget of its own


async def test_abuse_invalid_requests_count_against_the_client(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, rate_limit=(5, 3600))

    unknown = [await post_quote({"persona": f"nobody-{n}"}) for n in range(5)]
    bad_json = await post_quote(b"{not json")
    valid = await post_quote(body("rain"))

    assert [answer.status for answer in unknown] == [404] * 5
    assert bad_json.status == 429 and bad_json.json()["error"]["code"] == "rate_limited"
    assert valid.status == 429  # the invalid ones used the budget up
    assert fake.requests == []


async def test_abuse_an_unknown_persona_is_remembered_briefly(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, rate_limit=(100, 3600))
    assert (await post_quote({"persona": "ghost"})).status == 404
    # The persona appears behind the ORM's back (no signal): the slugs held are still those loaded,
    # so the second request costs no query and still answers 404...
    await sync_to_async(rename_behind_the_orm)(persona.slug, "ghost")
    remembered = await post_quote({"persona": "ghost"})
    # ...until persona data changes through the app (an editor's save), which reloads them.
    found = await persona_save_async(slug="ghost")

    assert remembered.status == 404
    assert found.status == 200


def rename_behind_the_orm(old: str, new: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE quotes_persona SET slug = %s WHERE slug = %s", [new, old])


async def persona_save_async(*, slug: str) -> Any:
    ghost = await Persona.objects.aget(slug=slug)
    await sync_to_async(persona_save)(persona=ghost)
    return await post_quote({"persona": slug, "topic": "rain"})


# --- issue 29: what invalid requests cost before they are counted, and share and stop ---------


@pytest.fixture
def persona_queries() -> Iterator[list[str]]:
    """The queries that look a persona up, on every connection opened meanwhile (a look-up runs
    on a worker thread, on a connection of its own). The wrapper stays on a worker thread's
    connection after the test (only that thread could take it off), recording nothing."""
    seen: list[str] = []
    recording = [True]

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if recording[0] and 'FROM "quotes_persona"' in sql:
            seen.append(sql)
        return execute(sql, params, many, context)

    def instrument(sender: Any, connection: Any, **kwargs: Any) -> None:
        if record not in connection.execute_wrappers:  # a thread's wrapper object connects anew
            connection.execute_wrappers.append(record)

    connection_created.connect(instrument)
    yield seen
    recording[0] = False
    connection_created.disconnect(instrument)


async def test_abuse_made_up_slugs_cost_no_query_each(
    persona: Persona, fake: FakeWorkersAI, settings: Any, persona_queries: list[str]
) -> None:
    """26 made-up slugs made 26 queries, although 6 were answered 429: the active personas'
    slugs are now loaded together, once, and a slug that is not among them costs nothing."""
    configure(settings, rate_limit=(20, 3600))

    answers = [await post_quote({"persona": f"nobody-{n}"}) for n in range(26)]
    queries = len(persona_queries)
    valid = await post_quote(body("rain"), client=("192.0.2.9", 40000))

    assert [answer.status for answer in answers] == [404] * 20 + [429] * 6
    assert queries == 1  # the slugs, for all 26
    assert valid.status == 200  # a real persona is still found (its own query)


async def test_abuse_invalid_requests_count_against_the_network(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    configure(settings, rate_limit=(100, 3600), network_rate_limit=(5, 3600))

    invalid = [
        await post_quote({"persona": "nobody"}, client=(f"198.51.100.{n}", 40000)) for n in range(1, 9)
    ]
    valid = await post_quote(body("rain"), client=("198.51.100.77", 40000))

    assert [answer.status for answer in invalid] == [404] * 5 + [429] * 3
    assert "network" in invalid[-1].json()["error"]["message"]
    assert valid.status == 429
    assert fake.requests == []


async def test_abuse_websocket_bad_frames_and_failed_resumes_count(
    persona: Persona, fake: FakeWorkersAI, settings: Any
) -> None:
    from config.asgi import application

    configure(settings, rate_limit=(3, 3600))
    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    assert (await socket.connect())[0]
    unknown = f"00000000-0000-4000-8000-000000000000.{'0' * 16}:1"
    codes = []
    for frame in ("{not json", '{"type": "nope"}', json.dumps({"type": "resume", "last_event_id": unknown})):
        await socket.send_to(text_data=frame)
        codes.append((await socket.receive_json_from(timeout=10))["code"])
    await socket.send_json_to({"type": "start", "persona": persona.slug})
    start = await socket.receive_json_from(timeout=10)
    await socket.disconnect()

    assert (start["type"], start.get("code")) == ("error", "rate_limited")
    assert codes == ["invalid_json", "invalid_frame", "resume_unavailable"]
    assert fake.requests == []


@pytest.mark.parametrize("action", ["stop", "share"])
async def test_abuse_share_and_stop_are_rate_limited(persona: Persona, settings: Any, action: str) -> None:
    """Each random id cost an UPDATE and an EXISTS (share) or two cache reads (stop), unlimited."""
    configure(settings, feedback_rate_limit=(2, 3600))
    csrf = {"cookie": f"csrftoken={CSRF}", "x-csrftoken": CSRF}

    answers = [await request("POST", f"/api/quotes/{uuid.uuid4()}/{action}", headers=csrf) for _ in range(3)]

    assert [answer.status for answer in answers] == [404, 404, 429]
    assert answers[-1].json()["error"]["code"] == "rate_limited"
    assert int(answers[-1].headers["retry-after"]) > 0
