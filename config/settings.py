"""Settings, read from the environment in this one place.

Development defaults make `make run` work with no configuration. Code reads
`django.conf.settings`, never `os.environ`, so tests can override anything.
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import django_stubs_ext
import environ
from django.core.exceptions import ImproperlyConfigured

from quotes.conf import (
    Backoff,
    CloudflareGatewayRetries,
    CloudflareGatewaySettings,
    GatewaySettings,
    LocalModelSettings,
    OpenAICompatSettings,
    UpstreamHTTPSettings,
    WorkersAISettings,
)

# Lets typed generics such as admin.ModelAdmin[Persona] work at run time.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

# Off unless asked for: `make run` and `make test` (and the tests' settings) set DJANGO_DEBUG=true.
DEBUG = env.bool("DJANGO_DEBUG", default=False)

#: Known to anyone who reads this file: for development only, refused in production.
DEV_SECRET_KEY = "dev-only-insecure-key-change-me-0123456789abcdef"
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default=DEV_SECRET_KEY if DEBUG else "")
if not DEBUG and SECRET_KEY in ("", DEV_SECRET_KEY):
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY must be set to a secret of your own: DJANGO_DEBUG is off (its default), "
        "and production refuses to start without one or with the development key. For development, "
        "run `make run`, or set DJANGO_DEBUG=true."
    )

ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
if not DEBUG and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("DJANGO_ALLOWED_HOSTS must be set when DJANGO_DEBUG is false.")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # ServeStatic's system checks (its middleware asks for them in development).
    "servestatic",
    "channels",
    "csp",
    # Admin login throttling (failed attempts per client address, in the database).
    "axes",
    # request.htmx (HtmxMiddleware below) instead of reading HX-Request by hand.
    "django_htmx",
    "quotes",
]

# No GZipMiddleware: it buffers streamed bodies, and text/event-stream must never be compressed.
# Every entry is async-native: a sync-only one would put the SSE stream back on a thread.
# Django's own middleware (and django-csp's) run their methods on the event loop, not in a thread
# each: quotes.forks.inline_middleware, checked by the quotes.E001 system check.
MIDDLEWARE = [
    # Outermost: once every other middleware has seen a streaming response, the request's
    # thread is let go (an open stream holds no OS thread).
    "quotes.middleware.ReleaseRequestThreadMiddleware",
    # Then, so every log line of the request (and its response) carries the request id.
    "quotes.logging.RequestIdMiddleware",
    # At the open-stream limit the stream URLs' 503 comes before all of these, ahead of Django's
    # handler (quotes.middleware.StreamAdmissionGate, config/asgi.py), behind these two alone.
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    # ServeStatic (async), asked only about STATIC_URL: no thread hop for any other request.
    "quotes.middleware.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    # Sets request.htmx. Before CSRF: its failure view answers htmx in its own dialect. Sync- and
    # async-capable without MiddlewareMixin, so under ASGI it runs as a coroutine (no thread hop).
    "django_htmx.middleware.HtmxMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into the lockout page. Async-capable,
    # so it costs no thread hop (only a locked-out response renders in a thread).
    "axes.middleware.AxesMiddleware",
    # A view's database outage: a 503 in the request's dialect (only an exception hook: the
    # place in the list does not matter).
    "quotes.middleware.DatabaseOutageMiddleware",
]

# django-axes first: it refuses a locked-out client before the password is even checked, so a
# correct password is refused too while the lock lasts.
AUTHENTICATION_BACKENDS = [
    "quotes.security.LoginThrottleBackend",  # axes' AxesStandaloneBackend, with async support
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "config.urls"
# A failed CSRF check on the persona page's form (posted by htmx) is answered as an error event
# the page can show; any other request gets Django's own page.
CSRF_FAILURE_VIEW = "quotes.views.csrf_failure"
# Messages (the admin's) in their cookie only: Django's default falls back to the session for
# what does not fit, a database write that would put MessageMiddleware back on a thread hop per
# request (quotes.forks.steps_aside). Messages past the cookie's 4 kB are dropped.
MESSAGE_STORAGE = "django.contrib.messages.storage.cookie.CookieStorage"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = None

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Log rows are written from many concurrent streams: wait for the lock instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("DATABASE_CONN_MAX_AGE", default=0)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(env.str("DJANGO_STATIC_ROOT", default=str(BASE_DIR / "staticfiles")))
# Development serves files through the finders, as they are. Production serves collectstatic's
# output: names carry a content hash (cached forever) and each file has a .gz sibling.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "servestatic.storage.CompressedManifestStaticFilesStorage"
    },
}
SERVESTATIC_USE_FINDERS = DEBUG

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# One JSON object per line in production (DJANGO_LOG_FORMAT=json), readable text in development;
# either way every line carries the id of the request it belongs to (quotes/logging.py).
_LOG_FORMATS = ("json", "text")
LOG_FORMAT = env.str("DJANGO_LOG_FORMAT", default="text" if DEBUG else "json")
if LOG_FORMAT not in _LOG_FORMATS:
    raise ImproperlyConfigured(f"DJANGO_LOG_FORMAT must be json or text; got {LOG_FORMAT!r}.")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "request_id": {"()": "quotes.logging.RequestIdFilter"},
        "client_errors": {"()": "quotes.logging.ClientErrorFilter"},
    },
    "formatters": {
        "json": {
            "()": "quotes.logging.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s",
        },
        "text": {
            "()": "quotes.logging.TextFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s",
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["request_id", "client_errors"],
        }
    },
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="INFO")},
    # Django's own handlers off (its default LOGGING, applied before this one): with DEBUG they
    # wrote django.* lines a second time, to stderr without our formatters, so without their
    # redaction (a dev server's access lines with their query strings, tracebacks). Every line
    # goes through the console handler above.
    "loggers": {
        "django": {"handlers": [], "level": "INFO", "propagate": True},
        "django.server": {"handlers": [], "level": "INFO", "propagate": True},
    },
}

# --- Persona Quotes -------------------------------------------------------------------------

CLOUDFLARE_API_TOKEN = env.str("CLOUDFLARE_API_TOKEN", default="")

_AI_BACKENDS = ("local", "workers-ai", "openai")
AI_BACKEND = env.str("AI_BACKEND", default="") or ("workers-ai" if CLOUDFLARE_API_TOKEN else "local")
if AI_BACKEND not in _AI_BACKENDS:
    raise ImproperlyConfigured(f"AI_BACKEND must be one of {', '.join(_AI_BACKENDS)}; got {AI_BACKEND!r}.")

# Where downloaded or assembled artefacts live (the embedded model's GGUF file).
QUOTES_CACHE_DIR = Path(env.str("QUOTES_CACHE_DIR", default=str(Path.home() / ".cache" / "persona-quotes")))
# The log writer's outbox (quotes/ai/gateway/rows.py): log rows the database could not take (down
# or read-only) wait here, one fsync'd file per process, until it can. A local directory: each
# process locks its own file, and the files of processes that died are taken over by the next
# process (on the same database) that starts.
QUOTES_OUTBOX_DIR = Path(env.str("QUOTES_OUTBOX_DIR", default=str(QUOTES_CACHE_DIR / "outbox")))
# The most a process's outbox file holds (a row is about 1-2 KiB): past it, new rows are dropped
# with an ERROR (and counted in quotes_log_rows_lost), so an outage that outlasts it costs rows
# rather than the disk or the memory.
QUOTES_OUTBOX_MAX_BYTES = env.int("QUOTES_OUTBOX_MAX_BYTES", default=64 * 1024 * 1024)

QUOTES_MAX_TOPIC_CHARS = env.int("QUOTES_MAX_TOPIC_CHARS", default=200)
QUOTES_MAX_BODY_BYTES = env.int("QUOTES_MAX_BODY_BYTES", default=64 * 1024)
# A conversation with a persona: how many follow-up turns, and how long each may be.
QUOTES_MAX_TURNS = env.int("QUOTES_MAX_TURNS", default=20)
QUOTES_MAX_MESSAGE_CHARS = env.int("QUOTES_MAX_MESSAGE_CHARS", default=2000)
# A WebSocket frame larger than this is refused before it is parsed (error frame, then close 1009).
QUOTES_MAX_FRAME_BYTES = env.int("QUOTES_MAX_FRAME_BYTES", default=QUOTES_MAX_BODY_BYTES)


_T = TypeVar("_T")


def _positive(name: str, value: float | int | None, *, low: float = 0, high: float | None = None) -> None:
    if value is None:
        return
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ImproperlyConfigured(f"{name} must be {bounds}; got {value}.")


def _env_or_error(name: str, kind: type[_T], default: _T | None) -> _T:
    """Read one variable, turning a bad value into a start-up error that names it. (A None
    default is for optional values: the caller checks for it.)"""
    try:
        return cast(_T, env.get_value(name, cast=kind, default=default))
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"{name} has a bad value: {exc}") from exc


# HTTP to a remote model, the same for the workers-ai and openai backends.
AI_HTTP = UpstreamHTTPSettings(
    # httpx's connect (and pool) timeout, in seconds. Every later wait is the gateway's to bound
    # (QUOTES_TTFT_TIMEOUT, QUOTES_IDLE_TIMEOUT, AI_TOTAL_TIMEOUT).
    connect_timeout_s=_env_or_error("AI_CONNECT_TIMEOUT", float, 5.0),
    # Upstream connections one process may hold: each open stream needs one.
    max_connections=_env_or_error("AI_MAX_CONNECTIONS", int, 1000),
)
_positive("AI_CONNECT_TIMEOUT", AI_HTTP.connect_timeout_s, low=0.01)
# Variables that no longer do anything, each with what does its job now. A deploy that still
# sets one starts, and logs so (quotes.apps): a check warning would stop the deploy's
# `check --deploy --fail-level WARNING` step (docs/deployment.md).
RETIRED_VARIABLES = {
    name: replacement
    for name, replacement in {
        "AI_READ_TIMEOUT": "QUOTES_TTFT_TIMEOUT (to the first token) and QUOTES_IDLE_TIMEOUT (between tokens)",
    }.items()
    if name in env.ENVIRON
}
_positive("AI_MAX_CONNECTIONS", AI_HTTP.max_connections, low=1)

WORKERS_AI = WorkersAISettings(
    account_id=env.str("CLOUDFLARE_ACCOUNT_ID", default=""),
    api_token=CLOUDFLARE_API_TOKEN,
    base_url=env.str("CLOUDFLARE_API_BASE_URL", default="https://api.cloudflare.com/client/v4").rstrip("/"),
)

LOCAL_MODEL = LocalModelSettings(
    path=Path(
        env.str("LOCAL_MODEL_PATH", default=str(QUOTES_CACHE_DIR / "models" / "gemma-3-270m-q4_k_m.gguf"))
    ),
    name="gemma-3-270m",
    n_ctx=_env_or_error("LOCAL_MODEL_N_CTX", int, 1024),
    n_threads=_env_or_error("LOCAL_MODEL_THREADS", int, 2),
    slots=_env_or_error("LOCAL_MODEL_SLOTS", int, 4),
    queue_timeout_s=_env_or_error("LOCAL_MODEL_QUEUE_TIMEOUT", float, 20.0),
    preload=_env_or_error("LOCAL_MODEL_PRELOAD", bool, False),
    prompt_cache_mib=_env_or_error("LOCAL_MODEL_PROMPT_CACHE_MIB", int, 64),
)
_positive("LOCAL_MODEL_SLOTS", LOCAL_MODEL.slots, low=1, high=64)
_positive("LOCAL_MODEL_PROMPT_CACHE_MIB", LOCAL_MODEL.prompt_cache_mib, low=0)
_positive("LOCAL_MODEL_N_CTX", LOCAL_MODEL.n_ctx, low=128)


_BACKOFFS = ("constant", "linear", "exponential")


def _backoff(name: str, default: Backoff | None) -> Backoff | None:
    value = env.str(name, default="") or default
    if value not in (None, *_BACKOFFS):
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(_BACKOFFS)}; got {value!r}.")
    return cast("Backoff | None", value)


# Cloudflare AI Gateway. `id` empty means: call Workers AI directly. Its retries are Cloudflare's
# own, made on its side before we see an answer; the app's retries (QUOTES_MAX_ATTEMPTS below)
# wrap every backend and read none of these.
AI_GATEWAY = CloudflareGatewaySettings(
    id=env.str("AI_GATEWAY_ID", default=""),
    base_url=env.str("AI_GATEWAY_BASE_URL", default="https://gateway.ai.cloudflare.com/v1").rstrip("/"),
    token=env.str("AI_GATEWAY_TOKEN", default=""),
    skip_cache=_env_or_error("AI_GATEWAY_SKIP_CACHE", bool, False),
    cache_ttl=_env_or_error("AI_GATEWAY_CACHE_TTL", int, None),
    cache_key=env.str("AI_GATEWAY_CACHE_KEY", default=""),
    metadata=_env_or_error("AI_GATEWAY_METADATA", dict, {}),
    collect_log=_env_or_error("AI_GATEWAY_COLLECT_LOG", bool, None),
    request_timeout_ms=_env_or_error("AI_GATEWAY_REQUEST_TIMEOUT_MS", int, None),
    retries=CloudflareGatewayRetries(
        max_attempts=_env_or_error("AI_GATEWAY_MAX_ATTEMPTS", int, None),
        retry_delay_ms=_env_or_error("AI_GATEWAY_RETRY_DELAY_MS", int, None),
        backoff=_backoff("AI_GATEWAY_BACKOFF", None),
    ),
)
_positive("AI_GATEWAY_CACHE_TTL", AI_GATEWAY.cache_ttl, low=60, high=2_592_000)
_positive("AI_GATEWAY_REQUEST_TIMEOUT_MS", AI_GATEWAY.request_timeout_ms, low=1)
_positive("AI_GATEWAY_MAX_ATTEMPTS", AI_GATEWAY.retries.max_attempts, low=1, high=5)
_positive("AI_GATEWAY_RETRY_DELAY_MS", AI_GATEWAY.retries.retry_delay_ms, low=0, high=5000)
# These once also set the app's own retries. Without a gateway they would now do nothing at all,
# so a deploy that relied on them stops here instead of silently retrying differently.
for _name, _value, _app_name in (
    ("AI_GATEWAY_MAX_ATTEMPTS", AI_GATEWAY.retries.max_attempts, "QUOTES_MAX_ATTEMPTS"),
    ("AI_GATEWAY_RETRY_DELAY_MS", AI_GATEWAY.retries.retry_delay_ms, "QUOTES_RETRY_DELAY_MS"),
    ("AI_GATEWAY_BACKOFF", AI_GATEWAY.retries.backoff, "QUOTES_RETRY_BACKOFF"),
):
    if _value is not None and not AI_GATEWAY.id:
        raise ImproperlyConfigured(
            f"{_name} sets Cloudflare AI Gateway's retries and needs AI_GATEWAY_ID; "
            f"the app's own retries are {_app_name}."
        )

OPENAI_COMPAT = OpenAICompatSettings(
    base_url=env.str("OPENAI_BASE_URL", default="").rstrip("/"),
    api_key=env.str("OPENAI_API_KEY", default=""),
)

if AI_BACKEND == "workers-ai" and not (WORKERS_AI.account_id and WORKERS_AI.api_token):
    _missing = (
        ("CLOUDFLARE_ACCOUNT_ID", WORKERS_AI.account_id),
        ("CLOUDFLARE_API_TOKEN", WORKERS_AI.api_token),
    )
    raise ImproperlyConfigured(
        "AI_BACKEND=workers-ai needs CLOUDFLARE_ACCOUNT_ID and CLOUDFLARE_API_TOKEN "
        f"(missing: {', '.join(name for name, value in _missing if not value)})."
    )
if AI_BACKEND == "openai" and not OPENAI_COMPAT.base_url:
    raise ImproperlyConfigured("AI_BACKEND=openai needs OPENAI_BASE_URL (e.g. http://127.0.0.1:8080/v1).")

# --- The app's own gateway: cache, rate limits, retries, fallbacks, timeouts ----------------

REDIS_URL = env.str("REDIS_URL", default="")
# Every Redis call is bounded: a Redis that hangs must fail a request in seconds, not hold one of
# the worker threads that cache calls run on (and every request waiting behind it) forever.
_REDIS_CONNECT_TIMEOUT = cast(float, _env_or_error("REDIS_CONNECT_TIMEOUT", float, 2.0))
_REDIS_SOCKET_TIMEOUT = cast(float, _env_or_error("REDIS_SOCKET_TIMEOUT", float, 2.0))
_positive("REDIS_CONNECT_TIMEOUT", _REDIS_CONNECT_TIMEOUT, low=0.001)
_positive("REDIS_SOCKET_TIMEOUT", _REDIS_SOCKET_TIMEOUT, low=0.001)
REDIS_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": _REDIS_CONNECT_TIMEOUT,
    "socket_timeout": _REDIS_SOCKET_TIMEOUT,
    # JSON, not Django's pickle: whoever can write to Redis must not run code in every process.
    "serializer": "quotes.ai.cache.JSONSerializer",
}
CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": REDIS_OPTIONS,
        }
        if REDIS_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "persona-quotes"}
    )
}

_RATE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _parse_rate(name: str, value: str) -> tuple[int, int]:
    """ "20/m" -> (20, 60): at most 20 requests per fixed one-minute window."""
    count, _, unit = value.partition("/")
    if not count.isdigit() or int(count) < 1 or unit not in _RATE_UNITS:
        raise ImproperlyConfigured(f"{name} must look like 20/m (a count per s, m, h or d); got {value!r}.")
    return int(count), _RATE_UNITS[unit]


_CLIENT_RATE = _parse_rate("QUOTES_RATE_LIMIT", env.str("QUOTES_RATE_LIMIT", default="20/m"))
#: Unless QUOTES_NETWORK_RATE_LIMIT says otherwise, a network may ask this many times what one
#: client may: a household or an office shares one /24 or /48.
NETWORK_RATE_FACTOR = 6
QUOTES_GATEWAY = GatewaySettings(
    # Our cache sits in front of every backend: QUOTES_CACHE_TTL, else the gateway's TTL, else an
    # hour. 0 turns it off; a persona may override it.
    cache_ttl=_env_or_error("QUOTES_CACHE_TTL", int, None)
    if env.str("QUOTES_CACHE_TTL", default="")
    else AI_GATEWAY.cache_ttl or 3600,
    skip_cache=AI_GATEWAY.skip_cache,
    # A cache hit is replayed as a stream, one token every N ms, so it still reads as writing.
    replay_pacing_ms=_env_or_error("QUOTES_CACHE_REPLAY_PACING_MS", int, 5),
    # Per client (the user when logged in, else the IP's network): a fixed window, shared
    # through the cache.
    rate_limit=_CLIENT_RATE,
    # Per network (QUOTES_IPV6_NETWORK_PREFIX / QUOTES_IPV4_NETWORK_PREFIX): a second, higher
    # budget, so that many addresses of one delegation do not each get a client's whole budget.
    network_rate_limit=_parse_rate("QUOTES_NETWORK_RATE_LIMIT", env.str("QUOTES_NETWORK_RATE_LIMIT"))
    if env.str("QUOTES_NETWORK_RATE_LIMIT", default="")
    else (_CLIENT_RATE[0] * NETWORK_RATE_FACTOR, _CLIENT_RATE[1]),
    # Thumbs up/down posted per client, counted apart from quotes.
    feedback_rate_limit=_parse_rate(
        "QUOTES_FEEDBACK_RATE_LIMIT", env.str("QUOTES_FEEDBACK_RATE_LIMIT", default="30/m")
    ),
    max_concurrent_streams=_env_or_error("QUOTES_MAX_CONCURRENT_STREAMS", int, 3),
    # Per process, whoever asks: past its limit a stream is refused at once with 503 and
    # Retry-After, so the streams a process already holds keep their pace. The limit follows the
    # event loop's lag (quotes.ai.gateway.capacity): it holds what this host holds, with no
    # number to size per host. QUOTES_MAX_OPEN_STREAMS is an optional static ceiling on it (0:
    # none); QUOTES_LOOP_LAG_TARGET_MS=0 turns the adaptive limit off (only the ceiling then).
    max_open_streams=_env_or_error("QUOTES_MAX_OPEN_STREAMS", int, 0),
    loop_lag_target_ms=_env_or_error("QUOTES_LOOP_LAG_TARGET_MS", float, 5.0),
    # The floor: a burst of new streams lags the loop by their set-up (4-5 ms of loop time each),
    # not by the tokens of what it holds, so a limit that followed the lag alone refused a
    # 50-stream burst on one process; 50 streams cost a 2-core host's loop a fraction of a core.
    min_open_streams=_env_or_error("QUOTES_MIN_OPEN_STREAMS", int, 50),
    # Retries before the first token, for connection errors, 5xx, 3040 and first-token timeouts,
    # whatever the backend. One variable each: Cloudflare AI Gateway's own retries (above) are
    # another layer and set none of these.
    max_attempts=_env_or_error("QUOTES_MAX_ATTEMPTS", int, 2),
    retry_delay_ms=_env_or_error("QUOTES_RETRY_DELAY_MS", int, 250),
    backoff=cast(Backoff, _backoff("QUOTES_RETRY_BACKOFF", "exponential")),
    # Tried in order after a persona's own fallbacks, only before the first token.
    fallback_models=tuple(env.list("QUOTES_FALLBACK_MODELS", default=[])),
    # The total wait for a first token, across every attempt and fallback: headers wait for it,
    # so it stays well under a load balancer's usual 60 s idle timeout.
    ttft_timeout_s=_env_or_error("QUOTES_TTFT_TIMEOUT", float, 30.0),
    idle_timeout_s=_env_or_error("QUOTES_IDLE_TIMEOUT", float, 30.0),
    # The whole generation, whatever the backend (its name predates the app's gateway).
    total_timeout_s=_env_or_error("AI_TOTAL_TIMEOUT", float, 120.0),
    keepalive_s=_env_or_error("QUOTES_KEEPALIVE_INTERVAL", float, 15.0),
    # On SIGTERM (a deploy), open streams may finish for this long; later ones are told to
    # resume elsewhere. 20 s covers nearly every quote and stays under the stop timeouts of
    # systemd (TimeoutStopSec=45 in deploy/systemd) and Kubernetes (30 s); docs/deployment.md.
    drain_timeout_s=_env_or_error("QUOTES_DRAIN_TIMEOUT_S", float, 20.0),
    # A dropped connection keeps its generation running this long so the client can resume it
    # (Last-Event-ID); a finished one's events stay in the cache this long for a late resume.
    resume_grace_s=_env_or_error("QUOTES_RESUME_GRACE_S", float, 10.0),
    resume_ttl_s=_env_or_error("QUOTES_RESUME_TTL_S", int, 300),
)
for _name, _key in (
    ("QUOTES_MAX_CONCURRENT_STREAMS", "max_concurrent_streams"),
    ("QUOTES_MIN_OPEN_STREAMS", "min_open_streams"),
    ("QUOTES_MAX_ATTEMPTS", "max_attempts"),
):
    _positive(_name, getattr(QUOTES_GATEWAY, _key), low=1)
_positive("QUOTES_MAX_OPEN_STREAMS", QUOTES_GATEWAY.max_open_streams, low=0)
_positive("QUOTES_LOOP_LAG_TARGET_MS", QUOTES_GATEWAY.loop_lag_target_ms, low=0)
for _name, _key in (
    ("QUOTES_TTFT_TIMEOUT", "ttft_timeout_s"),
    ("QUOTES_IDLE_TIMEOUT", "idle_timeout_s"),
    ("QUOTES_KEEPALIVE_INTERVAL", "keepalive_s"),
):
    _positive(_name, getattr(QUOTES_GATEWAY, _key), low=0.001)
_positive("AI_TOTAL_TIMEOUT", QUOTES_GATEWAY.total_timeout_s, low=0.01)
_positive("QUOTES_CACHE_TTL", QUOTES_GATEWAY.cache_ttl, low=0)
_positive("QUOTES_RETRY_DELAY_MS", QUOTES_GATEWAY.retry_delay_ms, low=0)
_positive("QUOTES_DRAIN_TIMEOUT_S", QUOTES_GATEWAY.drain_timeout_s, low=0)
_positive("QUOTES_RESUME_GRACE_S", QUOTES_GATEWAY.resume_grace_s, low=0, high=300)
_positive("QUOTES_RESUME_TTL_S", QUOTES_GATEWAY.resume_ttl_s, low=0)

# --- Who the client is ----------------------------------------------------------------------

# An anonymous visitor is counted by address. One IPv6 host usually holds a whole /64 and can
# pick any address in it, so IPv6 addresses count by their network of this length (IPv4
# addresses, and IPv4-mapped IPv6 ones, count whole).
QUOTES_IPV6_PREFIX = cast(int, _env_or_error("QUOTES_IPV6_PREFIX", int, 64))
_positive("QUOTES_IPV6_PREFIX", QUOTES_IPV6_PREFIX, low=1, high=128)
# The networks the second, coarser rate limit counts by (QUOTES_NETWORK_RATE_LIMIT): an IPv6 /48
# is what one site or one provider's customer is usually given; an IPv4 /24, one small network.
QUOTES_IPV6_NETWORK_PREFIX = cast(int, _env_or_error("QUOTES_IPV6_NETWORK_PREFIX", int, 48))
_positive("QUOTES_IPV6_NETWORK_PREFIX", QUOTES_IPV6_NETWORK_PREFIX, low=1, high=128)
QUOTES_IPV4_NETWORK_PREFIX = cast(int, _env_or_error("QUOTES_IPV4_NETWORK_PREFIX", int, 24))
_positive("QUOTES_IPV4_NETWORK_PREFIX", QUOTES_IPV4_NETWORK_PREFIX, low=1, high=32)

# Peers whose X-Forwarded-For / X-Forwarded-Proto are believed (quotes/security.py): addresses
# or networks, and `unix` for a unix socket (no peer address). Anyone else's copy is ignored, so
# a visitor who reaches daphne directly cannot pick the address rate limits count against. The
# default trusts only this machine: nginx on the same host, as deploy/ sets it up.
QUOTES_TRUSTED_PROXIES = env.list("QUOTES_TRUSTED_PROXIES", default=["127.0.0.0/8", "::1", "unix"])
for _proxy in QUOTES_TRUSTED_PROXIES:
    if _proxy != "unix":
        try:
            ipaddress.ip_network(_proxy, strict=False)
        except ValueError:
            raise ImproperlyConfigured(
                f"QUOTES_TRUSTED_PROXIES entries must be addresses, networks (CIDR) or `unix`; got {_proxy!r}."
            ) from None

# --- Admin login throttling (django-axes) ---------------------------------------------------

# After this many failed logins from one client address (an IPv6 address's network, as above),
# every login from there is refused, a right password included, until the cool-off has passed.
AXES_FAILURE_LIMIT = cast(int, _env_or_error("QUOTES_LOGIN_FAILURE_LIMIT", int, 5))
_positive("QUOTES_LOGIN_FAILURE_LIMIT", AXES_FAILURE_LIMIT, low=1)
_login_cooloff_minutes = cast(float, _env_or_error("QUOTES_LOGIN_COOLOFF_MINUTES", float, 15.0))
_positive("QUOTES_LOGIN_COOLOFF_MINUTES", _login_cooloff_minutes, low=0.01)
AXES_COOLOFF_TIME = timedelta(minutes=_login_cooloff_minutes)
# By address only: locking by username would let anyone lock an admin out of their account.
AXES_LOCKOUT_PARAMETERS = ["ip_address"]
AXES_CLIENT_IP_CALLABLE = "quotes.security.login_client_address"
AXES_LOCKOUT_CALLABLE = "quotes.security.login_locked_out"
# axes' database handler, storing no field, username or password a client sent (else each failed
# login, lockout included, appended its fields to the client's row, without bound).
AXES_HANDLER = "quotes.security.LoginFailureHandler"
AXES_RESET_ON_SUCCESS = True
# No "AXES: BEGIN" line at every start-up; lockouts are still logged (as warnings).
AXES_VERBOSE = False

# --- Shared state across processes ----------------------------------------------------------

# With REDIS_URL every daphne process shares one cache (answers, rate-limit counters, stream
# slots) and one channel layer; without it each process keeps its own, in memory.
CHANNEL_LAYERS = {
    "default": (
        {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
        if REDIS_URL
        else {"BACKEND": "channels.layers.InMemoryChannelLayer"}
    )
}

# --- Metrics (Prometheus, GET /metrics) -----------------------------------------------------

# On by default: recording costs a few counter increments per stream, nothing per token.
QUOTES_METRICS_ENABLED = _env_or_error("QUOTES_METRICS_ENABLED", bool, True)
# The endpoint is closed unless one of these is set; when both are, a scrape must pass both.
QUOTES_METRICS_TOKEN = env.str("QUOTES_METRICS_TOKEN", default="")


def _networks(name: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """ "10.0.0.7,192.168.1.0/24,::1" -> networks; a bare address is a network of one."""
    try:
        return tuple(ipaddress.ip_network(item, strict=False) for item in env.list(name, default=[]))
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} has a bad value: {exc}") from exc


QUOTES_METRICS_ALLOW = _networks("QUOTES_METRICS_ALLOW")

# --- Logging of content ---------------------------------------------------------------------

# Prompts, topics and answers stay out of the logs (the access line drops the query string, which
# can carry a topic) unless this is on: they are the visitors' words, and the Generation table
# already keeps them where admins can see them.
QUOTES_LOG_CONTENT = _env_or_error("QUOTES_LOG_CONTENT", bool, False)

# --- Retention of the request log (`manage.py prune_generations`, run daily) ----------------

# Log rows older than this many days are deleted; 0 keeps them all.
QUOTES_LOG_RETENTION_DAYS = cast(int, _env_or_error("QUOTES_LOG_RETENTION_DAYS", int, 90))
# Quotes someone rated or shared (the page's Permalink or Copy button) are kept this long instead
# (0: for good), with their request, upstream headers, topic and client hash cleared after the log
# retention.
QUOTES_KEPT_QUOTE_RETENTION_DAYS = cast(int, _env_or_error("QUOTES_KEPT_QUOTE_RETENTION_DAYS", int, 0))
_positive("QUOTES_LOG_RETENTION_DAYS", QUOTES_LOG_RETENTION_DAYS, low=0)
_positive("QUOTES_KEPT_QUOTE_RETENTION_DAYS", QUOTES_KEPT_QUOTE_RETENTION_DAYS, low=0)
if 0 < QUOTES_KEPT_QUOTE_RETENTION_DAYS < QUOTES_LOG_RETENTION_DAYS or (
    QUOTES_KEPT_QUOTE_RETENTION_DAYS and not QUOTES_LOG_RETENTION_DAYS
):
    raise ImproperlyConfigured(
        "QUOTES_KEPT_QUOTE_RETENTION_DAYS keeps rated and shared quotes longer than the log: "
        "make it 0 (for good) or at least QUOTES_LOG_RETENTION_DAYS."
    )

# --- HTTPS, cookies and browser security headers --------------------------------------------
#
# Secure by default: with DJANGO_DEBUG=false everything below is on unless turned off by name.
# `manage.py check --deploy` passes clean on these defaults, nothing silenced, once the domain's
# owner has answered DJANGO_SECURE_HSTS_PRELOAD (below; tests/deploy/test_deploy.py runs it).

CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])
for _origin in CSRF_TRUSTED_ORIGINS:
    if "://" not in _origin:
        raise ImproperlyConfigured(
            f"DJANGO_CSRF_TRUSTED_ORIGINS entries need a scheme (https://quotes.example.com); got {_origin!r}."
        )

# Behind a TLS-terminating proxy (nginx) that sets X-Forwarded-Proto and strips any client copy.
if _env_or_error("DJANGO_SECURE_PROXY_SSL_HEADER", bool, False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = _env_or_error("DJANGO_SECURE_SSL_REDIRECT", bool, not DEBUG)
# Load balancers and monitors call /healthz, and Prometheus /metrics, over plain HTTP on the
# process's own port.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SESSION_COOKIE_SECURE = _env_or_error("DJANGO_SECURE_COOKIES", bool, not DEBUG)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_HSTS_SECONDS = _env_or_error("DJANGO_SECURE_HSTS_SECONDS", int, 0 if DEBUG else 31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_or_error("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", bool, not DEBUG)
SECURE_HSTS_PRELOAD = _env_or_error("DJANGO_SECURE_HSTS_PRELOAD", bool, False)
# Nothing of Django's checks is silenced. Asking browsers to preload the domain is a commitment
# for the whole domain that only its owner can make: until DJANGO_SECURE_HSTS_PRELOAD=true,
# `check --deploy` says so (security.W021), and docs/deployment.md asks the owner to decide.
SECURE_CONTENT_TYPE_NOSNIFF = True  # X-Content-Type-Options: nosniff
SECURE_REFERRER_POLICY = env.str("DJANGO_REFERRER_POLICY", default="same-origin")
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

# Content-Security-Policy (django-csp), the same in development so the browser tests enforce it:
# scripts, styles and connections only from this origin, nothing inline. 'self' in connect-src
# covers the same-origin WebSocket (ws:/wss:) too.
_SELF = "'self'"
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [_SELF],
        "script-src": [_SELF],
        "style-src": [_SELF],
        "img-src": [_SELF, "data:"],
        "font-src": [_SELF],
        "connect-src": [_SELF],
        "object-src": ["'none'"],
        "base-uri": [_SELF],
        "form-action": [_SELF],
        "frame-ancestors": ["'none'"],
    }
}
