"""Settings for the naive Django proxy (bench/naive): no apps, no middleware, no database.

The upstream it forwards to comes from the environment, set by the benchmark that starts it:
BENCH_UPSTREAM_URL (the full URL to POST to) and BENCH_UPSTREAM_HEADERS (a JSON object).
"""

from __future__ import annotations

SECRET_KEY = "bench-only-naive-proxy-0123456789abcdefghijklmnopqrstuvwxyz"
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS: list[str] = []
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "bench.naive.views"
DATABASES: dict[str, object] = {}
USE_TZ = True
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}
