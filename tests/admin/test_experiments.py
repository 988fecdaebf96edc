"""Persona experiments (issue 42): a draft version saved from the form without going live, tried
on a share of readers (each keeps one arm), recorded on the rows, compared arm by arm, then
promoted or ended: the admin's forms through Django's test client, the stream through the ASGI
app against the fake Workers AI."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes import services
from quotes.admin import analytics
from quotes.models import Experiment, Generation, Persona, PersonaVersion, Vote
from tests.admin.test_admin import CHANGE, VERSIONS, form_data, logged_in
from tests.asgi import post_quote
from tests.fixtures import saved

pytestmark = pytest.mark.integration

MODEL = "@cf/meta/llama-3.1-8b-instruct-fp8"
DRAFT_PROMPT = "You are Alan Watts, on a rainy afternoon."


def readers(count: int) -> list[str]:
    return [f"reader-{n}" for n in range(count)]


@pytest.mark.django_db
def test_a_reader_keeps_one_arm_and_readers_spread_as_the_share_says(persona: Persona) -> None:
    draft = services.persona_save_draft(persona=persona)
    for share in (10, 50, 90):
        experiment = services.experiment_start(persona=persona, draft=draft, share=share, user=None)
        arms = [experiment.arm_of(r) for r in readers(2000)]
        assert arms == [experiment.arm_of(r) for r in readers(2000)]  # the same reader, the same arm
        assert abs(arms.count(Experiment.DRAFT) / 2000 - share / 100) < 0.04
        services.experiment_finish(experiment=experiment, promote=False, user=None)


@pytest.mark.django_db
def test_a_draft_leaves_the_live_version_and_one_experiment_runs_at_a_time(persona: Persona) -> None:
    live = persona.versions.get()
    persona.system_prompt = DRAFT_PROMPT
    draft = services.persona_save_draft(persona=persona, note="rain")
    persona.refresh_from_db()
    assert persona.system_prompt != DRAFT_PROMPT and draft.is_draft and draft.number == live.number + 1
    assert draft.config["system_prompt"] == DRAFT_PROMPT
    # A later live save compares with the live version, not the draft; it numbers after the draft.
    persona.max_tokens = 12
    assert services.persona_save(persona=persona).number == draft.number + 1  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="Only a draft"):
        services.experiment_start(persona=persona, draft=live, share=50, user=None)
    for share in (0, 100):
        with pytest.raises(ValidationError):
            services.experiment_start(persona=persona, draft=draft, share=share, user=None)
    experiment = services.experiment_start(persona=persona, draft=draft, share=30, user=None)
    with pytest.raises(ValidationError, match="already running"):
        services.experiment_start(persona=persona, draft=draft, share=30, user=None)
    new = services.experiment_finish(experiment=experiment, promote=True, user=None)
    persona.refresh_from_db()
    assert new is not None and not new.is_draft and persona.system_prompt == DRAFT_PROMPT
    assert persona.max_tokens == draft.config["max_tokens"]  # the draft's whole settings
    experiment.refresh_from_db()
    assert experiment.outcome == Experiment.Outcome.PROMOTED and experiment.ended_at is not None
    with pytest.raises(ValidationError, match="ended already"):
        services.experiment_finish(experiment=experiment, promote=False, user=None)


@pytest.mark.django_db(transaction=True)
async def test_readers_get_their_arm_the_row_records_it_and_the_cache_keeps_arms_apart(
    fake: FakeWorkersAI, persona: Persona, unlimited: Any
) -> None:
    settings = unlimited
    settings.QUOTES_CACHE_TTL = 3600
    await saved(persona, model=MODEL)
    persona.system_prompt = DRAFT_PROMPT
    draft = await sync_to_async(services.persona_save_draft)(persona=persona)
    experiment = await sync_to_async(services.experiment_start)(
        persona=persona, draft=draft, share=50, user=None
    )
    fake.default = Scenario(tokens=["Rain"])

    async def quote(reader: str) -> tuple[str, str]:
        """The reader's quote as a browser asks it: the arm its row records, the prompt sent."""
        response = await post_quote(headers={"cookie": f"csrftoken={reader:0>32}"})
        assert response.status == 200
        row = await Generation.objects.select_related("persona_version").alatest("created_at")
        assert row.experiment_id == experiment.pk
        assert (row.persona_version == draft) == (row.arm == Experiment.DRAFT)
        sent = fake.requests[-1].json["messages"][0]["content"] if row.cache_status != "hit" else ""
        return row.arm, sent

    arms = {}
    for n in range(12):
        reader = f"r{n}"
        arm, sent = await quote(reader)
        assert sent in ("", DRAFT_PROMPT if arm == Experiment.DRAFT else "You are Alan Watts")
        arms[reader] = arm
        assert (await quote(reader))[0] == arm  # the same reader, the same arm (and a cache hit)
    assert set(arms.values()) == {Experiment.LIVE, Experiment.DRAFT}
    # One upstream call per arm: each arm's answer is cached apart from the other's.
    assert len(fake.requests) == 2
    assert {r.json["messages"][0]["content"] for r in fake.requests} == {DRAFT_PROMPT, "You are Alan Watts"}


@pytest.mark.django_db
def test_the_report_sets_the_arms_side_by_side_with_votes_and_an_interval(persona: Persona) -> None:
    draft = services.persona_save_draft(persona=persona)
    experiment = services.experiment_start(persona=persona, draft=draft, share=50, user=None)

    def quote(arm: str, votes: list[int], **fields: Any) -> None:
        values = {"persona": persona, "experiment": experiment, "arm": arm, "backend": "local", "model": "m"}
        row = Generation.objects.create(**{**values, "status": "ok", **fields})
        for n, value in enumerate(votes):
            Vote.objects.create(generation=row, client_key=f"ip:{n}", value=value)

    quote("live", [1, -1, -1], ttft_ms=100, completion_tokens=10)
    quote("live", [-1], ttft_ms=300, completion_tokens=20)
    quote("draft", [1, 1, 1], ttft_ms=50, completion_tokens=30)
    quote("draft", [], status="error")
    live, drafted = analytics.experiment_report(experiment).arms
    assert (live.name, live.quotes, live.up, live.down, live.errors) == ("live", 2, 1, 3, 0)
    assert (drafted.name, drafted.quotes, drafted.up, drafted.down, drafted.errors) == ("draft", 1, 3, 0, 1)
    assert (live.ttft_p50_ms, live.mean_tokens, drafted.version) == (200, 15, draft)
    low, high = live.up_interval  # type: ignore[misc]
    assert low < 0.25 < high and low >= 0 and high <= 1
    assert drafted.error_rate == 0.5 and analytics.wilson(0, 0) is None


@pytest.mark.django_db
def test_the_admin_saves_a_draft_starts_promotes_and_refuses_bad_input(admin_user: User) -> None:
    client = logged_in(admin_user)
    persona = Persona.objects.get(slug="alan-watts")
    live_prompt = persona.system_prompt
    response = client.post(
        CHANGE.format(pk=persona.pk),
        form_data(persona, system_prompt=DRAFT_PROMPT, _savedraft="Save as draft"),
    )
    draft = PersonaVersion.objects.filter(persona=persona, is_draft=True).get()
    assert response.status_code == 302 and response["Location"].endswith(f"#v{draft.number}")
    persona.refresh_from_db()
    assert persona.system_prompt == live_prompt and draft.config["system_prompt"] == DRAFT_PROMPT
    page = client.get(VERSIONS.format(pk=persona.pk)).content.decode()
    assert f'data-testid="start-{draft.number}"' in page and "draft</span>" in page
    assert "Make this draft live" in page  # no experiment: a draft can also go live at once

    start = f"/admin/quotes/persona/{persona.pk}/experiments/start/"
    assert client.post(start, {"number": "v1", "share": "50"}).status_code == 404
    assert client.post(start, {"number": "999", "share": "50"}).status_code == 404
    assert client.get(start).status_code == 405
    for share in ("", "half", "0", "100"):
        response = client.post(start, {"number": draft.number, "share": share}, follow=True)
        assert "Cannot start the experiment" in response.content.decode()
    assert not Experiment.objects.exists()
    response = client.post(start, {"number": draft.number, "share": "50"}, follow=True)
    experiment = Experiment.objects.get()
    assert experiment.share == 50 and "now goes to 50%" in response.content.decode()
    page = client.get(VERSIONS.format(pk=persona.pk)).content.decode()
    assert 'data-testid="arm-draft"' in page and f'data-testid="start-{draft.number}"' not in page
    assert "Make this draft live" not in page  # while it is tried: Promote, or End
    assert 'data-testid="arm-draft"' in client.get("/admin/quotes/generation/analytics/").content.decode()

    finish = f"/admin/quotes/persona/{persona.pk}/experiments/{experiment.pk}/finish/"
    response = client.post(finish, {"action": "promote"}, follow=True)
    assert "every reader gets it now" in response.content.decode()
    persona.refresh_from_db()
    assert persona.system_prompt == DRAFT_PROMPT
    response = client.post(finish, {"action": "end"}, follow=True)
    assert "ended already" in response.content.decode()
    assert client.post(f"/admin/quotes/persona/{persona.pk}/experiments/999/finish/").status_code == 404
