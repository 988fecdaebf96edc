"""The WebSockets a client (and its network) may hold open on this process."""

from __future__ import annotations

from collections import Counter

from django.conf import settings

from . import state
from .clients import Client
from .rate_limits import NETWORK_FACTOR


class Sockets(Counter[str]):
    """The sockets open on this event loop, by client and network (a part of quotes.state)."""


def open_socket(client: Client) -> bool:
    """Whether `client` (and its network) may hold one more socket here; counted if so."""
    sockets = state.of(Sockets)
    if sockets[client.key] >= settings.QUOTES_MAX_SOCKETS or (
        client.network and sockets[client.network] >= settings.QUOTES_MAX_SOCKETS * NETWORK_FACTOR
    ):
        return False
    sockets.update(filter(None, (client.key, client.network)))
    return True


def close_socket(client: Client) -> None:
    sockets = state.of(Sockets)
    sockets.subtract(filter(None, (client.key, client.network)))
    for key in (client.key, client.network):
        if sockets[key] <= 0:
            sockets.pop(key, None)
