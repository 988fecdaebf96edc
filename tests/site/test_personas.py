"""The seeded personas, and the process's memory of personas (quotes.personas), which must follow
every change an editor makes, here or in another process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection, connections

from harness.workers_ai import FakeWorkersAI
from quotes import personas
from quotes.models import Persona
from tests.asgi import post_quote


@pytest.mark.integration
@pytest.mark.django_db
def test_seeded_personas_include_the_original_demo_and_all_validate() -> None:
    watts = Persona.objects.get(slug="alan-watts")
    assert watts.system_prompt == "You are Alan Watts"
    prompt = "Write 1 inspiring quote that is less than 50 words about {} as if you were Alan Watts"
    assert watts.user_prompt(watts.default_topic) == prompt.format("hard honest work")
    assert Persona.objects.active().count() >= 4
    for persona in Persona.objects.all():
        persona.full_clean()


@pytest.fixture
async def fake(fake: FakeWorkersAI, workers_ai_settings: Any) -> FakeWorkersAI:
    workers_ai_settings.QUOTES_CACHE_TTL = 0  # every quote asks the model
    return fake


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.django_db(transaction=True)
async def test_persona_memory_follows_saves_updates_and_deactivation(persona: Persona, fake: Any) -> None:
    assert (await post_quote()).status == 200
    persona.system_prompt = "You are Alan Watts, whispering"
    await persona.asave()
    await post_quote()
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=7)
    await post_quote()
    persona.is_active = False
    await persona.asave()
    gone = await post_quote()

    sent = [request.json for request in fake.requests]
    assert sent[1]["messages"][0]["content"] == "You are Alan Watts, whispering"
    assert sent[2]["max_tokens"] == 7
    assert gone.status == 404 and len(sent) == 3


def _update_behind_this_processs_back(pk: int, prompt: str) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE quotes_persona SET system_prompt = %s WHERE id = %s", [prompt, pk])
    finally:
        connections.close_all()


@pytest.mark.system
@pytest.mark.django_db(transaction=True)
async def test_persona_memory_follows_another_processs_change(
    persona: Any, fake: Any, redis_cache: Any
) -> None:
    """Another process's save changes the row and replaces the version value in Redis: this
    process, whose memory still holds the old persona, notices on its next request."""
    await post_quote()
    await asyncio.to_thread(_update_behind_this_processs_back, persona.pk, "You are somebody else")
    await post_quote()
    assert fake.requests[-1].json["messages"][0]["content"] == "You are Alan Watts"  # nobody said so yet
    await asyncio.to_thread(cache.set, personas.VERSION_KEY, "another process's value", None)

    await post_quote()

    assert fake.requests[-1].json["messages"][0]["content"] == "You are somebody else"
