"""The same-stack baseline: the app's own settings (config.settings: its middleware, database,
logging and all), with the naive proxy (views.py) added at NAIVE_PATH beside the app's URLs. Served
as the app is (`python -m quotes.ops.server ... config.asgi:application`, with
DJANGO_SETTINGS_MODULE=bench.naive.stack_settings), one daphne answers both `/api/quotes/stream`
(the app) and NAIVE_PATH (the naive view under the app's whole middleware), so the baseline pays
what Django's stack pays and the two can be interleaved request by request."""

from __future__ import annotations

from config.settings import *  # noqa: F403

ROOT_URLCONF = "bench.naive.stack_urls"
# The benches that serve the app with these settings measure what a stream costs (bench.load, at
# N streams at once), not who is admitted: no admission by the event loop's lag.
QUOTES_LAG_ADMISSION = False
