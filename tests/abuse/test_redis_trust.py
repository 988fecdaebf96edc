"""What Redis holds is data, never code (issue 29, points 1 and 4), through the real ASGI app on a
real Redis, the upstream being the fake Workers AI server:

- Django's cache on Redis keeps JSON, not pickle: a pickle written at the app's keys runs nothing,
  and a value of the wrong shape is a miss (logged), never a 500;
- a live run's Redis Stream entry of the wrong shape is a lost run: no 500, no forged header;
- with Redis down, invalid requests still get their 4xx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.cache import cache

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import reset_backends
from quotes.ai.gateway import runs as runs_module
from quotes.ai.gateway import shared_runs
from quotes.ai.gateway.runs import resume_key
from quotes.models import Generation, Persona
from quotes.personas import VERSION_KEY
from tests.abuse.test_redis_limits import logged
from tests.asgi import request
from tests.redis_server import REDIS_CACHE_BACKEND

SSE = {"accept": "text/event-stream"}

pytestmark = pytest.mark.django_db(transaction=True)

STREAM_URL = "/api/quotes/stream"
TOKENS = ["Rain ", "falls ", "on ", "all."]


@pytest.fixture
async def fake(workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI) -> AsyncIterator[FakeWorkersAI]:
    fake_workers_ai.script(Scenario(tokens=TOKENS))
    yield fake_workers_ai
    await reset_backends()


class Exploit:
    """A pickle that, loaded, runs a shell command (creates `marker`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def pickled(marker: Path) -> bytes:
    return pickle.dumps(Exploit(marker))


async def ended(generation_id: str) -> None:
    """Wait until the run has ended (its finished events are in the cache)."""
    for _ in range(250):
        if generation_id not in runs_module.runs:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {generation_id} did not end")


async def quote(persona: Persona, **headers: str) -> Any:
    return await request(
        "POST", STREAM_URL, json_body={"persona": persona.slug, "topic": "rain"}, headers=headers
    )


@pytest.mark.system
async def test_redis_pickles_at_the_apps_keys_run_nothing_and_the_requests_are_served(
    persona: Persona, fake: FakeWorkersAI, redis_cache: redis.Redis, tmp_path: Path
) -> None:
    """The issue's repro: every value the app wrote to the cache replaced by a pickle whose
    __reduce__ runs a command, then a persona page, a stream and a resume: the command never runs,
    each request is answered (a value that is not JSON is a miss), with a WARNING, no traceback."""
    first = await quote(persona)
    generation_id = first.headers["x-generation-id"]
    await ended(generation_id)
    cache.set(VERSION_KEY, uuid.uuid4().hex)
    keys = {key.decode(): redis_cache.get(key) for key in redis_cache.scan_iter()}
    assert any(":quotes:answer:" in key for key in keys) and any(":quotes:run:" in key for key in keys)
    # As the app wrote them: JSON (or a Redis integer, a counter), never pickle.
    assert all(json.loads(value) is not None for value in keys.values()), keys
    marker = tmp_path / "ran"
    kept = [key for key, value in keys.items() if not value.isdigit()]  # the counters are INCR'd
    for key in kept:
        redis_cache.set(key, pickled(marker))

    with logged("quotes", "django") as records:
        page = await request("GET", f"/personas/{persona.slug}/")
        again = await quote(persona)
        resumed = await request(
            "GET",
            STREAM_URL,
            query=f"last_event_id={generation_id}.{resume_key(generation_id)}:1",
            headers=SSE,
        )
        # A counter that is not a number: Redis refuses to count it, as an outage would.
        for key in keys.keys() - kept:
            redis_cache.set(key, pickled(marker))
        counted = await quote(persona)

    assert not marker.exists()
    assert page.status == 200 and persona.name in page.body.decode()
    assert again.status == 200 and again.body.endswith(b"data: [DONE]\n\n")
    assert len(fake.requests) >= 2  # the cached answer read as a miss: asked again
    assert (resumed.status, resumed.json()["error"]["code"]) == (404, "resume_unavailable")
    assert counted.status == 200 and counted.body.endswith(b"data: [DONE]\n\n")
    warnings = {
        r.getMessage() for r in records if r.levelno == logging.WARNING and r.name == "quotes.ai.cache"
    }
    assert warnings == {"a value in the cache is not JSON: read as a miss"}, [r.getMessage() for r in records]
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in records
    ]


@pytest.mark.system
async def test_redis_cache_values_of_the_wrong_shape_are_misses(
    persona: Persona, fake: FakeWorkersAI, redis_cache: redis.Redis
) -> None:
    """JSON of another shape at the answer's and the finished run's keys: a miss each, logged
    once, where the old code answered 500 (a KeyError) or served whatever was there."""
    first = await quote(persona)
    generation_id = first.headers["x-generation-id"]
    await ended(generation_id)
    [answer_key] = redis_cache.scan_iter(match="*quotes:answer:*")
    [run_key] = redis_cache.scan_iter(match="*quotes:run:*")
    redis_cache.set(answer_key, json.dumps({"model": "m\r\nSet-Cookie: a=b", "step": 0}))
    redis_cache.set(run_key, json.dumps({"client": "x", "events": [{"meta": {"model": 1}}]}))

    with logged("quotes", "django") as records:
        again = await quote(persona)
        resumed = await request(
            "GET",
            STREAM_URL,
            query=f"last_event_id={generation_id}.{resume_key(generation_id)}:1",
            headers=SSE,
        )

    assert again.status == 200 and again.body.endswith(b"data: [DONE]\n\n")
    assert "set-cookie" not in again.headers and len(fake.requests) == 2
    assert resumed.status == 404
    warnings = [
        r.getMessage() for r in records if r.levelno == logging.WARNING and r.name == "quotes.ai.cache"
    ]
    assert warnings == [
        "an answer in the cache has an unexpected shape: read as a miss",
        "a finished generation in the cache has an unexpected shape: read as a miss",
    ]
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in records
    ]


META = {"model": "m", "headers": {}, "step": None, "cache_status": None, "generation_id": None}
FACTS = {
    "persona_id": 1,
    "persona_version_id": None,
    "backend": "workers-ai",
    "model": "m",
    "topic": "rain",
    "client_hash": "h",
    "is_preview": False,
}


def entry(meta: dict[str, Any] = META, token: str = "forged ") -> list[Any]:
    return [{"meta": meta}, token, {"done": None}]


@pytest.mark.parametrize(
    ("events", "facts"),
    [
        (entry({**META, "model": "m\r\nSet-Cookie: session=forged"}), FACTS),  # a header split
        (entry({**META, "headers": {"set-cookie": "session=forged"}}), FACTS),  # not an upstream's
        (entry({**META, "admin": True}), FACTS),  # a field Meta does not have
        (entry({**META, "generation_id": "../../admin"}), FACTS),  # not an id: a permalink from it
        (entry(token="\ud800"), FACTS),  # a lone surrogate (a \u escape): no response encodes it
        (entry(), {**FACTS, "is_staff": True}),  # a field a row must not get
        (entry(), {**FACTS, "persona_id": "1 OR 1=1"}),
    ],
    ids=[
        "split-header",
        "foreign-header",
        "unknown-field",
        "bad-id",
        "surrogate",
        "unknown-fact",
        "fact-type",
    ],
)
@pytest.mark.system
async def test_redis_stream_entry_of_the_wrong_shape_is_a_lost_run(
    persona: Persona,
    fake: FakeWorkersAI,
    redis_cache: redis.Redis,
    settings: Any,
    redis_server: str,
    events: list[Any],
    facts: dict[str, Any],
) -> None:
    """A run's stream in Redis with a Meta or facts the app never writes: a resume reads it as
    missing (404), logged; no 500, no forged header, no row from forged facts."""
    settings.REDIS_URL = redis_server
    public_id = str(uuid.uuid4())
    data = json.dumps(events)
    redis_cache.xadd(shared_runs.stream_key(public_id), {"i": 0, "d": data, "r": json.dumps(facts), "c": "x"})
    redis_cache.set(shared_runs.owner_key(public_id), "elsewhere", px=2000)

    with logged("quotes", "django") as records:
        resumed = await request(
            "GET", STREAM_URL, query=f"last_event_id={public_id}.{resume_key(public_id)}:1", headers=SSE
        )

    assert (resumed.status, resumed.json()["error"]["code"]) == (404, "resume_unavailable")
    assert "set-cookie" not in resumed.headers
    assert [
        r.getMessage() for r in records if r.levelno == logging.WARNING and r.name.endswith("shared_runs")
    ] == [f"run {public_id}'s stream in Redis holds an entry this app did not write: read as lost"]
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in records
    ]
    assert not await Generation.objects.filter(public_id=public_id).aexists()


@pytest.mark.system
async def test_redis_down_invalid_requests_still_get_their_4xx(
    persona: Persona, fake: FakeWorkersAI, settings: Any, closed_port: int
) -> None:
    """Redis down (REDIS_URL and the cache on a port that refuses): an unknown persona, a broken
    JSON body and feedback on an unknown quote each get their own 4xx, counted on this
    process's own limits, where the old code answered 500 with a traceback."""
    url = f"redis://127.0.0.1:{closed_port}/0"
    settings.REDIS_URL = url
    settings.CACHES = {
        "default": {"BACKEND": REDIS_CACHE_BACKEND, "LOCATION": url, "OPTIONS": settings.REDIS_OPTIONS}
    }

    with logged("quotes", "django") as records:
        unknown = await request("POST", STREAM_URL, json_body={"persona": "nobody-here"})
        broken = await request(
            "POST", STREAM_URL, body=b"{not json", headers={"content-type": "application/json"}
        )
        feedback = await request("POST", f"/api/quotes/{uuid.uuid4()}/feedback", json_body={"value": 1})

    assert (unknown.status, unknown.json()["error"]["code"]) == (404, "unknown_persona")
    assert broken.status == 400
    assert (feedback.status, feedback.json()["error"]["code"]) == (404, "unknown_quote")
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in records
    ]


@pytest.mark.system
async def test_redis_down_refused_starts_are_limited_per_process(
    persona: Persona, fake: FakeWorkersAI, settings: Any, closed_port: int
) -> None:
    """While Redis is down the refused starts still count, in this process: over the limit, a 429."""
    url = f"redis://127.0.0.1:{closed_port}/0"
    settings.REDIS_URL = url
    settings.CACHES = {
        "default": {"BACKEND": REDIS_CACHE_BACKEND, "LOCATION": url, "OPTIONS": settings.REDIS_OPTIONS}
    }
    settings.QUOTES_GATEWAY = replace(settings.QUOTES_GATEWAY, rate_limit=(2, 60))

    answers = [await request("POST", STREAM_URL, json_body={"persona": "nobody-here"}) for _ in range(3)]

    assert [answer.status for answer in answers] == [404, 404, 429]


@pytest.mark.integration
async def test_in_memory_cache_keeps_the_same_json_shapes(persona: Persona, fake: FakeWorkersAI) -> None:
    """Without Redis (the in-memory cache, which pickles in-process) the app keeps the same JSON
    values, so both caches behave alike: a finished run reads back as it was written."""
    first = await quote(persona)
    generation_id = first.headers["x-generation-id"]
    await ended(generation_id)

    kept = cache.get(runs_module.finished_key(generation_id))

    assert kept == json.loads(json.dumps(kept)) and kept["events"][-1] == {"done": None}
