"""Issue 20, points 5 and 6, through the stream endpoint of the real ASGI app (the upstream is the
fake Workers AI on 127.0.0.1):

- a second, coarser rate limit per network (an IPv6 /48, an IPv4 /24) with its own higher budget,
  so that whoever holds a /48 does not get 65,536 clients' budgets;
- invalid requests (an unknown persona, bad JSON) count against the client's rate limit, and an
  unknown slug is remembered briefly instead of costing a database query each time.
"""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from quotes.models import Persona
from quotes.services import persona_save
from tests.asgi import post_quote
from tests.fakes.workers_ai import FakeWorkersAI
from tests.limits import configure

pytestmark = pytest.mark.django_db(transaction=True)


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
    # The persona appears behind the ORM's back (no signal): the miss is still remembered, so the
    # second request costs no query and still answers 404...
    await sync_to_async(rename_behind_the_orm)(persona.slug, "ghost")
    remembered = await post_quote({"persona": "ghost"})
    # ...until persona data changes through the app (an editor's save), which forgets misses.
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
