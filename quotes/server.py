"""`python -m quotes.server`: daphne, taking exactly daphne's arguments, that drains on SIGTERM
(`drain_and_close`; a second signal stops at once). Not plain `daphne`: Twisted's SIGTERM handler
and daphne's shutdown trigger would cancel every open stream at once (docs/deployment.md).

    python -m quotes.server -b 127.0.0.1 -p 8000 config.asgi:application
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

FLUSH_S = 0.5  # for Twisted to write out the streams' last bytes before the reactor stops


def without_query(action_logger: Callable[..., None]) -> Callable[..., None]:
    """daphne's access log, given each path without its query string (where visitors' topics go)."""

    def log(protocol: str, action: str, details: dict[str, Any]) -> None:
        path = details.get("path")
        if isinstance(path, str) and "?" in path:
            details = {**details, "path": path.partition("?")[0]}
        action_logger(protocol, action, details)

    return log


def draining_server(**options: Any) -> Server:
    """daphne's `Server`, as its CLI configures it, that drains on SIGTERM."""
    # Imported here: daphne's CLI loads the app (and Django's settings) after this module.
    from quotes import forks
    from quotes.ai.gateway.rows import writer

    def ready() -> None:  # in Server.run(), once its factories exist, before the reactor runs
        forks.use_server_close_codes(server)
        loop = asyncio.get_event_loop()  # daphne's loop, which the reactor is about to run
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, _on_signal, server, number)
        # Rows left in the outbox by a process that is gone are written now, not at the first stream.
        writer.start()

    if options.get("action_logger") is not None:
        options["action_logger"] = without_query(options["action_logger"])
    server = Server(signal_handlers=False, ready_callable=ready, **options)
    return server


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
    from django.conf import settings

    from quotes.ai import refusals
    from quotes.ai.backends import reset_backends
    from quotes.ai.gateway import runs
    from quotes.ai.gateway.admission import CUT_GRACE_S, drain
    from quotes.ai.gateway.rows import writer

    await drain.run(settings.QUOTES_GATEWAY.drain_timeout_s)
    await runs.end_for_drain()  # the runs still going end; their connections are told to resume elsewhere
    await drain.settle(CUT_GRACE_S)  # those connections' last bytes reach daphne
    await runs.flush(2.0)  # the cut runs' last events, for a resume on another process
    await reset_backends()
    if not await asyncio.to_thread(writer.flush, 10.0):
        logger.warning("draining: some log rows were still unwritten after 10 s")
    await asyncio.sleep(FLUSH_S)
    # Last, and nothing awaited after it: refusals go on until the stop, counted a second later.
    await refusals.flush_now()
    logger.info("drained")


class DrainingCommandLineInterface(CommandLineInterface):
    description = "Persona Quotes: daphne, draining open streams on SIGTERM"
    server_class = staticmethod(draining_server)


if __name__ == "__main__":
    DrainingCommandLineInterface.entrypoint()
