"""A finished quote's permalink page (with Open Graph tags), and the share and feedback endpoints."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from quotes.models import Generation, Persona, Vote
from tests.asgi import StreamedResponse, request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


def make_generation(persona: Persona, **fields: object) -> Generation:
    values: dict[str, object] = {
        "persona": persona,
        "backend": "workers-ai",
        "model": "@cf/meta/llama-3.1-8b-instruct",
        "status": Generation.Status.OK,
        "text": '\nThe rain does not <hurry> & "still" arrives.',
        **fields,
    }
    return Generation.objects.create(**values)


class MetaTags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        key = found.get("property") or found.get("name")
        if tag == "meta" and key:
            self.tags[key] = found.get("content") or ""


def test_permalink_page_shows_the_quote_with_open_graph_tags(persona: Persona, client: Client) -> None:
    generation = make_generation(persona)

    response = client.get(f"/q/{generation.public_id}/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "The rain does not &lt;hurry&gt; &amp; &quot;still&quot; arrives." in html
    assert "Alan Watts" in html
    assert 'href="https://developers.cloudflare.com/workers-ai/models/llama-3.1-8b-instruct/"' in html
    assert f'datetime="{generation.created_at.isoformat()}"'[:30] in html
    parser = MetaTags()
    parser.feed(html)
    tags = parser.tags
    assert tags["og:type"] == "article"
    assert tags["og:url"] == f"http://testserver/q/{generation.public_id}/"
    assert tags["og:description"] == 'The rain does not <hurry> & "still" arrives.'
    assert "Alan Watts" in tags["og:title"]
    assert tags["twitter:card"] == "summary"
    assert tags["twitter:description"] == tags["og:description"]


@pytest.mark.parametrize(
    "fields",
    [{"status": Generation.Status.CANCELLED}, {"status": Generation.Status.ERROR}, {"is_preview": True}],
)
def test_permalink_page_is_404_for_unfinished_or_preview_quotes(
    persona: Persona, client: Client, fields: dict[str, object]
) -> None:
    generation = make_generation(persona, **fields)
    assert client.get(f"/q/{generation.public_id}/").status_code == 404
    assert client.get(f"/q/{uuid.uuid4()}/").status_code == 404


def test_share_needs_the_pages_csrf_token_and_keeps_the_quote(persona: Persona) -> None:
    """The persona page's Permalink and Copy buttons post its CSRF token to share a quote;
    without it (another site's form, a bot) nothing is kept, and a JSON client is told why."""
    generation = make_generation(persona)
    browser = Client(enforce_csrf_checks=True)
    share_url = f"/api/quotes/{generation.public_id}/share"

    page = browser.get(f"/personas/{persona.slug}/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token, page.content[:300]
    assert 'data-share-url="/api/quotes/{id}/share"' in page.content.decode()
    forged = browser.post(share_url, headers={"accept": "application/json"})
    generation.refresh_from_db()
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "csrf_failed"
    assert generation.shared_at is None

    shared = browser.post(share_url, headers={"x-csrftoken": token[1], "accept": "application/json"})

    assert shared.status_code == 200
    assert shared.json() == {
        "id": str(generation.public_id),
        "shared": True,
        "permalink": f"/q/{generation.public_id}/",
    }
    generation.refresh_from_db()
    assert generation.shared_at is not None


@pytest.mark.parametrize(
    "fields",
    [
        {"status": Generation.Status.CANCELLED},
        {"status": Generation.Status.ERROR},
        {"is_preview": True},
        None,
    ],
)
def test_share_is_404_for_what_has_no_permalink(
    persona: Persona, client: Client, fields: dict[str, object] | None
) -> None:
    public_id = make_generation(persona, **fields).public_id if fields is not None else uuid.uuid4()

    response = client.post(f"/api/quotes/{public_id}/share")

    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_quote"
    assert not Generation.objects.filter(shared_at__isnull=False).exists()


def test_share_takes_only_post(persona: Persona, client: Client) -> None:
    generation = make_generation(persona)

    response = client.get(f"/api/quotes/{generation.public_id}/share")

    assert response.status_code == 405 and response["Allow"] == "POST"
    generation.refresh_from_db()
    assert generation.shared_at is None


async def post_feedback(
    public_id: object, body: object, content_type: str = "application/json"
) -> tuple[int, dict]:
    response = await request(
        "POST",
        f"/api/quotes/{public_id}/feedback",
        body=json.dumps(body).encode(),
        headers={"content-type": content_type},
    )
    return response.status, response.json()


@pytest.mark.services
async def test_feedback_is_stored_and_idempotent(persona: Persona) -> None:
    generation = await Generation.objects.acreate(
        persona=persona, backend="local", model="gemma-3-270m", status="ok", text="Be."
    )

    assert await post_feedback(generation.public_id, {"value": 1}) == (
        200,
        {"id": str(generation.public_id), "feedback": 1},
    )
    assert (await post_feedback(generation.public_id, {"value": 1}))[0] == 200
    await generation.arefresh_from_db()
    assert generation.feedback == 1
    assert (await post_feedback(generation.public_id, {"value": -1}))[1]["feedback"] == -1
    await generation.arefresh_from_db()
    assert generation.feedback == -1


@pytest.mark.parametrize("body", [{"value": 2}, {"value": 0}, {"value": True}, {"value": "1"}, {}, [1]])
async def test_feedback_rejects_bad_values(persona: Persona, body: object) -> None:
    generation = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")
    status, payload = await post_feedback(generation.public_id, body)
    assert status == 400
    assert payload["error"]["code"] in ("invalid_feedback", "invalid_json")
    await generation.arefresh_from_db()
    assert generation.feedback is None


async def test_feedback_errors(persona: Persona) -> None:
    assert (await post_feedback(uuid.uuid4(), {"value": 1}))[0] == 404
    generation = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")
    assert (await post_feedback(generation.public_id, {"value": 1}, content_type="text/plain"))[0] == 415
    response = await request("GET", f"/api/quotes/{generation.public_id}/feedback")
    assert response.status == 405
    cancelled = await Generation.objects.acreate(
        persona=persona, backend="local", model="m", status="cancelled"
    )
    assert (await post_feedback(cancelled.public_id, {"value": 1}))[0] == 409
    old = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")
    await Generation.objects.filter(pk=old.pk).aupdate(created_at=timezone.now() - timedelta(days=2))
    status, payload = await post_feedback(old.public_id, {"value": 1})
    assert (status, payload["error"]["code"]) == (403, "feedback_closed")


# -- issue 13, point 5: one vote per client per quote, rate-limited ----------------------------------


async def vote(public_id: object, value: int, client: str) -> StreamedResponse:
    return await request(
        "POST",
        f"/api/quotes/{public_id}/feedback",
        body=json.dumps({"value": value}).encode(),
        headers={"content-type": "application/json"},
        client=(client, 5000),
    )


async def votes_of(generation: Generation) -> list[int]:
    return sorted([v.value async for v in Vote.objects.filter(generation=generation)])


@pytest.mark.services
async def test_feedback_one_vote_per_client_and_the_verdict_is_their_sum(persona: Persona) -> None:
    generation = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")

    for _ in range(5):  # stuffing from one client adds nothing
        assert (await vote(generation.public_id, 1, "198.51.100.1")).status == 200
    assert await votes_of(generation) == [1]
    await generation.arefresh_from_db()
    assert generation.feedback == 1

    # another visitor disagrees: one vote each, the verdict cancels out instead of flipping
    assert (await vote(generation.public_id, -1, "198.51.100.2")).json() == {
        "id": str(generation.public_id),
        "feedback": -1,
    }
    await generation.arefresh_from_db()
    assert (await votes_of(generation), generation.feedback) == ([-1, 1], None)

    await vote(generation.public_id, -1, "198.51.100.3")
    await generation.arefresh_from_db()
    assert generation.feedback == -1

    # a visitor may change their own vote, and only theirs
    await vote(generation.public_id, -1, "198.51.100.1")
    await vote(generation.public_id, 1, "198.51.100.3")
    await generation.arefresh_from_db()
    assert (await votes_of(generation), generation.feedback) == ([-1, -1, 1], -1)


async def test_feedback_addresses_in_one_ipv6_64_are_one_voter(persona: Persona) -> None:
    generation = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")

    for n in range(1, 6):
        assert (await vote(generation.public_id, 1, f"2001:db8:7:7::{n}")).status == 200

    assert await votes_of(generation) == [1]


@pytest.mark.services
async def test_feedback_is_rate_limited_per_client(persona: Persona, settings: Any) -> None:
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, feedback_rate_limit=(3, 3600))
    remaining = 3600 - time.time() % 3600
    if remaining < 5:  # fixed window: don't count across its edge
        await asyncio.sleep(remaining + 0.05)
    quotes = [
        await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")
        for _ in range(4)
    ]

    answers = [await vote(quote.public_id, 1, "198.51.100.9") for quote in quotes]
    other_client = await vote(quotes[3].public_id, 1, "198.51.100.10")

    assert [a.status for a in answers] == [200, 200, 200, 429]
    limited = answers[3]
    assert limited.json()["error"]["code"] == "rate_limited"
    assert "rated 3 quotes" in limited.json()["error"]["message"]
    assert 1 <= int(limited.headers["retry-after"]) <= 3600
    assert other_client.status == 200
    assert await Vote.objects.filter(generation=quotes[3]).acount() == 1  # the other client's
