"""The error vocabulary: every stable code a client can see (part of the wire format and of the
log's `error_code`: a value never changes), the errors more than one module raises, and what an
upstream said, made fit for the operator's log (a visitor never gets it).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from streaming import Endings, Error, Outcomes


class ErrorCode(StrEnum):
    # The request: bad input, answered before any model is asked.
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    NOT_ACCEPTABLE = "not_acceptable"
    BODY_TOO_LARGE = "body_too_large"
    INVALID_JSON = "invalid_json"
    INVALID_FRAME = "invalid_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    INVALID_UNICODE = "invalid_unicode"
    MISSING_PERSONA = "missing_persona"
    INVALID_PERSONA = "invalid_persona"
    UNKNOWN_PERSONA = "unknown_persona"
    INVALID_TOPIC = "invalid_topic"
    TOPIC_TOO_LONG = "topic_too_long"
    INVALID_MESSAGES = "invalid_messages"
    INVALID_MESSAGE_ROLE = "invalid_message_role"
    MESSAGE_TOO_LONG = "message_too_long"
    TOO_MANY_MESSAGES = "too_many_messages"
    CONTEXT_WINDOW_EXCEEDED = "context_window_exceeded"
    #: a request field of the wrong kind (OpenAI's face: `stream`, `stream_options`, ...)
    INVALID_PARAMETER = "invalid_parameter"
    #: max_tokens or temperature outside what the persona allows
    OUT_OF_RANGE = "out_of_range"
    #: an OpenAI request field a persona does not take (tools, n > 1, ...)
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    INVALID_FEEDBACK = "invalid_feedback"
    UNKNOWN_QUOTE = "unknown_quote"
    NOT_RATEABLE = "not_rateable"
    FEEDBACK_CLOSED = "feedback_closed"
    INVALID_LAST_EVENT_ID = "invalid_last_event_id"
    RESUME_UNAVAILABLE = "resume_unavailable"
    UNKNOWN_STREAM = "unknown_stream"
    # Who may ask, and how often.
    FORBIDDEN = "forbidden"
    CROSS_SITE = "cross_site"
    CSRF_FAILED = "csrf_failed"
    RATE_LIMITED = "rate_limited"
    TOO_MANY_STREAMS = "too_many_streams"
    OVER_CAPACITY = "over_capacity"
    SERVER_DRAINING = "server_draining"
    #: the database cannot be reached and nothing this process holds can answer instead
    SERVICE_UNAVAILABLE = "service_unavailable"
    BUSY_SOCKET = "busy_socket"
    # How a generation ended early (on its log row, and to a client still reading it).
    STOPPED = "stopped"
    ABANDONED = "abandoned"
    #: the process writing it died (its row was left `running`: marked so by the prune and at start)
    LOST = "lost"
    #: the site's daily spend ceiling (or the persona's) is reached: paid models wait for tomorrow
    BUDGET_EXHAUSTED = "budget_exhausted"
    # Our own model and gateway.
    BUSY = "busy"
    INTERNAL_ERROR = "internal_error"
    LOCAL_MODEL_UNAVAILABLE = "local_model_unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    IDLE_TIMEOUT = "idle_timeout"
    # The upstream model service.
    MODEL_NOT_FOUND = "model_not_found"
    LORA_NOT_SUPPORTED = "lora_not_supported"
    REQUEST_TOO_LARGE = "request_too_large"
    UPSTREAM_AUTH = "upstream_auth"
    UPSTREAM_BAD_REQUEST = "upstream_bad_request"
    UPSTREAM_FORBIDDEN = "upstream_forbidden"
    UPSTREAM_QUOTA_EXCEEDED = "upstream_quota_exceeded"
    UPSTREAM_CAPACITY = "upstream_capacity"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_REJECTED = "upstream_rejected"
    UPSTREAM_DROPPED = "upstream_dropped"
    UPSTREAM_MALFORMED = "upstream_malformed"


class QuoteError(Exception):
    """A failure with its HTTP `status`, and for one that passes, `retry_after` seconds; `param`:
    the request field at fault, when one is (OpenAI's envelope names it)."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        status: int,
        *,
        retry_after: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.retry_after = retry_after
        self.param = param

    def as_event(self) -> Error:
        return Error(code=self.code, message=self.message, status=self.status, retry_after=self.retry_after)


def envelope(code: str, message: str, **extra: Any) -> dict[str, dict[str, Any]]:
    """The one JSON error body: {"error": {"code", "message", ...extra}}."""
    return {"error": {"code": str(code), "message": message, **extra}}


_RETRY = "Please try again shortly."


#: How a stream ends by itself, and how the retry policy ends one, in the site's words.
ENDINGS = Endings(
    abandoned=Error(ErrorCode.ABANDONED, "Nobody came back for this quote: it was stopped.", 410),
    ended_early=Error(ErrorCode.INTERNAL_ERROR, "The model ended without finishing the quote.", 500),
    failed=Error(ErrorCode.INTERNAL_ERROR, "Something went wrong while writing the quote.", 500),
)
OUTCOMES = Outcomes(
    retryable=frozenset(
        {
            ErrorCode.UPSTREAM_UNREACHABLE,
            ErrorCode.UPSTREAM_UNAVAILABLE,
            ErrorCode.UPSTREAM_CAPACITY,
            ErrorCode.UPSTREAM_TIMEOUT,
            ErrorCode.UPSTREAM_DROPPED,
        }
    ),
    final=frozenset(
        {
            ErrorCode.UPSTREAM_AUTH,
            ErrorCode.BUSY,
            ErrorCode.REQUEST_TOO_LARGE,
            ErrorCode.CONTEXT_WINDOW_EXCEEDED,
        }
    ),
    first_token_timeout=Error(
        ErrorCode.UPSTREAM_TIMEOUT, "The model took too long to start writing. Please try again shortly.", 504
    ),
    idle_timeout=Error(ErrorCode.IDLE_TIMEOUT, "The model stopped writing mid-quote.", 504),
    deadline=Error(ErrorCode.DEADLINE_EXCEEDED, "The quote took too long to write.", 504),
    ended_early=ENDINGS.ended_early,
)
STOPPED = Error(ErrorCode.STOPPED, "The quote was stopped.", 409)
DRAINED = Error(ErrorCode.SERVER_DRAINING, "This server is restarting: resume elsewhere.", 503, retry_after=1)


def busy(message: str = "The model is busy with other quotes. Please try again in a moment.") -> Error:
    return Error(code=ErrorCode.BUSY, message=message, status=503)


def upstream_auth() -> Error:
    """Our credentials were refused upstream: the visitor gets no detail, the log does."""
    return Error(
        code=ErrorCode.UPSTREAM_AUTH,
        message="The site's connection to the model service is misconfigured. "
        "This is not your fault; please try again later.",
        status=502,
    )


def upstream_timeout(message: str = f"The model took too long to answer. {_RETRY}") -> Error:
    return Error(code=ErrorCode.UPSTREAM_TIMEOUT, message=message, status=504)


def upstream_unreachable(message: str = f"The model service cannot be reached right now. {_RETRY}") -> Error:
    return Error(code=ErrorCode.UPSTREAM_UNREACHABLE, message=message, status=502)


def upstream_dropped(
    message: str = "The connection to the model was lost before the quote was finished.",
) -> Error:
    return Error(code=ErrorCode.UPSTREAM_DROPPED, message=message, status=502)


def upstream_malformed(message: str = "The model service sent an answer we could not read.") -> Error:
    return Error(code=ErrorCode.UPSTREAM_MALFORMED, message=message, status=502)


def upstream_unavailable(message: str = f"The model service is having trouble right now. {_RETRY}") -> Error:
    return Error(code=ErrorCode.UPSTREAM_UNAVAILABLE, message=message, status=502)


def upstream_status_error(status: int) -> Error:
    """The visitor's error for an upstream's non-2xx answer, from its status alone: what the
    upstream wrote (internal addresses, keys, its billing) is for the log (`upstream_text`)."""
    if status in (401, 403):
        return upstream_auth()
    if status == 429:
        return Error(ErrorCode.UPSTREAM_REJECTED, f"The model service is overloaded. {_RETRY}", 429)
    if 400 <= status < 500:
        return Error(
            ErrorCode.UPSTREAM_REJECTED, f"The model service refused the request (HTTP {status}).", status
        )
    if status >= 500:
        return upstream_unavailable()
    return upstream_malformed(f"The model service gave an unexpected answer (HTTP {status}).")


#: How much of an upstream's error text reaches a log line, and how much of it is read: every
#: pattern below starts only where a word starts (linear in the text), and the bound keeps even
#: a hostile 64 KB body cheap.
UPSTREAM_TEXT_LIMIT = 300
_READ_LIMIT = 4096
_REDACTED = "[redacted]"
#: `NAME=value`, `NAME: value`, `"name": "value"`; redacted when the name says it holds a
#: credential (_CREDENTIAL_NAME). The name is matched possessively: no backtracking into it.
_ASSIGNMENT = re.compile(r"""(?<![\w.-])([\w.-]++)(["']?\s*+[=:]\s*+)("[^"]*+"|'[^']*+'|[^\s,;&"'<>()]++)""")
_CREDENTIAL_NAME = re.compile(r"(?i)pass|pwd|secret|token|key|auth|credential|cookie|session|dsn")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',;]+")
_URL = re.compile(r"(?i)(?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://[^\s\"'<>()]+")
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
#: keys with a known prefix (sk-..., sk_live_..., org-...); then any run of 20 or more word
#: characters with 4 digits and 4 letters at least (tokens, account and request ids), which
#: leaves model names (`mistral-7b-instruct-v0.1`) alone
_KEY = re.compile(r"(?i)(?<![\w-])(?:sk|pk|rk|org)[-_][\w-]{8,}")
_WORD = re.compile(r"(?<![\w-])[\w-]{20,}")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?(?![\d.])")
_IPV6 = re.compile(
    r"(?<![\w:.])\[?(?P<address>(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4})(?:%[\w.-]+)?\]?(?::\d{1,5})?(?![\w:])"
)
#: `db:5432`, `inference-7.cluster.local:8080`; then names under the private-use suffixes
_HOST_PORT = re.compile(r"(?i)(?<![\w.:-])(?=[\w.-]*[a-z])[a-z0-9-]+(?:\.[a-z0-9-]+)*:\d{2,5}\b")
_PRIVATE_HOST = re.compile(
    r"(?i)(?<![\w.-])(?:[a-z0-9-]+\.)+(?:internal|local|localdomain|lan|corp|intranet|svc|home\.arpa)\b"
    r"|\blocalhost\b"
)
_TAG = re.compile(r"<[^<>]{0,200}>")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def _without_credential(match: re.Match[str]) -> str:
    if _CREDENTIAL_NAME.search(match[1]):
        return match[1] + match[2] + _REDACTED
    return match.group(0)


def _without_random(match: re.Match[str]) -> str:
    word = match.group(0)
    digits = sum(c.isdigit() for c in word)
    return _REDACTED if digits >= 4 and sum(c.isalpha() for c in word) >= 4 else word


def _without_ipv6(match: re.Match[str]) -> str:
    try:
        ipaddress.IPv6Address(match["address"])
    except ValueError:
        return match.group(0)  # a time of day, a ratio: not an address
    return "[address]"


def upstream_text(text: str, *, secrets: Iterable[str] = ()) -> str:
    """What an upstream said, for the log: without our `secrets`, anything named as a credential,
    bearer tokens, keys and ids, URLs, e-mail and IP addresses, internal host names, HTML tags and
    control characters; at most UPSTREAM_TEXT_LIMIT characters ("pool to [address] failed")."""
    text = text[:_READ_LIMIT]
    for secret in secrets:
        if secret:
            text = text.replace(secret, _REDACTED)
    text = _CONTROL.sub(" ", _TAG.sub(" ", text))
    text = _BEARER.sub(r"\1 " + _REDACTED, text)
    text = _ASSIGNMENT.sub(_without_credential, text)
    text = _URL.sub("[url]", text)
    text = _EMAIL.sub("[email]", text)
    text = _KEY.sub(_REDACTED, text)
    text = _IPV4.sub("[address]", text)
    text = _IPV6.sub(_without_ipv6, text)
    text = _HOST_PORT.sub("[address]", text)
    text = _PRIVATE_HOST.sub("[host]", text)
    text = _WORD.sub(_without_random, text)
    text = " ".join(text.split())
    if len(text) > UPSTREAM_TEXT_LIMIT:
        text = text[: UPSTREAM_TEXT_LIMIT - 1].rstrip() + "…"
    return text


_BEARER_TOKEN = re.compile(r"(?i)\bbearer\s+[^\s\"',;]+")


def scrub(text: str, secrets: Iterable[str]) -> str:
    """An upstream's header value without any of `secrets`, nor what follows the word Bearer."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, _REDACTED)
    return _BEARER_TOKEN.sub("Bearer " + _REDACTED, text)


class Scrubber:
    """Removes our credentials from streamed text (an upstream could echo one back), even cut
    across tokens: a tail that could start a secret waits for the next token (or `flush`)."""

    __slots__ = ("_held", "_secrets")

    def __init__(self, secrets: Iterable[str]) -> None:
        self._secrets = tuple(secret for secret in secrets if secret)
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._secrets:
            return text
        text, self._held = self._held + text, ""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, _REDACTED)
        hold = max(_prefix_overlap(text, secret) for secret in self._secrets)
        if hold:
            self._held = text[-hold:]
            return text[:-hold]
        return text

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _prefix_overlap(text: str, secret: str) -> int:
    """The length of the longest end of `text` that is a proper start of `secret`."""
    first = secret[0]
    start = max(0, len(text) - len(secret) + 1)
    index = text.find(first, start)
    while index != -1:
        if secret.startswith(text[index:]):
            return len(text) - index
        index = text.find(first, index + 1)
    return 0
