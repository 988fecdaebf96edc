"""Settings for bench/load.py --pool: the app's own settings with a bigger upstream connection
pool. WORKERS_AI["max_connections"] (default 100) has no environment variable; at most that many
streams can be open upstream at once, and the next request waits for a free connection (then
fails after the connect timeout)."""

from config.settings import *  # noqa: F403
from config.settings import WORKERS_AI, env

WORKERS_AI["max_connections"] = env.int("BENCH_MAX_CONNECTIONS", default=100)
