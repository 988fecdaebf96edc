"""The tests' settings: config/settings.py in development mode, asked for explicitly (its default
is production's, which refuses the development key). The servers and commands the tests start
inherit DJANGO_DEBUG from this process unless they set it themselves."""

from __future__ import annotations

import os

os.environ["DJANGO_DEBUG"] = "true"
# No trace leaves a test run for a collector this shell points at: tests that want traces start
# their own receiver (tests/log/test_tracing.py).
for _name in [name for name in os.environ if name.startswith("OTEL_")]:
    del os.environ[_name]

from config.settings import *  # noqa: F403, E402

# A fast hash for the test users' passwords (Django's own advice for tests): what is tested is the
# login flow and its throttling, not PBKDF2's cost.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
