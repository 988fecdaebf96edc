"""The persona admin (validation, versions, roll-back, preview, deletion), the request log and
who may see what."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.test import Client
from django.utils.crypto import get_random_string

from quotes.models import Generation, Persona, PersonaVersion
from tests.asgi import parse_sse, request

pytestmark = pytest.mark.integration

CHANGE = "/admin/quotes/persona/{pk}/change/"
VERSIONS = "/admin/quotes/persona/{pk}/history-versions/"


def form_data(persona: Persona, **overrides: Any) -> dict[str, Any]:
    """The change form as a browser would post it for `persona`, with `overrides`."""
    data: dict[str, Any] = {
        "name": persona.name,
        "slug": persona.slug,
        "description": persona.description,
        "system_prompt": persona.system_prompt,
        "user_prompt_template": persona.user_prompt_template,
        "default_topic": persona.default_topic,
        "voice_examples": persona.voice_examples,
        "backend": persona.backend,
        "model": persona.model,
        "fallback_models": list(persona.fallback_models),
        "lora": persona.lora,
        "max_tokens": persona.max_tokens,
        "temperature": persona.temperature,
        "display_order": persona.display_order,
    }
    for name in ("top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        data[name] = "" if getattr(persona, name) is None else getattr(persona, name)
    data["cache_ttl"] = "" if persona.cache_ttl is None else persona.cache_ttl
    if persona.is_active:
        data["is_active"] = "on"
    data.update(overrides)
    return data


def watts() -> Persona:
    return Persona.objects.get(slug="alan-watts")


def make_generation(persona: Persona, **fields: Any) -> Generation:
    values: dict[str, Any] = {
        "persona": persona,
        "backend": "local",
        "model": "gemma-3-270m",
        "status": "ok",
        "topic": "tea",
        "text": "A quiet quote.",
    }
    values.update(fields)
    return Generation.objects.create(**values)


@pytest.fixture
def editor(db: None) -> User:
    user = User.objects.create_user("editor", password="editor-password-123", is_staff=True)
    user.groups.add(Group.objects.get(name="Persona editors"))
    return user


@pytest.fixture
def editor_client(editor: User) -> Client:
    client = Client()
    client.force_login(editor)
    return client


# --- the form: every field's validation, each error on its field -----------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "", "This field is required."),
        ("slug", "not a slug!", "Enter a valid “slug”"),
        ("description", "x" * 201, "at most 200 characters"),
        ("system_prompt", "", "This field is required."),
        ("user_prompt_template", "About {subject}", "Unknown variable {subject}; use only {topic}."),
        ("user_prompt_template", "About {topic", "The template is not valid"),
        ("default_topic", "", "This field is required."),
        ("backend", "carrier-pigeon", "Select a valid choice."),
        ("model", "@cf/nobody/unknown-model", "Select a valid choice."),
        ("fallback_models", ["@cf/nobody/unknown-model"], "Select a valid choice."),
        ("fallback_models", ["@cf/meta/llama-3.1-8b-instruct"], "A fallback must differ from the model"),
        ("lora", "my-adapter", "does not take an adapter"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", 3000, "max_tokens must be a whole number from 1 to 2048"),
        ("temperature", 5.5, "less than or equal to 5.0"),
        ("temperature", "warm", "Enter a number."),
        ("top_p", 2.5, "top_p must be a number from 0 to 2"),
        ("top_k", 51, "top_k must be a whole number from 1 to 50"),
        ("seed", 0, "seed must be a whole number from 1 to 9999999999"),
        ("repetition_penalty", 3, "repetition_penalty must be a number from 0 to 2"),
        ("frequency_penalty", -1, "frequency_penalty must be a number from 0 to 2"),
        ("presence_penalty", 2.5, "presence_penalty must be a number from 0 to 2"),
        ("cache_ttl", -1, "greater than or equal to 0"),
        ("display_order", "first", "Enter a whole number."),
    ],
)
def test_admin_form_reports_each_error_on_its_field(
    admin_client: Client, field: str, value: object, message: str
) -> None:
    persona = watts()
    before = persona.generation_config()
    response = admin_client.post(CHANGE.format(pk=persona.pk), form_data(persona, **{field: value}))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == [field], errors
    assert message in " ".join(errors[field])
    assert message.split("“")[0] in response.content.decode()
    assert watts().generation_config() == before


@pytest.mark.django_db
def test_admin_form_models_come_from_the_catalog_and_lora_fits_a_lora_model(admin_client: Client) -> None:
    persona = watts()
    page = admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    assert '<option value="@cf/google/gemma-2b-it-lora">Gemma 2B IT (LoRA)</option>' in page
    assert 'name="fallback_models"' in page and "multiple" in page
    for heading in ("Identity", "Prompts", "Model", "Sampling", "Publishing"):
        assert f">{heading}</h2>" in page
    data = form_data(
        persona,
        model="@cf/google/gemma-2b-it-lora",
        lora="my-adapter",
        fallback_models=["@cf/meta/llama-3.2-3b-instruct", "@cf/meta/llama-3.1-8b-instruct"],
        top_k=40,
        seed=7,
    )
    response = admin_client.post(CHANGE.format(pk=persona.pk), data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    persona.refresh_from_db()
    assert (persona.model, persona.lora, persona.top_k, persona.seed) == (
        "@cf/google/gemma-2b-it-lora",
        "my-adapter",
        40,
        7,
    )
    # Stored in the catalog's order, the order the select lists them in.
    assert persona.fallback_models == ["@cf/meta/llama-3.1-8b-instruct", "@cf/meta/llama-3.2-3b-instruct"]


# --- versions --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_admin_prompt_change_makes_a_version_by_the_editor(admin_client: Client, admin_user: User) -> None:
    persona = watts()
    before = persona.versions.count()
    response = admin_client.post(
        CHANGE.format(pk=persona.pk), form_data(persona, system_prompt="You are Alan Watts, laughing")
    )
    assert response.status_code == 302
    latest = persona.versions.order_by("-number").first()
    assert latest is not None
    assert persona.versions.count() == before + 1
    assert latest.config["system_prompt"] == "You are Alan Watts, laughing"
    assert latest.created_by == admin_user


@pytest.mark.django_db
def test_admin_change_shows_its_success_message_on_the_next_page(admin_client: Client) -> None:
    """Django's MessageMiddleware, run on the event loop (quotes.forks): a view that adds a
    message gets it stored, and the next page shows it once."""
    persona = watts()
    response = admin_client.post(
        CHANGE.format(pk=persona.pk), form_data(persona, display_order=3), follow=True
    )

    page = response.content.decode()
    assert "was changed successfully" in page
    again = admin_client.get(response.redirect_chain[-1][0]).content.decode()
    assert "was changed successfully" not in again


@pytest.mark.django_db
def test_admin_display_order_or_active_change_makes_no_version(admin_client: Client) -> None:
    persona = watts()
    before = persona.versions.count()
    data = form_data(persona, display_order=7)
    del data["is_active"]
    assert admin_client.post(CHANGE.format(pk=persona.pk), data).status_code == 302
    persona.refresh_from_db()
    assert (persona.display_order, persona.is_active) == (7, False)
    assert persona.versions.count() == before


@pytest.mark.services
@pytest.mark.django_db
def test_admin_rollback_makes_a_new_version_with_the_old_config(
    admin_client: Client, admin_user: User
) -> None:
    persona = watts()
    first = persona.versions.order_by("-number").first()  # the version before the edit
    assert first is not None
    admin_client.post(
        CHANGE.format(pk=persona.pk),
        form_data(persona, system_prompt="You are someone else", temperature=0.2, top_k=10),
    )
    changed = persona.versions.order_by("-number").first()
    assert changed is not None and changed.number == first.number + 1

    url = f"{VERSIONS.format(pk=persona.pk)}{first.number}/rollback/"
    assert admin_client.get(url).status_code == 405
    response = admin_client.post(url, follow=True)
    assert response.redirect_chain[-1][0] == VERSIONS.format(pk=persona.pk)
    assert f"back to v{first.number}; saved as v{changed.number + 1}" in response.content.decode()

    newest = persona.versions.order_by("-number").first()
    assert newest is not None and newest.number == changed.number + 1
    assert newest.config == first.config
    assert newest.note == f"rollback to v{first.number}"
    assert newest.created_by == admin_user
    persona.refresh_from_db()
    assert persona.generation_config() == first.config
    # The old versions are untouched.
    assert PersonaVersion.objects.get(pk=changed.pk).config["system_prompt"] == "You are someone else"


@pytest.mark.django_db
def test_admin_rollback_needs_change_permission(db: None) -> None:
    viewer = User.objects.create_user("viewer", password="viewer-password-123", is_staff=True)
    viewer.user_permissions.add(
        *Group.objects.get(name="Persona editors").permissions.filter(codename="view_persona")
    )
    client = Client()
    client.force_login(viewer)
    persona = watts()
    assert client.get(VERSIONS.format(pk=persona.pk)).status_code == 200
    assert client.post(f"{VERSIONS.format(pk=persona.pk)}1/rollback/").status_code == 403


@pytest.mark.services
@pytest.mark.django_db
def test_admin_history_lists_versions_newest_first_with_an_escaped_diff(admin_client: Client) -> None:
    persona = watts()
    change_page = admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    assert f'href="{VERSIONS.format(pk=persona.pk)}"' in change_page
    admin_client.post(
        CHANGE.format(pk=persona.pk),
        form_data(persona, system_prompt="You are Alan Watts\nSpeak of <waves> & tides", temperature=0.3),
    )
    response = admin_client.get(VERSIONS.format(pk=persona.pk))
    assert response.status_code == 200
    page = response.content.decode()
    numbers = [entry.version.number for entry in response.context["entries"]]
    assert numbers == sorted(numbers, reverse=True) and len(numbers) == 3  # seeded: v1, v2 (examples)
    assert "Speak of &lt;waves&gt; &amp; tides" in page
    assert "<waves>" not in page
    newest = response.context["entries"][0]
    lines = {(diff.name, line.kind, line.text) for diff in newest.diffs for line in diff.lines}
    assert ("system_prompt", "same", "You are Alan Watts") in lines
    assert ("system_prompt", "add", "Speak of <waves> & tides") in lines
    assert ("temperature", "remove", "0.7") in lines and ("temperature", "add", "0.3") in lines
    assert "persona-diff__line--add" in page and "persona-diff__line--remove" in page
    assert "admin" in page  # who
    assert 'data-testid="rollback-2"' in page and 'data-testid="rollback-3"' not in page  # v3 is current
    assert 'name="csrfmiddlewaretoken"' in page


# --- deleting ----------------------------------------------------------------------------------


@pytest.mark.services
@pytest.mark.django_db
def test_admin_delete_of_a_persona_with_generations_deactivates_it(admin_client: Client) -> None:
    persona = watts()
    make_generation(persona)
    url = f"/admin/quotes/persona/{persona.pk}/delete/"
    confirm = admin_client.get(url).content.decode()
    assert "deactivated instead of deleted" in confirm
    response = admin_client.post(url, {"post": "yes"}, follow=True)
    assert response.status_code == 200
    assert "instead of deleting" in response.content.decode()
    persona.refresh_from_db()
    assert persona.is_active is False
    assert persona.generations.count() == 1


@pytest.mark.django_db
def test_admin_delete_of_an_unused_persona_deletes_it(admin_client: Client) -> None:
    persona = Persona.objects.get(slug="mark-twain")
    response = admin_client.post(f"/admin/quotes/persona/{persona.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Persona.objects.filter(slug="mark-twain").exists()


@pytest.mark.services
@pytest.mark.django_db
def test_admin_bulk_delete_deactivates_the_logged_and_deletes_the_rest(admin_client: Client) -> None:
    used, unused = watts(), Persona.objects.get(slug="mark-twain")
    make_generation(used)
    response = admin_client.post(
        "/admin/quotes/persona/",
        {"action": "delete_selected", "_selected_action": [used.pk, unused.pk], "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    assert "Deactivated “Alan Watts” instead of deleting" in response.content.decode()
    assert Persona.objects.get(pk=used.pk).is_active is False
    assert not Persona.objects.filter(pk=unused.pk).exists()


# --- permissions -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_editor_may_add_and_change_personas(editor_client: Client, editor: User) -> None:
    assert editor_client.get("/admin/quotes/persona/").status_code == 200
    assert editor_client.get("/admin/quotes/persona/add/").status_code == 200
    new = form_data(watts(), name="Hypatia", slug="hypatia", system_prompt="You are Hypatia")
    assert editor_client.post("/admin/quotes/persona/add/", new).status_code == 302
    hypatia = Persona.objects.get(slug="hypatia")
    version = hypatia.versions.get()
    assert (version.number, version.created_by) == (1, editor)

    persona = watts()
    response = editor_client.post(CHANGE.format(pk=persona.pk), form_data(persona, default_topic="tea"))
    assert response.status_code == 302
    assert watts().default_topic == "tea"


@pytest.mark.django_db
def test_editor_may_not_delete_or_see_other_sections(editor_client: Client) -> None:
    persona = watts()
    assert editor_client.get(f"/admin/quotes/persona/{persona.pk}/delete/").status_code == 403
    assert (
        editor_client.post(f"/admin/quotes/persona/{persona.pk}/delete/", {"post": "yes"}).status_code == 403
    )
    assert editor_client.get("/admin/quotes/generation/").status_code == 403
    assert editor_client.get("/admin/auth/user/").status_code == 403
    assert editor_client.get("/admin/auth/group/").status_code == 403
    index = editor_client.get("/admin/").content.decode()
    assert "/admin/quotes/persona/" in index
    assert "/admin/quotes/generation/" not in index and "/admin/auth/user/" not in index
    assert Persona.objects.filter(pk=persona.pk).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("logged_in", [True, False])
def test_non_staff_are_sent_to_the_admin_login(client: Client, logged_in: bool) -> None:
    user = User.objects.create_user("visitor", password="visitor-password-123", is_staff=False)
    if logged_in:
        client.force_login(user)
    persona = watts()
    for url in (
        "/admin/quotes/persona/",
        CHANGE.format(pk=persona.pk),
        VERSIONS.format(pk=persona.pk),
        "/admin/quotes/generation/",
    ):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/"), url


# --- the request log -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_generation_log_lists_filters_and_searches(admin_client: Client) -> None:
    persona = watts()
    make_generation(
        persona,
        text="Water finds its way.",
        cache_status="miss",
        prompt_tokens=31,
        completion_tokens=12,
        ttft_ms=123.4,
        feedback=1,
    )
    make_generation(
        persona, text="A preview of the sea.", is_preview=True, cache_status="bypass", topic="sea"
    )
    make_generation(persona, text="", status="error", error_code="busy", cache_status="hit")

    page = admin_client.get("/admin/quotes/generation/").content.decode()
    for column in (
        "Status",
        "Cache status",
        "Model",
        "Backend",
        "TTFT",
        "Tokens",
        "cost",
        "Feedback",
        "preview",
    ):
        assert column.lower() in page.lower(), column
    assert "31/12" in page and "123 ms" in page

    def rows(query: str) -> set[str]:
        response = admin_client.get(f"/admin/quotes/generation/?{query}")
        assert response.status_code == 200, query
        return {g.text for g in response.context["cl"].result_list}

    assert rows("status__exact=error") == {""}
    assert rows("cache_status__exact=hit") == {""}
    assert rows("is_preview__exact=1") == {"A preview of the sea."}
    assert rows(f"persona__id__exact={persona.pk}") == {"Water finds its way.", "A preview of the sea.", ""}
    assert rows("model=gemma-3-270m&backend=local") == rows(f"persona__id__exact={persona.pk}")
    year = Generation.objects.first().created_at.year  # type: ignore[union-attr]
    assert len(rows(f"created_at__year={year}")) == 3
    assert rows(f"created_at__year={year - 1}") == set()
    assert rows("q=water") == {"Water finds its way."}
    assert rows("q=sea") == {"A preview of the sea."}


@pytest.mark.django_db
def test_generation_detail_shows_the_request_and_is_read_only(admin_client: Client) -> None:
    generation = make_generation(
        watts(),
        request={"model": "gemma-3-270m", "messages": [{"role": "system", "content": "You are <Alan>"}]},
        upstream_headers={"cf-aig-cache-status": "MISS"},
        status="error",
        error_code="upstream_error",
        error_message="The model said no.",
    )
    url = f"/admin/quotes/generation/{generation.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert '<pre class="generation-json">' in page
    assert "&quot;content&quot;: &quot;You are &lt;Alan&gt;&quot;" in page
    assert "cf-aig-cache-status" in page and "upstream_error" in page and "The model said no." in page
    assert admin_client.get("/admin/quotes/generation/add/").status_code == 403
    admin_client.post(url, {"text": "changed"})
    generation.refresh_from_db()
    assert generation.text == "A quiet quote."


@pytest.mark.django_db
def test_only_superusers_may_delete_log_rows(admin_client: Client) -> None:
    generation = make_generation(watts())
    auditor = User.objects.create_user("auditor", password="auditor-password-123", is_staff=True)
    auditor.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_generation", "delete_generation"])
    )
    client = Client()
    client.force_login(auditor)
    url = f"/admin/quotes/generation/{generation.pk}/delete/"
    assert client.get(f"/admin/quotes/generation/{generation.pk}/change/").status_code == 200
    assert client.post(url, {"post": "yes"}).status_code == 403
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not Generation.objects.filter(pk=generation.pk).exists()


# --- live preview --------------------------------------------------------------------------------


def test_admin_add_form_asks_to_save_before_previewing(admin_client: Client) -> None:
    page = admin_client.get("/admin/quotes/persona/add/").content.decode()
    assert "Save once to enable preview." in page
    assert "data-persona-preview" not in page


@pytest.mark.django_db
def test_admin_change_form_has_the_preview_module(admin_client: Client) -> None:
    persona = watts()
    page = admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    assert f'data-preview-url="/admin/quotes/persona/{persona.pk}/preview/"' in page
    assert '<script type="module" src="/static/admin/js/persona-preview.js"></script>' in page
    assert "/static/admin/css/persona-preview.css" in page
    assert "<script>" not in page.split("<body")[1]  # no inline script of ours
    for path in ("/static/admin/js/persona-preview.js", "/static/admin/css/persona-preview.css"):
        assert admin_client.get(path).status_code == 200


@pytest.fixture
def staff_headers(persona: Persona) -> dict[str, str]:
    """Cookie and CSRF headers of a logged-in superuser, for requests against the ASGI app."""
    user = User.objects.create_superuser("boss", "boss@example.com", "boss-password-123")
    client = Client()
    client.force_login(user)
    token = get_random_string(32)
    return {
        "cookie": f"sessionid={client.cookies['sessionid'].value}; csrftoken={token}",
        "x-csrftoken": token,
    }


def preview_body(persona: Persona, **overrides: Any) -> dict[str, Any]:
    fields = {k: v if isinstance(v, list) else [str(v)] for k, v in form_data(persona, **overrides).items()}
    return {"fields": fields, "topic": "the tide"}


async def test_preview_streams_the_unsaved_values_and_never_caches(
    persona: Persona, staff_headers: dict[str, str]
) -> None:
    url = f"/admin/quotes/persona/{persona.pk}/preview/"
    body = preview_body(persona, system_prompt="You are Alan Watts, on a boat", max_tokens=8)
    texts = []
    for _ in range(2):
        response = await request("POST", url, json_body=body, headers=staff_headers)
        assert response.status == 200, response.body
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.body)
        assert events[-1]["data"] == "[DONE]"
        texts.append("".join(json.loads(e["data"]).get("response", "") for e in events[:-1]))

    rows = [row async for row in Generation.objects.order_by("id")]
    assert len(rows) == 2
    for row, text in zip(rows, texts, strict=True):
        assert row.is_preview is True
        assert row.persona_id == persona.pk
        assert row.status == "ok"
        assert row.text == text
        assert row.topic == "the tide"
        assert row.request["messages"][0]["content"] == "You are Alan Watts, on a boat"
        assert row.request["max_tokens"] == 8
        assert row.cache_status != Generation.CacheStatus.HIT
    stored = await Persona.objects.aget(pk=persona.pk)
    assert stored.system_prompt == "You are Alan Watts"
    assert stored.max_tokens == 16
    assert await stored.versions.acount() == 1


async def test_preview_steers_the_embedded_model_with_the_description_and_system_prompt(
    persona: Persona, staff_headers: dict[str, str]
) -> None:
    """The embedded model is a base model: the frame credits the persona with its description
    and its system prompt, so an edit to either changes the (greedy, seeded) quote."""
    url = f"/admin/quotes/persona/{persona.pk}/preview/"

    async def preview_text(**changes: object) -> str:
        # 48 tokens, not fewer: the topic's words are favoured (TOPIC_BIAS), so the greedy first
        # sentence about "the tide" may be the same; the persona's words steer what follows.
        body = preview_body(persona, max_tokens=48, temperature=0, seed=5, **changes)
        response = await request("POST", url, json_body=body, headers=staff_headers)
        assert response.status == 200, response.body
        events = parse_sse(response.body)
        assert events[-1]["data"] == "[DONE]"
        return "".join(json.loads(e["data"]).get("response", "") for e in events[:-1])

    plain = await preview_text()
    assert plain == await preview_text()  # greedy and seeded: the same values, the same quote
    assert await preview_text(description="A sea captain who fears nothing but calm water.") != plain
    assert await preview_text(system_prompt="You are Alan Watts, a baker who talks only of bread") != plain
    assert await Generation.objects.filter(is_preview=True).acount() == 4


async def test_preview_of_invalid_values_answers_400_with_each_field(
    persona: Persona, staff_headers: dict[str, str]
) -> None:
    url = f"/admin/quotes/persona/{persona.pk}/preview/"
    body = preview_body(persona, user_prompt_template="About {subject}", top_k=99)
    response = await request("POST", url, json_body=body, headers=staff_headers)
    assert response.status == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_persona"
    assert set(error["fields"]) == {"user_prompt_template", "top_k"}
    assert "Unknown variable {subject}" in error["fields"]["user_prompt_template"][0]
    assert "user_prompt_template" in error["message"]
    assert await Generation.objects.acount() == 0


async def test_preview_needs_csrf_staff_and_post(persona: Persona, staff_headers: dict[str, str]) -> None:
    url = f"/admin/quotes/persona/{persona.pk}/preview/"
    body = preview_body(persona)
    no_token = {"cookie": staff_headers["cookie"]}
    assert (await request("POST", url, json_body=body, headers=no_token)).status == 403
    token = get_random_string(32)
    anonymous = {"cookie": f"csrftoken={token}", "x-csrftoken": token}
    response = await request("POST", url, json_body=body, headers=anonymous)
    assert response.status == 403
    assert response.json()["error"]["code"] == "forbidden"
    assert (await request("GET", url, headers=staff_headers)).status == 405
    missing = f"/admin/quotes/persona/{persona.pk + 1000}/preview/"
    assert (await request("POST", missing, json_body=body, headers=staff_headers)).status == 404
    assert await Generation.objects.acount() == 0
