"""The pages a visitor opens, and the terminal client."""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from quotes.models import Generation, Persona
from tests.asgi import request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ('data-testid="generate"', 'data-testid="loading"', 'data-testid="quote-text"', 'aria-live="polite"')
URLS = {"stream": "/api/quotes/stream", "permalink": "/q/{id}/", "feedback": "/api/quotes/{id}/feedback"}
URLS |= {"share": "/api/quotes/{id}/share", "stop": "/api/quotes/{id}/stop"}


def test_index_lists_only_active_personas(persona: Persona, client: Client) -> None:
    prompts = {"system_prompt": "x", "user_prompt_template": "{topic}", "default_topic": "t"}
    Persona.objects.create(slug="hidden", name="Hidden Person", is_active=False, **prompts)

    response = client.get("/")

    html = response.content.decode()
    assert response.status_code == 200 and persona.name in html and f"/personas/{persona.slug}/" in html
    assert "Hidden Person" not in html


def test_persona_page_has_the_streaming_hooks_and_its_scripts_urls(persona: Any, client: Client) -> None:
    """The page script builds no URL of its own: moving a route cannot leave it posting to the old one."""
    response = client.get(f"/personas/{persona.slug}/")

    html = response.content.decode()
    assert response.status_code == 200 and all(hook in html for hook in HOOKS)
    assert "gemma-3-270m" in html and "https://huggingface.co/google/gemma-3-270m" in html
    assert "<script>" not in html and " onclick=" not in html and 'type="module"' in html  # CSP-ready
    for name, url in URLS.items():
        assert f'data-{name}-url="{url}"' in html, name
    js = ROOT / "static" / "js"
    for path in [js / "persona-page.js", *(js / "persona").glob("*.js")]:
        assert "/q/" not in path.read_text() and "/api/" not in path.read_text(), path.name
    # quote-stream.js is imported by the admin preview too: it must not wire any page.
    assert "document." not in (js / "quote-stream.js").read_text()


async def test_a_persona_on_its_own_backend_names_that_backends_model(persona: Any, settings: Any) -> None:
    settings.AI_BACKEND = "workers-ai"  # the site on Workers AI, this persona on the embedded model
    persona.backend, persona.model = "local", "@cf/meta/llama-3.1-8b-instruct-fp8"
    await persona.asave()

    page = await request("GET", f"/personas/{persona.slug}/")

    assert page.status == 200 and "gemma-3-270m" in page.body.decode()
    assert "llama-3.1-8b-instruct-fp8" not in page.body.decode()


def test_avatars_and_button_icons_are_svg_not_emoji(persona: Persona, client: Client) -> None:
    # Emoji need an emoji font, which a desktop may lack (Debian's chromium draws boxes).
    index = client.get("/").content.decode()
    page = client.get(f"/personas/{persona.slug}/").content.decode()
    for html in (index, page):
        assert '<svg class="avatar' in html and ">AW</text>" in html
    assert page.count('<svg class="icon"') == 4 and not any(emoji in page for emoji in "📋🔗👍👎")
    fill = re.search(r'<circle [^>]*fill="(#[0-9a-f]{6})"', page)  # the disc's colour follows the slug
    assert fill is not None and f'fill="{fill[1]}"' in index


def test_templates_have_no_inline_script_style_or_handlers() -> None:
    """The Content-Security-Policy allows no inline script or style: keep every template clean."""
    inline = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>|\sstyle=|\son[a-z]+=", re.IGNORECASE)
    templates = (ROOT / "templates").rglob("*.html")
    assert [(p.name, m[0]) for p in templates for m in inline.finditer(p.read_text())] == []


def test_quote_command_streams_to_stdout_and_logs_or_names_the_personas(persona: Persona) -> None:
    out = StringIO()
    call_command("quote", persona.slug, "--topic", "the sea", stdout=out)
    row = Generation.objects.get()
    assert row.status == Generation.Status.OK
    assert out.getvalue() == f"{row.text}\n  — gemma-3-270m as {persona.name}\n"
    Persona.objects.exclude(pk=persona.pk).delete()  # the seeded ones, when this test runs first
    with pytest.raises(CommandError, match=r"No active persona 'nobody'; try one of: test-watts$"):
        call_command("quote", "nobody")
