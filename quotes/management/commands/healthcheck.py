"""`python manage.py healthcheck [--url URL | --unix-socket PATH]`: exit 0 when this host's
daphne answers `/healthz` with 200, else 1 (the Dockerfile's HEALTHCHECK). It connects to
127.0.0.1 but sends a Host from ALLOWED_HOSTS, which Django requires (else a 400).
"""

from __future__ import annotations

from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.http.request import validate_host

DEFAULT_URL = "http://127.0.0.1:8000/healthz"


def probe_host(allowed: list[str]) -> str:
    """A Host header that ALLOWED_HOSTS accepts: its first entry, made concrete."""
    for pattern in allowed:
        host = "localhost" if pattern == "*" else pattern.removeprefix(".")
        if host and validate_host(host, allowed):
            return host
    raise CommandError("ALLOWED_HOSTS is empty: no Host header would be accepted.")


class Command(BaseCommand):
    help = "Check that the local daphne process answers /healthz with 200 (for container health checks)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default=DEFAULT_URL, help=f"where /healthz is (default {DEFAULT_URL})")
        parser.add_argument("--unix-socket", default="", help="connect through this unix socket instead")
        parser.add_argument("--timeout", type=float, default=4.0, help="seconds (default 4)")

    def handle(self, *args: Any, **options: Any) -> None:
        host = probe_host(list(settings.ALLOWED_HOSTS))
        transport = httpx.HTTPTransport(uds=options["unix_socket"]) if options["unix_socket"] else None
        try:
            with httpx.Client(transport=transport, timeout=options["timeout"]) as client:
                response = client.get(options["url"], headers={"Host": host})
        except httpx.HTTPError as exc:
            raise CommandError(f"/healthz did not answer: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise CommandError(f"/healthz answered {response.status_code} for Host {host}")
        self.stdout.write(f"ok (Host {host})")
