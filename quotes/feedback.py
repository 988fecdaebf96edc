"""Visitors' thumbs up or down on a quote: one vote per client per quote (the client as rate
limits count it: the user, else the address's network), which that client may change and no
one else can, and a rate limit on voting at all.

`Generation.feedback` stays the quote's verdict, the sign of its votes' sum, so the admin's
column and the analytics' per-persona thumbs (which count quotes by their verdict) need no
change, and many voters cannot push a single quote past one thumb.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models import Sum

from .ai import limits
from .models import Generation, Vote
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


async def record_vote(*, generation_id: int, client_key: str, value: int) -> None:
    """Set this client's vote on the quote, then the quote's verdict from all its votes."""
    await sync_to_async(_record_vote)(generation_id=generation_id, client_key=client_key, value=value)


def _record_vote(*, generation_id: int, client_key: str, value: int) -> None:
    with transaction.atomic():
        # The quote's row is locked first, so concurrent votes on it sum one after another.
        Generation.objects.select_for_update().filter(pk=generation_id).values_list("pk", flat=True).get()
        Vote.objects.update_or_create(
            generation_id=generation_id, client_key=client_key, defaults={"value": value}
        )
        total = Vote.objects.filter(generation_id=generation_id).aggregate(total=Sum("value"))["total"] or 0
        verdict = 1 if total > 0 else -1 if total < 0 else None
        Generation.objects.filter(pk=generation_id).update(feedback=verdict)
