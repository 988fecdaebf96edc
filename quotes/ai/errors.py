"""The error vocabulary: every stable code a client can see, and the constructors for the errors
that more than one module raises.

A code is part of the wire format (JSON envelopes, SSE `error` events, WebSocket frames, the
`error_code` column of the log), so its value never changes; `ErrorCode` is a `StrEnum`, so a
member is the very string clients see. The retry and fallback policy matches on members, never on
raw strings, so a typo is a mypy error rather than a silently skipped retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    # The request: bad input, answered before any model is asked.
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
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
    BUSY_SOCKET = "busy_socket"
    # How a generation ended early (on its log row, and to a client still reading it).
    STOPPED = "stopped"
    ABANDONED = "abandoned"
    #: the process writing it died or restarted (seen from another process, through Redis)
    GENERATION_LOST = "generation_lost"
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


@dataclass(frozen=True, slots=True)
class Error:
    """The stream failed. `code` is stable and machine-readable, `message` is for people,
    `status` is the HTTP status to answer with when no byte has been sent yet, and
    `retry_after` (seconds) says when trying again makes sense."""

    code: ErrorCode
    message: str
    status: int = 502
    retry_after: int | None = None


class QuoteError(Exception):
    """A failure with a stable `code`, a readable `message` and the HTTP `status` it maps to."""

    def __init__(self, code: ErrorCode, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status

    def as_event(self) -> Error:
        return Error(code=self.code, message=self.message, status=self.status)

    def as_json(self) -> dict[str, dict[str, Any]]:
        return envelope(self.code, self.message)


def envelope(code: str, message: str, **extra: Any) -> dict[str, dict[str, Any]]:
    """The one JSON error body: {"error": {"code", "message", ...extra}}. The views, the SSE
    `error` event, the admin preview and the health check all answer with it."""
    return {"error": {"code": str(code), "message": message, **extra}}


# -- constructors for the errors more than one module raises ---------------------------------------

_RETRY = "Please try again shortly."


def busy(message: str = "The model is busy with other quotes. Please try again in a moment.") -> Error:
    return Error(code=ErrorCode.BUSY, message=message, status=503)


def internal(message: str = "Something went wrong while writing the quote.") -> Error:
    return Error(code=ErrorCode.INTERNAL_ERROR, message=message, status=500)


def upstream_auth() -> Error:
    """Our credentials were refused upstream. The visitor did nothing wrong and can do nothing
    about it, so they get no detail: the backend logs what the upstream said, for the operator."""
    return Error(
        code=ErrorCode.UPSTREAM_AUTH,
        message="The site's connection to the model service is misconfigured. "
        "This is not your fault; please try again later.",
        status=502,
    )


def upstream_timeout(message: str = f"The model took too long to answer. {_RETRY}") -> Error:
    return Error(code=ErrorCode.UPSTREAM_TIMEOUT, message=message, status=504)


def upstream_unreachable(
    message: str = f"The model service cannot be reached right now. {_RETRY}",
) -> Error:
    return Error(code=ErrorCode.UPSTREAM_UNREACHABLE, message=message, status=502)


def upstream_dropped(
    message: str = "The connection to the model was lost before the quote was finished.",
) -> Error:
    return Error(code=ErrorCode.UPSTREAM_DROPPED, message=message, status=502)


def upstream_malformed(message: str = "The model service sent an answer we could not read.") -> Error:
    return Error(code=ErrorCode.UPSTREAM_MALFORMED, message=message, status=502)


def upstream_unavailable(message: str = f"The model service is having trouble right now. {_RETRY}") -> Error:
    return Error(code=ErrorCode.UPSTREAM_UNAVAILABLE, message=message, status=502)


def upstream_rejected(message: str, status: int) -> Error:
    return Error(code=ErrorCode.UPSTREAM_REJECTED, message=message, status=status)
