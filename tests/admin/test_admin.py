"""The persona admin (validation, versions, roll-back, preview, deletion), the read-only request
log, and who may see what: Django's test client on the real admin, the preview through the ASGI app."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.test import Client
from django.utils import timezone
from django.utils.crypto import get_random_string

from quotes.models import Generation, Persona, PersonaVersion
from tests.asgi import parse_sse, request

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

CHANGE = "/admin/quotes/persona/{pk}/change/"
VERSIONS = "/admin/quotes/persona/{pk}/history-versions/"
LOG = "/admin/quotes/generation/"
TEXTS = ("name", "slug", "description", "system_prompt", "user_prompt_template", "default_topic")
VALUES = ("voice_examples", "backend", "model", "lora", "max_tokens", "temperature", "display_order")
NULLABLE = ("top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty")


def form_data(persona: Persona, **overrides: Any) -> dict[str, Any]:
    """The change form as a browser would post it for `persona`, with `overrides`."""
    data: dict[str, Any] = {name: getattr(persona, name) for name in (*TEXTS, *VALUES)}
    data["fallback_models"] = list(persona.fallback_models)
    for name in (*NULLABLE, "cache_ttl", "daily_spend_limit_usd"):
        data[name] = "" if getattr(persona, name) is None else getattr(persona, name)
    if persona.is_active:
        data["is_active"] = "on"
    return data | overrides


def watts() -> Persona:
    return Persona.objects.get(slug="alan-watts")


def make_generation(persona: Persona, **fields: Any) -> Generation:
    values = {"persona": persona, "backend": "local", "model": "gemma-3-270m", "status": "ok", "topic": "tea"}
    return Generation.objects.create(**(values | {"text": "A quiet quote."} | fields))


def logged_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def staff(name: str, *codenames: str) -> Client:
    user = User.objects.create_user(name, password=f"{name}-password-123", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return logged_in(user)


# --- the form: each error on its field -------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("slug", "not a slug!", "Enter a valid “slug”"),
        ("user_prompt_template", "About {subject}", "Unknown variable {subject}; use only {topic}."),
        ("user_prompt_template", "About {topic", "The template is not valid"),
        ("model", "@cf/nobody/unknown-model", "Select a valid choice."),
        ("fallback_models", ["@cf/meta/llama-3.1-8b-instruct-fp8"], "A fallback must differ from the model"),
        ("lora", "my-adapter", "does not take an adapter"),
        ("max_tokens", 3000, "max_tokens must be a whole number from 1 to 2048"),
        ("top_k", 51, "top_k must be a whole number from 1 to 50"),
        ("cache_ttl", -1, "greater than or equal to 0"),
        ("daily_spend_limit_usd", "-1", "greater than or equal to 0"),
    ],
)
def test_admin_form_error_is_on_its_field(admin_client: Client, field: str, value: Any, message: str) -> None:
    persona = watts()
    before = persona.generation_config()
    response = admin_client.post(CHANGE.format(pk=persona.pk), form_data(persona, **{field: value}))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == [field] and message in " ".join(errors[field]), errors
    assert message.split("“")[0] in response.content.decode()
    assert watts().generation_config() == before


def test_admin_form_models_come_from_the_catalog_and_lora_fits_a_lora_model(admin_client: Client) -> None:
    persona, lora_model = watts(), "@cf/google/gemma-2b-it-lora"
    page = admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    # Each model with what it costs (the demo's beta LoRA model has no published price).
    assert (
        f'<option value="{lora_model}">google/gemma-2b-it-lora (price not published, 8k context, beta)</option>'
        in page
    )
    assert "meta/llama-3.2-3b-instruct ($0.051 in / $0.335 out per M tokens" in page
    assert "llama-3.1-8b-instruct<" not in page and "llama-3.1-8b-instruct (" not in page  # retired
    for heading in ("Identity", "Prompts", "Model", "Sampling", "Publishing"):
        assert f">{heading}</h2>" in page
    fallbacks = ["@cf/meta/llama-3.2-3b-instruct", "@cf/meta/llama-3.1-8b-instruct-fp8"]
    data = form_data(persona, model=lora_model, lora="my-adapter", fallback_models=fallbacks, top_k=40)
    response = admin_client.post(CHANGE.format(pk=persona.pk), data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    persona.refresh_from_db()
    assert (persona.model, persona.lora, persona.top_k) == (lora_model, "my-adapter", 40)
    assert persona.fallback_models == fallbacks[::-1]  # the catalog's order, as the select lists them


def test_admin_marks_a_persona_on_a_retired_model_and_its_form_refuses_it(admin_client: Client) -> None:
    """A database from before the refresh (the migration moved the seeded personas; a restored
    backup can hold a retired model still): the list says so, the form shows the model, refuses
    it and names its successor, and saves once another is chosen."""
    retired, successor = "@cf/meta/llama-3.1-8b-instruct", "@cf/meta/llama-3.1-8b-instruct-fp8"
    Persona.objects.filter(slug="alan-watts").update(model=retired)
    Persona.objects.filter(slug="mark-twain").update(fallback_models=["@cf/nobody/nothing"])
    listing = admin_client.get("/admin/quotes/persona/").content.decode()
    assert f"{retired} ⚠ was retired by Cloudflare on 2026-05-30: use {successor}" in listing
    assert "⚠ its fallback @cf/nobody/nothing is not in the Workers AI catalog" in listing
    assert listing.count("⚠") == 2

    persona = watts()
    page = admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    assert f'<option value="{retired}" selected>{retired} (retired on 2026-05-30)</option>' in page
    response = admin_client.post(CHANGE.format(pk=persona.pk), form_data(persona))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert errors == {
        "model": [
            f"{retired} was retired by Cloudflare on 2026-05-30: choose another model, such as {successor}."
        ]
    }
    response = admin_client.post(CHANGE.format(pk=persona.pk), form_data(persona, model=successor))
    assert response.status_code == 302 and watts().model == successor
    # A retired fallback is shown and refused the same way.
    Persona.objects.filter(slug="alan-watts").update(fallback_models=[retired])
    page = admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    assert f'<option value="{retired}" selected>{retired} (retired on 2026-05-30)</option>' in page
    response = admin_client.post(CHANGE.format(pk=persona.pk), form_data(watts()))
    errors = response.context["adminform"].form.errors
    assert list(errors) == ["fallback_models"] and "was retired by Cloudflare" in errors["fallback_models"][0]


# --- versions ---------------------------------------------------------------------------------------


def test_admin_prompt_change_makes_a_version_by_its_editor(admin_client: Client, admin_user: User) -> None:
    persona = watts()
    before = persona.versions.count()
    data = form_data(persona, system_prompt="You are Alan Watts, laughing")
    response = admin_client.post(CHANGE.format(pk=persona.pk), data, follow=True)
    assert "was changed successfully" in response.content.decode()
    next_page = admin_client.get(response.redirect_chain[-1][0]).content.decode()
    assert "was changed successfully" not in next_page  # said once
    latest = persona.versions.order_by("-number").first()
    assert latest is not None and persona.versions.count() == before + 1
    assert (latest.config["system_prompt"], latest.created_by) == (data["system_prompt"], admin_user)

    # What the site does with the persona, not what the model is sent: no new version.
    data |= {"display_order": 7, "daily_spend_limit_usd": "2.50", "cache_ttl": 60}
    del data["is_active"]
    assert admin_client.post(CHANGE.format(pk=persona.pk), data).status_code == 302
    persona.refresh_from_db()
    assert (persona.display_order, persona.is_active, persona.cache_ttl) == (7, False, 60)
    assert str(persona.daily_spend_limit_usd) == "2.5000" and persona.versions.count() == before + 1


@pytest.mark.services
def test_admin_rollback_makes_a_new_version_of_the_old_config(admin_client: Client, admin_user: User) -> None:
    persona = watts()
    first = persona.versions.order_by("-number").first()
    assert first is not None
    data = form_data(persona, system_prompt="You are someone else", temperature=0.2, top_k=10)
    admin_client.post(CHANGE.format(pk=persona.pk), data)
    changed = persona.versions.order_by("-number").first()
    assert changed is not None and changed.number == first.number + 1

    url = f"{VERSIONS.format(pk=persona.pk)}{first.number}/rollback/"
    assert admin_client.get(url).status_code == 405
    response = admin_client.post(url, follow=True)
    assert response.redirect_chain[-1][0] == VERSIONS.format(pk=persona.pk)
    assert f"back to v{first.number}; saved as v{changed.number + 1}" in response.content.decode()
    newest = persona.versions.order_by("-number").first()
    assert newest is not None and newest.number == changed.number + 1
    assert (newest.config, newest.created_by) == (first.config, admin_user)
    assert newest.note == f"rollback to v{first.number}"
    persona.refresh_from_db()
    assert persona.generation_config() == first.config
    assert PersonaVersion.objects.get(pk=changed.pk).config["system_prompt"] == "You are someone else"
    assert "already has" in admin_client.post(url, follow=True).content.decode()
    assert persona.versions.count() == newest.number  # rolling back again makes no version

    viewer = staff("viewer", "view_persona")
    assert viewer.get(VERSIONS.format(pk=persona.pk)).status_code == 200
    assert viewer.post(url).status_code == 403  # rolling back needs the change permission


@pytest.mark.services
def test_admin_history_lists_versions_newest_first_with_an_escaped_diff(admin_client: Client) -> None:
    persona = watts()
    versions = VERSIONS.format(pk=persona.pk)
    assert f'href="{versions}"' in admin_client.get(CHANGE.format(pk=persona.pk)).content.decode()
    prompt = "You are Alan Watts\nSpeak of <waves> & tides"
    admin_client.post(CHANGE.format(pk=persona.pk), form_data(persona, system_prompt=prompt, temperature=0.3))
    response = admin_client.get(versions)
    page, entries = response.content.decode(), response.context["entries"]
    assert [entry.version.number for entry in entries] == [3, 2, 1]  # seeded: v1, v2 (voice examples)
    assert "Speak of &lt;waves&gt; &amp; tides" in page and "<waves>" not in page
    lines = {(diff.name, line.kind, line.text) for diff in entries[0].diffs for line in diff.lines}
    assert ("system_prompt", "same", "You are Alan Watts") in lines
    assert ("system_prompt", "add", "Speak of <waves> & tides") in lines
    assert ("temperature", "remove", "0.7") in lines and ("temperature", "add", "0.3") in lines
    assert "persona-diff__line--add" in page and "persona-diff__line--remove" in page
    assert 'data-testid="rollback-2"' in page and 'data-testid="rollback-3"' not in page  # v3 is current


# --- deleting: a persona the log points at is deactivated instead --------------------------------


@pytest.mark.services
def test_admin_delete_deactivates_a_logged_persona_and_deletes_an_unused_one(admin_client: Client) -> None:
    persona, twain = watts(), Persona.objects.get(slug="mark-twain")
    make_generation(persona)
    url = f"/admin/quotes/persona/{persona.pk}/delete/"
    assert "deactivated instead of deleted" in admin_client.get(url).content.decode()
    assert "instead of deleting" in admin_client.post(url, {"post": "yes"}, follow=True).content.decode()
    persona.refresh_from_db()
    assert persona.is_active is False and persona.generations.count() == 1
    assert admin_client.post(f"/admin/quotes/persona/{twain.pk}/delete/", {"post": "yes"}).status_code == 302
    assert not Persona.objects.filter(slug="mark-twain").exists()

    used, unused = Persona.objects.get(slug="ada-lovelace"), Persona.objects.get(slug="lao-tzu")
    make_generation(used)
    action = {"action": "delete_selected", "_selected_action": [used.pk, unused.pk], "post": "yes"}
    page = admin_client.post("/admin/quotes/persona/", action, follow=True).content.decode()
    assert "Deactivated “Ada Lovelace” instead of deleting" in page
    assert "Successfully deleted 1 persona." in page
    assert Persona.objects.get(pk=used.pk).is_active is False
    assert not Persona.objects.filter(pk=unused.pk).exists()


# --- who may do what ------------------------------------------------------------------------------


def test_persona_editors_add_and_change_personas_and_see_nothing_else() -> None:
    editor = User.objects.create_user("editor", password="editor-password-123", is_staff=True)
    editor.groups.add(Group.objects.get(name="Persona editors"))
    client, persona = logged_in(editor), watts()
    new = form_data(persona, name="Hypatia", slug="hypatia", system_prompt="You are Hypatia")
    assert client.post("/admin/quotes/persona/add/", new).status_code == 302
    assert Persona.objects.get(slug="hypatia").versions.get().created_by == editor
    changed = form_data(persona, default_topic="tea")
    assert client.post(CHANGE.format(pk=persona.pk), changed).status_code == 302
    assert watts().default_topic == "tea"

    delete = f"/admin/quotes/persona/{persona.pk}/delete/"
    assert client.get(delete).status_code == client.post(delete, {"post": "yes"}).status_code == 403
    for url in (LOG, f"{LOG}analytics/", "/admin/auth/user/"):
        assert client.get(url).status_code == 403, url
    index = client.get("/admin/").content.decode()
    assert "/admin/quotes/persona/" in index and LOG not in index
    assert Persona.objects.filter(pk=persona.pk, is_active=True).exists()


@pytest.mark.parametrize("visitor", [True, False])
def test_non_staff_are_sent_to_the_admin_login(client: Client, visitor: bool) -> None:
    if visitor:
        client.force_login(User.objects.create_user("visitor", password="visitor-password-123"))
    pk = watts().pk
    for url in ("/admin/quotes/persona/", CHANGE.format(pk=pk), VERSIONS.format(pk=pk), LOG):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), url


# --- the request log -----------------------------------------------------------------------------


def test_generation_log_lists_filters_and_shows_lost_rows(admin_client: Client, settings: Any) -> None:
    persona = watts()
    tokens = {"prompt_tokens": 31, "completion_tokens": 12, "ttft_ms": 123.4, "feedback": 1}
    make_generation(persona, text="Water finds its way.", cache_status="miss", **tokens)
    make_generation(persona, text="A preview of the sea.", is_preview=True, topic="sea")
    make_generation(persona, text="", status="error", error_code="upstream_timeout", cache_status="hit")
    make_generation(persona, text="Still writing", status="running")
    dead = make_generation(persona, text="Cut off", status="running")  # its process died mid-stream
    deadline = dt.timedelta(seconds=settings.QUOTES_POLICY.total_timeout_s + 65)
    Generation.objects.filter(pk=dead.pk).update(created_at=timezone.now() - deadline)

    response = admin_client.get(LOG)
    page = response.content.decode().lower()
    for column in ("status", "cache status", "model", "backend", "ttft", "tokens", "cost", "feedback"):
        assert column in page, column
    assert "31/12" in page and "123 ms" in page
    log = response.context["cl"]
    states = {g.text: log.model_admin.state(g) for g in log.result_list}
    assert (states["Still writing"], states["Cut off"], states[""]) == ("running", "lost", "error")
    assert '<td class="field-state">lost</td>' in page

    def rows(query: str) -> set[str]:
        response = admin_client.get(f"{LOG}?{query}")
        assert response.status_code == 200, query
        return {g.text for g in response.context["cl"].result_list}

    assert rows("status__exact=error") == rows("cache_status__exact=hit") == {""}
    assert rows("is_preview__exact=1") == rows("q=sea") == {"A preview of the sea."}
    assert len(rows(f"persona__id__exact={persona.pk}&model=gemma-3-270m&backend=local")) == 5
    year = timezone.now().year
    assert len(rows(f"created_at__year={year}")) == 5 and rows(f"created_at__year={year - 1}") == set()
    assert rows("q=water") == {"Water finds its way."}


def test_generation_detail_is_read_only_and_only_superusers_delete_a_row(admin_client: Client) -> None:
    messages = [{"role": "system", "content": "You are <Alan>"}]
    generation = make_generation(
        watts(),
        request={"model": "gemma-3-270m", "messages": messages},
        upstream_headers={"cf-aig-cache-status": "MISS"},
        status="error",
        error_code="upstream_error",
        error_message="The model said no.",
    )
    url, delete = f"{LOG}{generation.pk}/change/", f"{LOG}{generation.pk}/delete/"
    page = admin_client.get(url).content.decode()
    assert '<pre class="generation-json">' in page
    assert "&quot;content&quot;: &quot;You are &lt;Alan&gt;&quot;" in page
    assert "cf-aig-cache-status" in page and "upstream_error" in page and "The model said no." in page
    assert admin_client.get(f"{LOG}add/").status_code == 403
    admin_client.post(url, {"text": "changed"})
    generation.refresh_from_db()
    assert generation.text == "A quiet quote."

    auditor = staff("auditor", "view_generation", "delete_generation")
    assert auditor.get(url).status_code == 200 and auditor.post(delete, {"post": "yes"}).status_code == 403
    assert admin_client.post(delete, {"post": "yes"}).status_code == 302
    assert not Generation.objects.filter(pk=generation.pk).exists()


# --- live preview --------------------------------------------------------------------------------


@pytest.fixture
def staff_headers(persona: Persona) -> dict[str, str]:
    """Cookie and CSRF headers of a logged-in superuser, for requests against the ASGI app."""
    client = logged_in(User.objects.create_superuser("boss", "boss@example.com", "boss-password-123"))
    session, token = client.cookies["sessionid"].value, get_random_string(32)
    return {"cookie": f"sessionid={session}; csrftoken={token}", "x-csrftoken": token}


def preview_body(persona: Persona, **overrides: Any) -> dict[str, Any]:
    fields = {k: v if isinstance(v, list) else [str(v)] for k, v in form_data(persona, **overrides).items()}
    return {"fields": fields, "topic": "the tide"}


async def test_preview_streams_unsaved_values_and_never_caches(persona: Persona, staff_headers: Any) -> None:
    url = f"/admin/quotes/persona/{persona.pk}/preview/"
    body = preview_body(persona, system_prompt="You are Alan Watts, on a boat", max_tokens=8)
    texts = []
    for _ in range(2):
        response = await request("POST", url, json_body=body, headers=staff_headers)
        assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.body)
        assert events[-1]["data"] == "[DONE]"
        texts.append("".join(json.loads(e["data"]).get("response", "") for e in events[:-1]))

    rows = [row async for row in Generation.objects.order_by("id")]
    assert [row.text for row in rows] == texts
    for row in rows:
        assert (row.is_preview, row.persona_id, row.status, row.topic) == (True, persona.pk, "ok", "the tide")
        assert row.request["messages"][0]["content"] == "You are Alan Watts, on a boat"
        assert row.request["max_tokens"] == 8 and row.cache_status != Generation.CacheStatus.HIT
    stored = await Persona.objects.aget(pk=persona.pk)
    assert (stored.system_prompt, stored.max_tokens) == ("You are Alan Watts", 16)
    assert await stored.versions.acount() == 1


async def test_preview_needs_csrf_staff_post_and_valid_values(persona: Persona, staff_headers: Any) -> None:
    url, body, token = f"/admin/quotes/persona/{persona.pk}/preview/", preview_body(persona), "t" * 32
    no_token = await request("POST", url, json_body=body, headers={"cookie": staff_headers["cookie"]})
    anonymous = {"cookie": f"csrftoken={token}", "x-csrftoken": token}
    not_staff = await request("POST", url, json_body=body, headers=anonymous)
    missing = f"/admin/quotes/persona/{persona.pk + 1000}/preview/"
    assert no_token.status == 403
    assert not_staff.status == 403 and not_staff.json()["error"]["code"] == "forbidden"
    assert (await request("GET", url, headers=staff_headers)).status == 405
    assert (await request("POST", missing, json_body=body, headers=staff_headers)).status == 404

    invalid = preview_body(persona, user_prompt_template="About {subject}", top_k=99)
    response = await request("POST", url, json_body=invalid, headers=staff_headers)
    error = response.json()["error"]
    assert (response.status, error["code"]) == (400, "invalid_persona")
    assert set(error["fields"]) == {"user_prompt_template", "top_k"} and "top_k" in error["message"]
    assert "Unknown variable {subject}" in error["fields"]["user_prompt_template"][0]
    # JSON nested deeper than Python recurses was a 500 (a RecursionError): a 400 like any bad JSON.
    deep = await request(
        "POST", url, body=b"[" * 100_000, headers={**staff_headers, "content-type": "application/json"}
    )
    assert (deep.status, deep.json()["error"]["code"]) == (400, "invalid_json")
    assert await Generation.objects.acount() == 0
