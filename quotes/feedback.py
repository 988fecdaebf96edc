"""The rate limit on what a visitor does to a quote it has: its thumbs up or down (the vote
itself is quotes.services.generation_feedback_set: one vote per client per quote, the client as
rate limits count it, the user, else the address's network), sharing it, and stopping it.

`Generation.feedback` stays the quote's verdict, the sign of its votes' sum, so the admin's
column and the analytics' per-persona thumbs (which count quotes by their verdict) need no
change, and many voters cannot push a single quote past one thumb.
"""

from __future__ import annotations

from django.conf import settings

from .ai import limits
from .security import RateLimited

#: What each action's 429 says the client did too often.
ACTIONS = {"feedback": "rated", "share": "shared", "stop": "stopped"}


async def count_action(action: str, client_key: str) -> None:
    """Count one `action` (of ACTIONS) of this client before anything is looked up for it;
    RateLimited (429) once over QUOTES_FEEDBACK_RATE_LIMIT, each action in a window of its own."""
    limit, window = settings.QUOTES_GATEWAY.feedback_rate_limit
    retry_after = await limits.count_request(action, client_key, limit=limit, window=window)
    if retry_after is not None:
        raise RateLimited(
            f"You have {ACTIONS[action]} {limit} quotes in a short while. Try again in {retry_after} s.",
            retry_after,
        )
