"""Request ids on every log line, the levels of Django's request lines, and formatters that blank
out the configured credentials and every query string (visitors' topics travel in them).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.views.debug import SafeExceptionReporterFilter
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

REQUEST_ID_HEADER = "X-Request-ID"
#: ids taken from the proxy: no spaces, quotes or newlines can reach a log line this way
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_request_id: ContextVar[str] = ContextVar("request_id", default="-")

access_logger = logging.getLogger("quotes.request")


class RequestIdMiddleware:
    """Async-native: takes the proxy's X-Request-ID or makes one, for the request's task (which
    also streams the body), returns it, and logs one access line per request."""

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER, ""))
        token = _request_id.set(request_id)
        started = time.perf_counter()
        response = await self.get_response(request)
        response[REQUEST_ID_HEADER] = request_id
        if response.status_code == 503 and response.has_header("Retry-After"):
            # Read by ClientErrorFilter on django.request's line, logged after this returns.
            request.announced_refusal = True  # type: ignore[attr-defined]
        path = request.get_full_path() if settings.QUOTES_LOG_CONTENT else request.path
        log_access(request.method or "", path, response.status_code, started, streaming=response.streaming)
        if not response.streaming:
            # A streamed body is sent later by this same task and its lines keep the id; else
            # forget it, so a caller sharing our context (async_to_sync) does not inherit it.
            _request_id.reset(token)
        return response


def request_id_from(incoming: str) -> str:
    """The proxy's X-Request-ID when it is one, else a new id."""
    return incoming if _VALID_ID.fullmatch(incoming) else uuid.uuid4().hex


def log_access(method: str, path: str, status: int, started: float, *, streaming: bool = False) -> None:
    """A request's access line; `started` is its perf_counter() at the start."""
    access_logger.info(
        "%s %s %s",
        method,
        path,
        status,
        extra={
            "method": method,
            "path": path,
            "status": status,
            # For a stream: the time to its headers, i.e. to the first token.
            "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            "streaming": streaming,
        },
    )


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


class ClientErrorFilter(logging.Filter):
    """Django's request and security lines at the level of what happened (a handler's filter: a
    logger's would not see the `django.security.<Exception>` loggers).

    Django logs a SuspiciousOperation (a bad Host, a body too large) and every 5xx at ERROR,
    with a traceback, and anyone can send those requests. A 4xx is the client's doing (WARNING at
    most, no traceback), a 503 with Retry-After a refusal we meant (INFO), a 502 or 504 the
    upstream's (WARNING, logged with its detail by the backend). ERROR is left for what we broke."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("django.request", "django.security")):
            return True
        status = getattr(record, "status_code", None)
        if not isinstance(status, int):
            return True
        if status < 500:
            _lower(record, logging.WARNING)
            record.exc_info = record.exc_text = record.stack_info = None
        elif status == 503 and getattr(getattr(record, "request", None), "announced_refusal", False):
            _lower(record, logging.INFO)
        elif status in (502, 504):  # only our views answer these (Django never does)
            _lower(record, logging.WARNING)
        return True


def _lower(record: logging.LogRecord, level: int) -> None:
    if record.levelno > level:
        record.levelno, record.levelname = level, logging.getLevelName(level)


def _secrets() -> list[str]:
    """The configured credentials, the passwords in REDIS_URL and DATABASES included, and the
    Cloudflare account and gateway ids (with a token, they are what an attacker needs)."""
    try:
        values = [
            settings.CLOUDFLARE_API_TOKEN,
            settings.CLOUDFLARE_ACCOUNT_ID,
            settings.AI_GATEWAY_ID,
            settings.AI_GATEWAY_TOKEN,
            settings.OPENAI_API_KEY,
            settings.SECRET_KEY,
            settings.QUOTES_METRICS_TOKEN,
            urlsplit(settings.REDIS_URL).password,
            *(database.get("PASSWORD") for database in settings.DATABASES.values()),
        ]
    except Exception:  # settings not configured yet: nothing to hide
        return []
    return [value for value in values if isinstance(value, str) and len(value) >= 8]


def _shows_secret(value: Any) -> bool:
    secrets = _secrets()
    if not secrets:
        return False
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # a repr that fails shows nothing
        return False
    return any(secret in text for secret in secrets)


def redact(text: str) -> str:
    for secret in _secrets():
        text = text.replace(secret, "[redacted]")
    return text


#: A query string after a path or URL, up to the next blank: a request line has none, while a
#: quote or a bracket can be part of a topic (`?topic=it's`), so the redaction may take a closing
#: quote with it, but never leaves a topic's tail behind.
_QUERY = re.compile(r"(?<=[^\s?])\?\S+")


def redact_queries(text: str) -> str:
    """Query strings out, unless QUOTES_LOG_CONTENT allows visitors' words in the logs."""
    try:
        if settings.QUOTES_LOG_CONTENT:
            return text
    except Exception:  # settings not configured yet: redact
        pass
    return _QUERY.sub("?[redacted]", text)


def _scrubbed(value: Any) -> Any:
    """A log field with query strings and secrets out; a request (django.request's) becomes its
    method and path."""
    if isinstance(value, HttpRequest):
        value = f"{value.method} {value.get_full_path()}"
    if isinstance(value, str):
        return redact(redact_queries(value))
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dict):
        return {key: _scrubbed(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_scrubbed(item) for item in value]
    return _scrubbed(str(value))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(redact_queries(super().format(record)))


class JsonFormatter(_JsonFormatter):
    """One JSON object per line: timestamp, level, logger, message, request_id, and any extras."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("rename_fields", {"asctime": "timestamp", "levelname": "level", "name": "logger"})
        kwargs.setdefault("timestamp", False)
        super().__init__(*args, **kwargs)

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        # Each field before it is serialised: a regex over the JSON text could cut an escape.
        return {key: _scrubbed(value) for key, value in log_data.items()}

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class SecretsFilter(SafeExceptionReporterFilter):
    """DEFAULT_EXCEPTION_REPORTER_FILTER: the DEBUG page also masks settings with a credential in
    a URL (REDIS_URL, the caches' LOCATION), and any setting or traceback variable whose value
    shows a configured credential, whatever its name (Django looks only at names)."""

    hidden_settings = re.compile(
        "API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|REDIS|LOCATION|_URL$", re.I
    )

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        return self.cleansed_substitute if cleansed is value and _shows_secret(value) else cleansed

    def cleanse_special_types(self, request: HttpRequest | None, value: Any) -> Any:
        cleansed = super().cleanse_special_types(request, value)
        return self.cleansed_substitute if cleansed is value and _shows_secret(value) else cleansed
