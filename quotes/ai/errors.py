"""Stable error codes. Each is something a user (or a caller's code) can act on."""

from __future__ import annotations

from .events import Error


class QuoteError(Exception):
    """A failure with a stable `code`, a readable `message` and the HTTP `status` it maps to."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status

    def as_event(self) -> Error:
        return Error(code=self.code, message=self.message, status=self.status)

    def as_json(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


def busy(message: str = "The model is busy with other quotes. Please try again in a moment.") -> Error:
    return Error(code="busy", message=message, status=503)


def internal(message: str = "Something went wrong while writing the quote.") -> Error:
    return Error(code="internal_error", message=message, status=500)


def upstream_auth() -> Error:
    """Our credentials were refused upstream. The visitor did nothing wrong and can do nothing
    about it, so they get no detail: the backend logs what the upstream said, for the operator."""
    return Error(
        code="upstream_auth",
        message="The site's connection to the model service is misconfigured. "
        "This is not your fault; please try again later.",
        status=502,
    )
