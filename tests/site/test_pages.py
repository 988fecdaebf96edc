"""The pages a visitor opens and the terminal client."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from quotes.models import Generation, Persona
from tests.asgi import request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


def test_index_lists_only_active_personas(persona: Persona, client: Client) -> None:
    Persona.objects.create(
        slug="hidden",
        name="Hidden Person",
        system_prompt="x",
        user_prompt_template="{topic}",
        default_topic="t",
        is_active=False,
    )
    response = client.get("/")
    html = response.content.decode()
    assert response.status_code == 200
    assert persona.name in html and f"/personas/{persona.slug}/" in html
    assert "Hidden Person" not in html


def test_persona_page_has_the_streaming_hooks(persona: Persona, client: Client) -> None:
    response = client.get(f"/personas/{persona.slug}/")
    html = response.content.decode()
    assert response.status_code == 200
    for hook in (
        'data-testid="generate"',
        'data-testid="loading"',
        'data-testid="quote-text"',
        'aria-live="polite"',
    ):
        assert hook in html
    assert "gemma-3-270m" in html and "https://huggingface.co/google/gemma-3-270m" in html
    assert "<script>" not in html and " onclick=" not in html  # no inline script: CSP-ready
    assert 'type="module"' in html


async def test_persona_with_its_own_backend_shows_and_is_checked_against_that_backends_model(
    persona: Persona, settings: pytest.FixtureRequest
) -> None:
    # The site answers on Workers AI, this persona on the embedded model: its page must name the
    # embedded model, and a conversation too long for that model's 1024-token context must be
    # refused for it (Workers AI's Llama, with its 128k context, would have taken it).
    settings.AI_BACKEND = "workers-ai"  # type: ignore[attr-defined]
    persona.backend = "local"
    persona.model = "@cf/meta/llama-3.1-8b-instruct"
    await persona.asave()

    page = await request("GET", f"/personas/{persona.slug}/")
    html = page.body.decode()
    assert page.status == 200
    assert "gemma-3-270m" in html and "llama-3.1-8b-instruct" not in html

    long = "word " * 390  # ~490 estimated tokens a turn
    messages = [
        {"role": "user", "content": long},
        {"role": "assistant", "content": long},
        {"role": "user", "content": long},
    ]
    response = await request(
        "POST", "/api/quotes/stream", json_body={"persona": persona.slug, "messages": messages}
    )
    assert response.status == 400
    error = response.json()["error"]
    assert error["code"] == "context_window_exceeded"
    assert "gemma-3-270m" in error["message"] and "1024-token context window" in error["message"]


def test_avatars_and_button_icons_are_svg_not_emoji(persona: Persona, client: Client) -> None:
    # Emoji need an emoji font, which a desktop may lack (Debian's chromium draws boxes).
    index = client.get("/").content.decode()
    page = client.get(f"/personas/{persona.slug}/").content.decode()
    for html in (index, page):
        assert '<svg class="avatar' in html and ">AW</text>" in html
    assert page.count('<svg class="icon"') == 4
    assert not any(emoji in page for emoji in "📋🔗👍👎")
    # The disc's colour follows the slug: the same on both pages.
    fill = re.search(r'<circle [^>]*fill="(#[0-9a-f]{6})"', page)
    assert fill is not None and f'fill="{fill[1]}"' in index


def test_unknown_persona_page_is_a_readable_404(client: Client) -> None:
    response = client.get("/personas/nobody/")
    assert response.status_code == 404
    assert b"Persona Quotes" in response.content


def test_quote_command_streams_to_stdout_and_logs(persona: Persona) -> None:
    out = StringIO()
    call_command("quote", persona.slug, "--topic", "the sea", stdout=out)
    row = Generation.objects.get()
    assert row.status == Generation.Status.OK
    assert out.getvalue() == f"{row.text}\n  — gemma-3-270m as {persona.name}\n"


def test_quote_command_names_the_personas_when_one_is_unknown(persona: Persona) -> None:
    with pytest.raises(CommandError, match="test-watts"):
        call_command("quote", "nobody")


def test_templates_have_no_inline_script_style_or_handlers() -> None:
    """The Content-Security-Policy allows no inline script or style: keep every template clean."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "templates"
    inline = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>|\sstyle=|\son[a-z]+=", re.IGNORECASE)
    offenders = [
        f"{path.relative_to(root)}: {match.group(0).strip()}"
        for path in root.rglob("*.html")
        for match in inline.finditer(path.read_text())
    ]
    assert offenders == []


def test_persona_page_gives_its_script_every_url(persona: Persona, client: Client) -> None:
    """The page script builds no URL of its own: each comes from the template, so moving a route
    cannot leave the page posting to the old one."""
    from pathlib import Path

    html = client.get(f"/personas/{persona.slug}/").content.decode()
    assert 'data-stream-url="/api/quotes/stream"' in html
    assert 'data-permalink-url="/q/{id}/"' in html
    assert 'data-feedback-url="/api/quotes/{id}/feedback"' in html
    js = Path(__file__).resolve().parents[2] / "static" / "js"
    for path in [js / "persona-page.js", *(js / "persona").glob("*.js")]:
        source = path.read_text()
        assert "/q/" not in source and "/api/" not in source, path.name


def test_the_stream_client_mounts_nothing_on_import() -> None:
    """quote-stream.js is imported by the admin preview too: it must not wire any page."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "static" / "js" / "quote-stream.js").read_text()
    assert "document." not in source and "mountQuoteApp" not in source
