"""Persona rules and the admin that edits them."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from quotes.models import Persona
from quotes.services import persona_delete, persona_save


def make_persona(**overrides: object) -> Persona:
    fields: dict[str, object] = {
        "slug": "p",
        "name": "P",
        "system_prompt": "You are P",
        "user_prompt_template": "Say something about {topic}",
        "default_topic": "tea",
        "model": "@cf/meta/llama-3.1-8b-instruct",
        "max_tokens": 96,
        "temperature": 0.7,
    }
    fields.update(overrides)
    return Persona(**fields)  # type: ignore[arg-type]


@pytest.mark.unit
def test_persona_valid_settings_pass() -> None:
    make_persona().full_clean(validate_unique=False)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"user_prompt_template": "About {subject}"}, "user_prompt_template"),
        ({"user_prompt_template": "About {topic"}, "user_prompt_template"),
        ({"model": "@cf/nobody/unknown-model"}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"temperature": 5.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"lora": "my-adapter"}, "lora"),  # llama-3.1-8b-instruct takes no adapter
    ],
)
def test_persona_rejects_bad_settings(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        make_persona(**overrides).full_clean(validate_unique=False)
    assert field in caught.value.message_dict


@pytest.mark.unit
def test_persona_lora_allowed_on_a_lora_model_and_sent_raw() -> None:
    persona = make_persona(model="@cf/google/gemma-2b-it-lora", lora="my-adapter")
    persona.full_clean(validate_unique=False)
    request = persona.build_request(topic="tea")
    assert request.lora == "my-adapter"


@pytest.mark.unit
def test_persona_user_prompt_keeps_braces_in_the_topic() -> None:
    assert make_persona().user_prompt("{topic} {x}") == "Say something about {topic} {x}"


@pytest.mark.integration
@pytest.mark.django_db
def test_seeded_personas_include_the_original_demo() -> None:
    watts = Persona.objects.get(slug="alan-watts")
    assert watts.system_prompt == "You are Alan Watts"
    assert watts.user_prompt(watts.default_topic) == (
        "Write 1 inspiring quote that is less than 50 words about hard honest work as if you were Alan Watts"
    )
    assert Persona.objects.active().count() >= 4
    for persona in Persona.objects.all():
        persona.full_clean()


@pytest.mark.integration
@pytest.mark.django_db
def test_admin_edits_personas_and_rejects_a_bad_template(admin_client: Client) -> None:
    watts = Persona.objects.get(slug="alan-watts")
    url = f"/admin/quotes/persona/{watts.pk}/change/"
    assert admin_client.get(url).status_code == 200
    form = {
        "name": watts.name,
        "slug": watts.slug,
        "description": watts.description,
        "system_prompt": watts.system_prompt,
        "user_prompt_template": "Tell me about {subject}",
        "default_topic": watts.default_topic,
        "model": watts.model,
        "lora": "",
        "max_tokens": 80,
        "temperature": 0.5,
        "is_active": "on",
        "display_order": 0,
    }
    response = admin_client.post(url, form)
    assert response.status_code == 200
    assert "Unknown variable {subject}" in response.content.decode()
    form["user_prompt_template"] = "Tell me about {topic}"
    response = admin_client.post(url, form)
    assert response.status_code == 302
    watts.refresh_from_db()
    assert (watts.user_prompt_template, watts.max_tokens) == ("Tell me about {topic}", 80)


@pytest.mark.integration
@pytest.mark.django_db
def test_admin_generation_log_is_read_only(admin_client: Client) -> None:
    assert admin_client.get("/admin/quotes/generation/").status_code == 200
    assert admin_client.get("/admin/quotes/generation/add/").status_code == 403


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.django_db
def test_persona_with_generations_is_deactivated_not_deleted() -> None:
    from quotes.models import Generation

    watts = Persona.objects.get(slug="alan-watts")
    Generation.objects.create(persona=watts, backend="local", model="gemma-3-270m", status="ok")
    assert persona_delete(persona=watts) is True
    watts.refresh_from_db()
    assert watts.is_active is False
    lonely = make_persona(slug="lonely")
    persona_save(persona=lonely)
    assert persona_delete(persona=lonely) is False
    assert not Persona.objects.filter(slug="lonely").exists()


@pytest.mark.integration
@pytest.mark.services
@pytest.mark.django_db
def test_persona_save_records_the_version_author_and_note(django_user_model: type) -> None:
    editor = django_user_model.objects.create_user("ed", password="x")
    persona = make_persona(slug="noted")
    version = persona_save(persona=persona, note="first draft", created_by=editor)
    assert version is not None
    assert (version.number, version.note) == (1, "first draft")
    assert version.created_by == editor
    persona.display_order = 5
    assert persona_save(persona=persona) is None  # nothing the model sees changed
