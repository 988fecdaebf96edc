"""The database as this process sees it: answering, or in an outage.

While the database cannot be reached, personas are served from this process's memory
(quotes.personas), and what cannot be served is answered with a 503 `service_unavailable` and
Retry-After (quotes.views.unavailable_response, through quotes.middleware.DatabaseOutageMiddleware
for a database error escaping any view). Both report here, so that:

- an outage is logged once: a WARNING when it begins, an INFO line when the database answers
  again, instead of a traceback at ERROR for every request meanwhile;
- the database is asked again only RETRY_S after it last failed, not by every request: a
  request in between is served from memory or refused at once (and a database coming back is
  not met by every request that queued up at once).

An outage ends when a query succeeds (quotes.personas reports it). A process that never asks
again (nothing it serves needs the database) would never hear that: a failure more than FORGET_S
after the last one begins a new outage, with its own WARNING.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from django.db import InterfaceError, OperationalError

from .ai.errors import ErrorCode, QuoteError

logger = logging.getLogger(__name__)

#: The errors that say the database cannot be reached or used right now (a refused or dropped
#: connection, a server shutting down, SQLite's unopenable file or lock timeout), as opposed to
#: a bug in a query (ProgrammingError, IntegrityError), which stays a 500 with its traceback.
UNREACHABLE: tuple[type[Exception], ...] = (OperationalError, InterfaceError)
#: How long after a failure the database is left alone.
RETRY_S = 2.0
#: A failure this long after the previous one, with no success in between, begins a new outage.
FORGET_S = 60.0

MESSAGE = "The site cannot load this right now. This is not your fault; please try again in a few seconds."


class Outage:
    """Whether the database is in an outage, when to ask it again, and one log line each way.
    Called from the event loop and from request threads alike."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current outage began (None: no outage)
        self._last = -math.inf  # the latest failure (monotonic)

    def failed(self, error: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            begins = self._since is None or now - self._last > FORGET_S
            if begins:
                self._since = now
            self._last = now
        if begins:
            # The first line of the error only, and short: enough for the operator to tell a
            # refused connection from a lock timeout; the rest of the outage is quiet.
            detail = (str(error).strip().splitlines() or [""])[0][:200]
            logger.warning(
                "the database cannot be reached (%s: %s); serving personas from memory and answering "
                "503 for anything else until it answers again",
                type(error).__name__,
                detail,
            )

    def recovered(self) -> None:
        with self._lock:
            since, self._since = self._since, None
            self._last = -math.inf
        if since is not None:
            logger.info("the database answers again, after %.1f s", time.monotonic() - since)

    @property
    def waiting(self) -> bool:
        """The database failed less than RETRY_S ago: do not ask it yet."""
        return time.monotonic() < self._last + RETRY_S

    def retry_after(self) -> int:
        """Whole seconds until this process asks the database again (at least 1)."""
        return max(1, math.ceil(self._last + RETRY_S - time.monotonic()))

    def error(self) -> QuoteError:
        """The 503 for a request that nothing in memory can answer."""
        return QuoteError(ErrorCode.SERVICE_UNAVAILABLE, MESSAGE, 503, retry_after=self.retry_after())


#: This process's view of the default database.
outage = Outage()
