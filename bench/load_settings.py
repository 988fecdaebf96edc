"""Settings for bench/load.py --pool: the app's own settings with the upstream connection pool
sized by BENCH_MAX_CONNECTIONS (default 100) rather than AI_MAX_CONNECTIONS. At most that many
streams can be open upstream at once, and the next request waits for a free connection (then
fails after the connect timeout)."""

from dataclasses import replace

from config.settings import *  # noqa: F403
from config.settings import AI_HTTP, env

AI_HTTP = replace(AI_HTTP, max_connections=env.int("BENCH_MAX_CONNECTIONS", default=100))
