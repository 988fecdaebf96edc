"""Settings, read from the environment in this one place (README.md, "Configuration"): development
defaults for `make run`; production (DJANGO_DEBUG off, the default) refuses to start without its
secrets. Code reads `django.conf.settings`, never `os.environ`, so tests can override anything."""

from __future__ import annotations

import ipaddress
import math
import re
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import django_stubs_ext
import environ
from django.core.exceptions import ImproperlyConfigured
from limits import parse
from streaming import Policy

django_stubs_ext.monkeypatch()  # typed generics such as admin.ModelAdmin[Persona] at run time

BASE_DIR = Path(__file__).resolve().parent.parent


class Env(environ.Env):
    def get_value(self, var: str, *args: Any, **kwargs: Any) -> Any:
        """A bad value is refused by the name of its variable."""
        try:
            return super().get_value(var, *args, **kwargs)
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise ImproperlyConfigured(f"{var} has a bad value: {exc}") from None

    def number(self, var: str, *, default: Any, low: float, high: float, integer: bool = False) -> Any:
        """A finite number from `low` to `high` (NaN, Infinity, 1e400 and the like are refused),
        else start-up stops with the variable's name and the form it takes."""
        raw = self.str(var, default="").strip()
        if not raw:
            return default
        try:
            value: float = int(raw) if integer else float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            kind = "a whole number" if integer else "a number"
            raise ImproperlyConfigured(
                f"{var} must be {kind} from {_show(low)} to {_show(high)}; got {raw!r}."
            )
        return value

    def dollars(self, var: str, *, high: Decimal) -> Decimal | None:
        """An amount of US dollars from 0 to `high`, or None when unset."""
        raw = self.str(var, default="").strip()
        if not raw:
            return None
        try:
            value = Decimal(raw)
        except ArithmeticError:
            value = Decimal("NaN")
        if not (value.is_finite() and 0 <= value <= high):
            raise ImproperlyConfigured(
                f"{var} must be an amount of US dollars from 0 to {high}, such as 5.00; got {raw!r}."
            )
        return value

    def rate(self, var: str, *, default: str) -> str:
        """A rate in the `limits` package's notation, such as 20/minute; `20/m` (the habit other
        Django rate limiters teach) is taken as 20/minute. At least one request per period."""
        raw = self.str(var, default=default).strip()
        match = _RATE.fullmatch(raw.lower())
        unit = _UNITS.get(match["unit"], "") if match else ""
        if not match or not unit or int(match["amount"]) < 1 or int(match["multiples"] or 1) < 1:
            raise ImproperlyConfigured(
                f"{var} must be a rate such as 20/minute or 100/2 hours (per second, minute, hour or day); got {raw!r}."
            )
        multiples = int(match["multiples"] or 1)
        rate = (
            f"{int(match['amount'])}/{multiples} {unit}"
            if multiples > 1
            else f"{int(match['amount'])}/{unit}"
        )
        parse(rate)  # the notation the `limits` package reads
        return rate


def _show(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


_RATE = re.compile(r"(?P<amount>\d+)\s*(?:/|per)\s*(?P<multiples>\d*)\s*(?P<unit>[a-z]+)")
_UNITS = {
    **{name: name for name in ("second", "minute", "hour", "day")},
    **{name + "s": name for name in ("second", "minute", "hour", "day")},
    **{"s": "second", "sec": "second", "m": "minute", "min": "minute", "h": "hour", "hr": "hour", "d": "day"},
}


env = Env()


def _check(name: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ImproperlyConfigured(f"{name} must be {expected}.")


def _network(value: str) -> bool:
    try:
        return value == "unix" or bool(ipaddress.ip_network(value, strict=False))
    except ValueError:
        return False


DEBUG = env.bool("DJANGO_DEBUG", default=False)
DEV_SECRET_KEY = "dev-only-insecure-key-change-me-0123456789abcdef"
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default=DEV_SECRET_KEY if DEBUG else "")
_check(
    "DJANGO_SECRET_KEY",
    DEBUG or SECRET_KEY not in ("", DEV_SECRET_KEY),
    "a secret of your own when DJANGO_DEBUG is off (its default); for development run `make run`",
)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
_check("DJANGO_ALLOWED_HOSTS", DEBUG or bool(ALLOWED_HOSTS), "set when DJANGO_DEBUG is off")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "servestatic",
    "channels",
    "csp",
    "axes",  # admin login throttling
    "quotes",
]

# Django's request cycle as shipped, its own middleware (and django-csp's) each run without a
# thread hop (quotes.ops.middleware: the same classes, their hooks called in the event loop).
# No GZipMiddleware: it buffers streamed bodies.
MIDDLEWARE = [
    "quotes.ops.logging.RequestIdMiddleware",
    "quotes.ops.middleware.SecurityMiddleware",
    "quotes.ops.middleware.CSPMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",
    "quotes.ops.middleware.SessionMiddleware",
    "quotes.ops.middleware.CommonMiddleware",
    "quotes.ops.middleware.CsrfViewMiddleware",
    "quotes.ops.middleware.AuthenticationMiddleware",
    "quotes.ops.middleware.MessageMiddleware",
    "quotes.ops.middleware.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",
    "quotes.views.DatabaseOutageMiddleware",
]
# Django's "middleware missing" warnings look for its dotted paths: quotes.checks runs its
# security checks as if MIDDLEWARE named them, and gives these three when a class is missing.
SILENCED_SYSTEM_CHECKS = ["security.W001", "security.W002", "security.W003"]
AUTHENTICATION_BACKENDS = [
    "quotes.security.LoginThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
CSRF_FAILURE_VIEW = "quotes.views.csrf_failure"
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
            ]
        },
    }
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Rows come from many streams at once: wait for the lock; readers read meanwhile (WAL).
    DATABASES["default"].setdefault("OPTIONS", {}).update(timeout=20, init_command="PRAGMA journal_mode=WAL;")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": f"django.contrib.auth.password_validation.{name}"}
    for name in ("UserAttributeSimilarityValidator", "MinimumLengthValidator", "CommonPasswordValidator")
]
LANGUAGE_CODE, TIME_ZONE, USE_I18N, USE_TZ = "en-us", "UTC", True, True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Production serves collectstatic's output: hashed names, cached for good, with .gz siblings.
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "servestatic.storage.CompressedManifestStaticFilesStorage"
    },
}
SERVESTATIC_USE_FINDERS = DEBUG

# One JSON object per line in production, text in development; every line has its request id,
# and no line has a credential or a query string (visitors' topics travel in them).
_FORMAT = "%(asctime)s %(levelname)s %(name)s "
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "request_id": {"()": "quotes.ops.logging.RequestIdFilter"},
        "client_errors": {"()": "quotes.ops.logging.ClientErrorFilter"},
    },
    "formatters": {
        "json": {"()": "quotes.ops.logging.JsonFormatter", "fmt": _FORMAT + "%(message)s %(request_id)s"},
        "text": {"()": "quotes.ops.logging.TextFormatter", "fmt": _FORMAT + "[%(request_id)s] %(message)s"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "text" if DEBUG else "json",
            "filters": ["request_id", "client_errors"],
        }
    },
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="INFO")},
    "loggers": {
        **{
            name: {"handlers": [], "level": "INFO", "propagate": True} for name in ("django", "django.server")
        },
        # httpx logs each request's URL at INFO: the Cloudflare account and gateway ids with it.
        **{name: {"level": "WARNING"} for name in ("httpx", "httpcore")},
    },
}
# The DEBUG error page hides every setting named like a credential; these hold one inside.
DEFAULT_EXCEPTION_REPORTER_FILTER = "quotes.ops.logging.SecretsFilter"

REDIS_URL = env.str("REDIS_URL", default="")  # shared by several processes: answers, rate limits, spend
_LOCAL = "django.core.cache.backends.locmem.LocMemCache"
_REDIS = {
    "BACKEND": "django.core.cache.backends.redis.RedisCache",
    "LOCATION": REDIS_URL,
    "OPTIONS": {
        "serializer": "quotes.cache.JSONSerializer",
        "socket_connect_timeout": 2,
        "socket_timeout": 2,
    },
}
CACHES = {
    "default": _REDIS if REDIS_URL else {"BACKEND": _LOCAL, "LOCATION": "answers"},
    # Counters (the daily spend) must never be culled to make room for answers.
    "counters": _REDIS
    if REDIS_URL
    else {"BACKEND": _LOCAL, "LOCATION": "counters", "OPTIONS": {"MAX_ENTRIES": 10**9}},
}

# --- The model ------------------------------------------------------------------------------
CLOUDFLARE_ACCOUNT_ID = env.str("CLOUDFLARE_ACCOUNT_ID", default="")
CLOUDFLARE_API_TOKEN = env.str("CLOUDFLARE_API_TOKEN", default="")
CLOUDFLARE_API_BASE_URL = env.str("CLOUDFLARE_API_BASE_URL", default="https://api.cloudflare.com/client/v4")
AI_BACKEND = env.str("AI_BACKEND", default="") or ("workers-ai" if CLOUDFLARE_API_TOKEN else "local")
_check("AI_BACKEND", AI_BACKEND in ("local", "workers-ai", "openai"), "local, workers-ai or openai")
AI_GATEWAY_ID = env.str("AI_GATEWAY_ID", default="")
AI_GATEWAY_BASE_URL = env.str("AI_GATEWAY_BASE_URL", default="https://gateway.ai.cloudflare.com/v1")
AI_GATEWAY_TOKEN = env.str("AI_GATEWAY_TOKEN", default="")
AI_GATEWAY_SKIP_CACHE = env.bool("AI_GATEWAY_SKIP_CACHE", default=False)
AI_GATEWAY_CACHE_TTL = env.number("AI_GATEWAY_CACHE_TTL", default=None, low=60, high=2_592_000, integer=True)
OPENAI_BASE_URL = env.str("OPENAI_BASE_URL", default="")
OPENAI_API_KEY = env.str("OPENAI_API_KEY", default="")

_MODEL = Path.home() / ".cache/persona-quotes/models/gemma-3-270m-q4_k_m.gguf"
LOCAL_MODEL_PATH = Path(env.str("LOCAL_MODEL_PATH", default=str(_MODEL)))
LOCAL_MODEL_THREADS = env.number("LOCAL_MODEL_THREADS", default=2, low=1, high=256, integer=True)
LOCAL_MODEL_SLOTS = env.number("LOCAL_MODEL_SLOTS", default=4, low=1, high=64, integer=True)
LOCAL_MODEL_PRELOAD = env.bool("LOCAL_MODEL_PRELOAD", default=False)

# --- Streams ----------------------------------------------------------------------------------

# Two attempts per model; the first-token deadline is across every attempt: the headers wait for it.
QUOTES_POLICY = Policy(
    ttft_timeout_s=env.number("QUOTES_TTFT_TIMEOUT", default=30.0, low=0.1, high=3600),
    total_timeout_s=env.number("AI_TOTAL_TIMEOUT", default=120.0, low=0.1, high=3600),
)
QUOTES_FALLBACK_MODELS = env.list("QUOTES_FALLBACK_MODELS", default=[])
QUOTES_CACHE_TTL = env.number(
    "QUOTES_CACHE_TTL", default=AI_GATEWAY_CACHE_TTL or 3600, low=0, high=2_592_000, integer=True
)
QUOTES_CACHE_REPLAY_PACING_MS = 5
QUOTES_KEEPALIVE_S = 15.0
QUOTES_RESUME_GRACE_S = env.number("QUOTES_RESUME_GRACE_S", default=10.0, low=0, high=300)
QUOTES_RESUME_TTL_S = 300
QUOTES_DRAIN_TIMEOUT_S = env.number("QUOTES_DRAIN_TIMEOUT_S", default=20.0, low=0, high=3600)

# Admission (quotes/admission.py). The event loop's lag decides, with nothing to tune; off (no
# variable: bench/naive/stack_settings.py, for benches that measure a stream's cost, not who is
# admitted), only the ceiling limits.
QUOTES_MAX_OPEN_STREAMS = env.number(
    "QUOTES_MAX_OPEN_STREAMS", default=100, low=1, high=1_000_000, integer=True
)
QUOTES_LAG_ADMISSION = True
QUOTES_MAX_CONCURRENT_STREAMS = env.number(
    "QUOTES_MAX_CONCURRENT_STREAMS", default=3, low=1, high=1_000_000, integer=True
)
QUOTES_RATE_LIMIT = env.rate("QUOTES_RATE_LIMIT", default="20/minute")
QUOTES_FEEDBACK_RATE_LIMIT = env.rate("QUOTES_FEEDBACK_RATE_LIMIT", default="30/minute")
QUOTES_DAILY_SPEND_LIMIT_USD = env.dollars("QUOTES_DAILY_SPEND_LIMIT_USD", high=Decimal(1_000_000))
QUOTES_MAX_SOCKETS = 8
QUOTES_SOCKET_IDLE_S = 60.0

QUOTES_MAX_TOPIC_CHARS, QUOTES_MAX_TURNS, QUOTES_MAX_MESSAGE_CHARS = 200, 20, 2000
QUOTES_MAX_BODY_BYTES = QUOTES_MAX_FRAME_BYTES = 64 * 1024

# Who the client is: an IPv6 address counts by its /64; the network limit by /24 and /48.
QUOTES_IPV6_PREFIX, QUOTES_IPV6_NETWORK_PREFIX, QUOTES_IPV4_NETWORK_PREFIX = 64, 48, 24
# Peers whose X-Forwarded-For / -Proto are believed: nginx on this host, by default.
QUOTES_TRUSTED_PROXIES = env.list("QUOTES_TRUSTED_PROXIES", default=["127.0.0.0/8", "::1", "unix"])
_check("QUOTES_TRUSTED_PROXIES", all(map(_network, QUOTES_TRUSTED_PROXIES)), "addresses, networks or `unix`")

# --- Operations -------------------------------------------------------------------------------

QUOTES_METRICS_ENABLED = True
QUOTES_METRICS_TOKEN = env.str("QUOTES_METRICS_TOKEN", default="")
_allow = env.list("QUOTES_METRICS_ALLOW", default=[])
_check("QUOTES_METRICS_ALLOW", "unix" not in _allow and all(map(_network, _allow)), "addresses or networks")
QUOTES_METRICS_ALLOW = tuple(ipaddress.ip_network(item, strict=False) for item in _allow)
QUOTES_LOG_CONTENT = False  # topics and quotes stay out of the logs (the admin has them)
QUOTES_LOG_RETENTION_DAYS = env.number(
    "QUOTES_LOG_RETENTION_DAYS", default=90, low=0, high=36_500, integer=True
)
QUOTES_KEPT_QUOTE_RETENTION_DAYS = 0  # rated and shared quotes: kept for good

AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = ["ip_address"]  # by address: locking by username locks admins out
AXES_CLIENT_IP_CALLABLE = "quotes.security.login_client_address"
AXES_LOCKOUT_CALLABLE = "quotes.security.login_locked_out"
AXES_HANDLER = "quotes.security.LoginFailureHandler"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False

# --- HTTPS, cookies, browser security headers: secure unless DJANGO_DEBUG -------------------

CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])
for _origin in CSRF_TRUSTED_ORIGINS:
    _check("DJANGO_CSRF_TRUSTED_ORIGINS", "://" in _origin, f"origins with a scheme; got {_origin!r}")
if env.bool("DJANGO_SECURE_PROXY_SSL_HEADER", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]  # load balancers and Prometheus, on plain HTTP
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = not DEBUG
SECURE_HSTS_SECONDS = 0 if DEBUG else 31_536_000
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
# Preloading commits the whole domain: only its owner can say so (docs/deployment.md).
SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=False)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# The same in development, so the browser tests enforce it: nothing inline, this origin only.
_SELF = ("default-src", "script-src", "style-src", "font-src", "connect-src", "base-uri", "form-action")
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        **{name: ["'self'"] for name in _SELF},
        "img-src": ["'self'", "data:"],
        "object-src": ["'none'"],
        "frame-ancestors": ["'none'"],
    }
}
