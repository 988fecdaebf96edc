"""The pages a visitor opens and the terminal client."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from quotes.models import Generation, Persona

pytestmark = pytest.mark.django_db(transaction=True)


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

    root = Path(__file__).resolve().parents[1] / "templates"
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
    js = Path(__file__).resolve().parents[1] / "static" / "js"
    for path in [js / "persona-page.js", *(js / "persona").glob("*.js")]:
        source = path.read_text()
        assert "/q/" not in source and "/api/" not in source, path.name


def test_the_stream_client_mounts_nothing_on_import() -> None:
    """quote-stream.js is imported by the admin preview too: it must not wire any page."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "static" / "js" / "quote-stream.js").read_text()
    assert "document." not in source and "mountQuoteApp" not in source
