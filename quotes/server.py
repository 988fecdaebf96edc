"""`python -m quotes.server`: daphne, taking exactly daphne's arguments, that drains on SIGTERM.

    python -m quotes.server -b 127.0.0.1 -p 8000 config.asgi:application

On SIGTERM (or Ctrl-C) the process stops taking new streams (a 503 `server_draining` with
Retry-After; /healthz answers 503 "draining", so nginx and the rolling restart look elsewhere),
lets the open ones finish for up to QUOTES_DRAIN_TIMEOUT_S, then ends those still open with an
event that tells their clients to resume elsewhere (quotes.transports), closes the backends
(the embedded model's threads, the HTTP pools), writes the last log rows and exits. A second
signal stops at once.

Why not plain `daphne`: daphne runs Twisted's reactor, whose own SIGTERM handler stops the
reactor at once, and daphne's "before shutdown" trigger (`Server.kill_all_applications`) then
cancels every application instance, open streams included. Twisted calls all of an event's
"before" triggers one after the other without waiting for any (only the "during" phase waits
for the Deferreds they return), so a trigger of ours, even one returning a Deferred, cannot hold
daphne's back. So this runs daphne's own `Server` with Twisted's signal handlers off (its
`signal_handlers` argument) and handles the signals itself, from daphne's `ready_callable`: the
reactor is stopped (and daphne's shutdown runs) only once the drain is over. daphne's CLI parses
the arguments and builds the server, through its `server_class` hook.

WebSocket sockets closed with a server's close codes (1012 for a drain) need one fork of daphne's
internals: quotes.forks.use_server_close_codes.

daphne's access log (on stdout unless `--access-log` says otherwise, as under `make run`) writes
each request's path as it came, query string included, and visitors' topics travel in query
strings: here it gets the path without it (`without_query`). The app's own access line
(quotes.request) has the request id too; the deploy files send daphne's to /dev/null.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

# daphne.cli imports daphne.server first, which installs Twisted's asyncio reactor.
from daphne.cli import CommandLineInterface
from daphne.server import Server

logger = logging.getLogger("quotes.server")  # run as __main__ (python -m)

#: After the drain, for Twisted to write out the last bytes of the streams that just ended
#: before the reactor's shutdown drops every connection.
FLUSH_S = 0.5


ActionLogger = Callable[[str, str, dict[str, Any]], None]


def without_query(action_logger: ActionLogger) -> ActionLogger:
    """daphne's `action_logger` (its access log), given each request's path without its query
    string: `GET /api/quotes/stream?persona=x&topic=...` is logged as `GET /api/quotes/stream`."""

    def log(protocol: str, action: str, details: dict[str, Any]) -> None:
        path = details.get("path")
        if isinstance(path, str) and "?" in path:
            details = {**details, "path": path.partition("?")[0]}
        action_logger(protocol, action, details)

    return log


def draining_server(**options: Any) -> Server:
    """daphne's `Server`, as its CLI configures it, that drains on SIGTERM (see the docstring)."""
    # Imported here: the app (and Django's settings) is loaded by daphne's CLI, after this module.
    from quotes import forks
    from quotes.ai.gateway.rows import writer

    def ready() -> None:  # in Server.run(), once its factories exist, before the reactor runs
        forks.use_server_close_codes(server)
        loop = asyncio.get_event_loop()  # daphne's loop, which the reactor is about to run
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, _on_signal, server, number)
        # Log rows left in the outbox of a process that is gone (killed while the database was
        # down) are written now, by the writer's thread, not at this process's first stream.
        writer.start()

    if options.get("action_logger") is not None:
        options["action_logger"] = without_query(options["action_logger"])
    server = Server(signal_handlers=False, ready_callable=ready, **options)
    return server


#: The drain under way (one per process), from the first signal.
_draining: asyncio.Task[None] | None = None


def _on_signal(server: Server, number: int) -> None:
    global _draining
    if _draining is None:
        logger.info("%s: draining before exit", signal.Signals(number).name)
        _draining = asyncio.ensure_future(_drain_then_stop(server))
    else:
        logger.warning("%s again: stopping now", signal.Signals(number).name)
        server.stop()


async def _drain_then_stop(server: Server) -> None:
    try:
        await drain_and_close()
    except Exception:
        logger.exception("draining failed; stopping anyway")
    finally:
        server.stop()  # daphne's shutdown: whatever is left (idle sockets) is cancelled


async def drain_and_close() -> None:
    # Imported here: the app (and Django's settings) is loaded by daphne's CLI, after this module.
    from django.conf import settings

    from quotes.ai import refusals
    from quotes.ai.backends import reset_backends
    from quotes.ai.gateway import runs
    from quotes.ai.gateway.admission import CUT_GRACE_S, drain
    from quotes.ai.gateway.rows import writer

    await drain.run(settings.QUOTES_GATEWAY.drain_timeout_s)
    await runs.end_for_drain()  # the runs still going end; their connections are told to resume elsewhere
    # Those connections' last bytes must reach daphne before the reactor stops.
    await drain.settle(CUT_GRACE_S)
    await runs.flush(2.0)  # the cut runs' last events, for a resume on another process
    await reset_backends()  # the embedded model's threads stop, the upstream pools close
    if not await asyncio.to_thread(writer.flush, 10.0):
        logger.warning("draining: some log rows were still unwritten after 10 s")
    await asyncio.sleep(FLUSH_S)
    # Last: the process refuses new streams until it stops, and each refusal's count reaches its
    # row a second later. Nothing may be awaited between this and the stop (see flush_now).
    await refusals.flush_now()
    logger.info("drained")


class DrainingCommandLineInterface(CommandLineInterface):
    description = "Persona Quotes: daphne, draining open streams on SIGTERM"
    server_class = staticmethod(draining_server)


if __name__ == "__main__":
    DrainingCommandLineInterface.entrypoint()
