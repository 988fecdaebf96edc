"""This event loop's streams (a part of quotes.state): the package's registry by id and answer key,
and whose each live stream is (only its client may stop it)."""

from __future__ import annotations

from django.conf import settings
from streaming import Streams

from . import state
from .errors import DRAINED, ENDINGS


class LiveStreams(Streams):
    CLOSE_FIRST = True  # their ends write rows: before the writer closes

    def __init__(self) -> None:
        super().__init__(ENDINGS, keep_s=settings.QUOTES_RESUME_TTL_S)
        #: whose each stream is, while it is findable (live, or kept for a late resume)
        self.owners: dict[str, str] = {}

    def own(self, stream_id: str, client_key: str) -> None:
        self.owners[stream_id] = client_key
        if len(self.owners) > 2 * self.keep:  # those the registry forgot go too
            self.owners = {id: key for id, key in self.owners.items() if self.get(id) is not None}

    async def aclose(self) -> None:
        await self.drain(0, DRAINED)


def streams() -> LiveStreams:
    return state.of(LiveStreams)
