"""Persona avatars and the page's small icons, as inline SVG: emoji need a font some desktops
lack (Debian's chromium draws empty boxes). Colours are SVG attributes: the CSP forbids inline style.
"""

from __future__ import annotations

import colorsys
import hashlib
from typing import Any

from django import template

register = template.Library()


def initials(name: str) -> str:
    """Up to two letters: the first of the first and of the last word ("Lao Tzu" -> "LT")."""
    words = [word for word in name.split() if word[:1].isalnum()]
    if not words:
        return "?"
    letters = words[0][0] + (words[-1][0] if len(words) > 1 else "")
    return letters.upper()


def avatar_colour(slug: str) -> str:
    """A colour of its own for each persona, the same on every page and every run: the hue from
    a hash of the slug, dark enough that white letters on it stay readable (contrast over 4.5)."""
    hue = int.from_bytes(hashlib.sha256(slug.encode()).digest()[:2], "big") / 65536
    red, green, blue = colorsys.hls_to_rgb(hue, 0.36, 0.5)
    return f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}"


@register.inclusion_tag("quotes/_avatar.html")
def avatar(persona: Any, css_class: str) -> dict[str, str]:
    """`{% avatar persona "persona-card__avatar" %}`: the persona's monogram, decorative (the name
    is always written next to it)."""
    return {"css_class": css_class, "initials": initials(persona.name), "colour": avatar_colour(persona.slug)}


#: 24x24 outline icons (stroke paths), drawn for this project.
ICONS = {
    "copy": "M9 9h11v11H9z M5 15H4V4h11v1",
    "link": "M10 14a4 4 0 0 0 5.66 0l3-3a4 4 0 0 0-5.66-5.66l-1 1 M14 10a4 4 0 0 0-5.66 0l-3 3a4 4 0 0 0 5.66 5.66l1-1",
    "thumb-up": "M7 11v9H4v-9z M7 11l4-8a2 2 0 0 1 3 2l-1 5h6a2 2 0 0 1 2 2.3l-1.3 6.5A2 2 0 0 1 17.7 20H7",
    "thumb-down": "M7 13V4H4v9z M7 13l4 8a2 2 0 0 0 3-2l-1-5h6a2 2 0 0 0 2-2.3L19.7 5.2A2 2 0 0 0 17.7 4H7",
}


@register.inclusion_tag("quotes/_icon.html")
def icon(name: str) -> dict[str, str]:
    """`{% icon "copy" %}`: a small decorative icon in the text's colour (currentColor)."""
    return {"path": ICONS[name]}
