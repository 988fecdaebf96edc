"""Resumable streams of model output for asyncio servers: one stream, many readers, each from an
offset; a stop that stops the upstream; a grace for a dropped connection; retries and fallbacks
before the first token under one set of deadlines; Server-Sent Events framing.

It knows no web framework and no model service: a source is any async generator of events, and
the caller's words (error codes, messages) come in as arguments. README.md has an example."""

from . import sse
from .events import Done, Error, Event, Meta, Ping, Token, Usage, from_json, merged, to_json
from .policy import Outcomes, Policy, generate
from .stream import Endings, OnEnd, Stream, Streams, replay

__all__ = [
    "Done",
    "Endings",
    "Error",
    "Event",
    "Meta",
    "OnEnd",
    "Outcomes",
    "Ping",
    "Policy",
    "Stream",
    "Streams",
    "Token",
    "Usage",
    "from_json",
    "generate",
    "merged",
    "replay",
    "sse",
    "to_json",
]
__version__ = "1.0.0"
