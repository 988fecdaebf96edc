"""The rate limit on visitors' thumbs up or down (the vote itself is
quotes.services.generation_feedback_set): one vote per client per quote (the client as rate
limits count it: the user, else the address's network), which that client may change and no
one else can.

`Generation.feedback` stays the quote's verdict, the sign of its votes' sum, so the admin's
column and the analytics' per-persona thumbs (which count quotes by their verdict) need no
change, and many voters cannot push a single quote past one thumb.
"""

from __future__ import annotations

from django.conf import settings

from .ai import limits
from .security import RateLimited


async def count_vote(client_key: str) -> None:
    """Count one feedback request of this client; RateLimited (429) once it is over
    QUOTES_FEEDBACK_RATE_LIMIT."""
    limit, window = settings.QUOTES_GATEWAY.feedback_rate_limit
    retry_after = await limits.run_on_cache(
        limits.count_request, "feedback", client_key, limit=limit, window=window
    )
    if retry_after is not None:
        raise RateLimited(
            f"You have rated {limit} quotes in a short while. Try again in {retry_after} s.", retry_after
        )
