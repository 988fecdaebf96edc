"""A finished quote's permalink page (with Open Graph tags), and what a visitor does with a quote:
share it, rate it, stop it. Each action is a POST-only JSON endpoint: another site's page is
refused first (403), then the method, then the body's type, then the client's budget counts."""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from quotes.models import Generation, Persona, Vote
from tests.asgi import request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

TEXT = '\nThe rain does not <hurry> & "still" arrives.'
LLAMA = "@cf/meta/llama-3.1-8b-instruct-fp8"


def make_generation(persona: Persona, **fields: object) -> Generation:
    values = {"persona": persona, "backend": "workers-ai", "model": LLAMA, "text": TEXT, "status": "ok"}
    return Generation.objects.create(**(values | fields))


class MetaTags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "meta" and (key := found.get("property") or found.get("name")):
            self.tags[key] = found.get("content") or ""


def test_permalink_page_shows_the_quote_with_open_graph_tags(persona: Persona, client: Client) -> None:
    generation = make_generation(persona)

    response = client.get(f"/q/{generation.public_id}/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "The rain does not &lt;hurry&gt; &amp; &quot;still&quot; arrives." in html and "Alan Watts" in html
    assert 'href="https://developers.cloudflare.com/workers-ai/models/llama-3.1-8b-instruct-fp8/"' in html
    assert f'datetime="{generation.created_at.isoformat()}"'[:30] in html
    parser = MetaTags()
    parser.feed(html)
    tags = parser.tags
    assert (tags["og:type"], tags["og:url"]) == ("article", f"http://testserver/q/{generation.public_id}/")
    assert tags["og:description"] == tags["twitter:description"] == TEXT.strip()
    assert "Alan Watts" in tags["og:title"] and tags["twitter:card"] == "summary"


@pytest.mark.parametrize("fields", [{"status": "cancelled"}, {"status": "error"}, {"is_preview": True}, None])
def test_permalink_and_share_are_404_for_no_finished_quote(persona: Any, client: Client, fields: Any) -> None:
    public_id = make_generation(persona, **fields).public_id if fields is not None else uuid.uuid4()

    page, share = client.get(f"/q/{public_id}/"), client.post(f"/api/quotes/{public_id}/share")

    assert page.status_code == 404 and b"Persona Quotes" in page.content
    assert share.status_code == 404 and share.json()["error"]["code"] == "unknown_quote"
    assert not Generation.objects.filter(shared_at__isnull=False).exists()


def test_share_needs_the_pages_csrf_token_and_a_post(persona: Persona) -> None:
    """The persona page's Permalink and Copy buttons post its CSRF token to share a quote;
    without it (another site's form, a bot) nothing is kept, and a JSON client is told why."""
    generation = make_generation(persona)
    browser, url = Client(enforce_csrf_checks=True), f"/api/quotes/{generation.public_id}/share"
    page = browser.get(f"/personas/{persona.slug}/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token, page[:300]

    forged = browser.post(url, headers={"accept": "application/json"})
    wrong_method = browser.get(url, headers={"x-csrftoken": token[1]})
    generation.refresh_from_db()
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "csrf_failed"
    assert wrong_method.status_code == 405 and wrong_method["Allow"] == "POST"
    assert generation.shared_at is None

    shared = browser.post(url, headers={"x-csrftoken": token[1], "accept": "application/json"})

    permalink = f"/q/{generation.public_id}/"
    assert shared.status_code == 200
    assert shared.json() == {"id": str(generation.public_id), "shared": True, "permalink": permalink}
    generation.refresh_from_db()
    assert generation.shared_at is not None


async def act(action: str, quote: Any, body: Any = None, ip: str = "198.51.100.1", **headers: str) -> Any:
    """A visitor at `ip` POSTs `action` on the quote `quote` (with `body` as JSON, if any)."""
    raw = b"" if body is None else json.dumps(body).encode()
    headers = ({"content-type": "application/json"} if body is not None else {}) | headers
    url = f"/api/quotes/{quote}/{action}"
    return await request("POST", url, body=raw, headers=headers, client=(ip, 5000))


@pytest.mark.services
@pytest.mark.parametrize("action", ["feedback", "stop"])
async def test_quote_actions_refuse_another_sites_page_then_the_method_then_count(
    persona: Persona, settings: Any, action: str
) -> None:
    settings.QUOTES_FEEDBACK_RATE_LIMIT = "2/hour"
    quote, body = uuid.uuid4(), {"value": 1} if action == "feedback" else None
    url, cross = f"/api/quotes/{quote}/{action}", {"sec-fetch-site": "cross-site"}

    elsewhere = [await act(action, quote, body, **cross) for _ in range(3)]
    elsewhere.append(await request("GET", url, headers=cross))
    wrong_method = await request("GET", url, client=("198.51.100.1", 5000))
    counted = [await act(action, quote, body) for _ in range(3)]
    other = await act(*(("stop", quote) if action == "feedback" else ("feedback", quote, {"value": 1})))

    assert {(r.status, r.json()["error"]["code"]) for r in elsewhere} == {(403, "cross_site")}
    assert (wrong_method.status, wrong_method.headers["allow"]) == (405, "POST")
    assert [r.status for r in counted] == [404, 404, 429]  # the refusals elsewhere cost nothing
    assert counted[2].json()["error"]["code"] == "rate_limited"
    assert 1 <= int(counted[2].headers["retry-after"]) <= 3600
    assert other.status == 404  # each action has a budget of its own


async def test_feedback_is_stored_checked_and_refused_for_what_cannot_be_rated(persona: Persona) -> None:
    generation, cancelled, old = [
        await Generation.objects.acreate(persona=persona, backend="local", model="m", status=status)
        for status in ("ok", "cancelled", "ok")
    ]
    await Generation.objects.filter(pk=old.pk).aupdate(created_at=timezone.now() - timedelta(days=2))
    quote = generation.public_id

    for body in ({"value": 2}, {"value": 0}, {"value": True}, {"value": "1"}, {}, [1]):
        response = await act("feedback", quote, body)
        assert (response.status, response.json()["error"]["code"][:7]) == (400, "invalid")
    assert (await act("feedback", quote, {"value": 1}, **{"content-type": "text/plain"})).status == 415
    await generation.arefresh_from_db()
    assert generation.feedback is None

    for value in (1, 1, -1):  # idempotent; a new value replaces it
        response = await act("feedback", quote, {"value": value})
        assert (response.status, response.json()) == (200, {"id": str(quote), "feedback": value})
    await generation.arefresh_from_db()
    assert generation.feedback == -1
    assert (await act("feedback", uuid.uuid4(), {"value": 1})).status == 404
    assert (await act("feedback", cancelled.public_id, {"value": 1})).status == 409
    closed = await act("feedback", old.public_id, {"value": 1})
    assert (closed.status, closed.json()["error"]["code"]) == (403, "feedback_closed")


@pytest.mark.services
async def test_feedback_one_vote_per_client_and_the_verdict_is_their_sum(persona: Persona) -> None:
    generation = await Generation.objects.acreate(persona=persona, backend="local", model="m", status="ok")
    quote = generation.public_id

    async def verdict() -> tuple[list[int], int | None]:
        await generation.arefresh_from_db()
        votes = [vote.value async for vote in Vote.objects.filter(generation=generation)]
        return sorted(votes), generation.feedback

    for _ in range(3):  # stuffing from one client adds nothing
        assert (await act("feedback", quote, {"value": 1}, "198.51.100.1")).status == 200
    for n in range(1, 4):  # nor from one IPv6 /64
        assert (await act("feedback", quote, {"value": 1}, f"2001:db8:7:7::{n}")).status == 200
    assert await verdict() == ([1, 1], 1)
    # Two visitors disagree: one vote each, the verdict cancels out instead of flipping.
    await act("feedback", quote, {"value": -1}, "198.51.100.2")
    await act("feedback", quote, {"value": -1}, "198.51.100.3")
    assert await verdict() == ([-1, -1, 1, 1], None)
    # A visitor may change their own vote, and only theirs.
    await act("feedback", quote, {"value": -1}, "198.51.100.1")
    assert await verdict() == ([-1, -1, -1, 1], -1)
