"""`python -m quotes.ops.server -b 127.0.0.1 -p 8000 config.asgi:application`: daphne, with
daphne's arguments, that drains on SIGTERM (docs/deployment.md, "Rolling restart") where plain
daphne cancels every open stream; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from daphne.cli import CommandLineInterface
from daphne.server import Server

logger = logging.getLogger("quotes.server")


def without_query(action_logger: Callable[..., None]) -> Callable[..., None]:
    """daphne's access log, each path without its query string (where visitors' topics go)."""

    def log(protocol: str, action: str, details: dict[str, Any]) -> None:
        path = details.get("path")
        if isinstance(path, str) and "?" in path:
            details = {**details, "path": path.partition("?")[0]}
        action_logger(protocol, action, details)

    return log


def draining_server(**options: Any) -> Server:
    draining: list[asyncio.Task[None]] = []

    def on_signal(number: int) -> None:
        if draining:
            logger.warning("%s again: stopping now", signal.Signals(number).name)
            server.stop()
        else:
            logger.info("%s: draining before exit", signal.Signals(number).name)
            draining.append(asyncio.ensure_future(drain_then_stop(server)))

    def ready() -> None:  # in Server.run(), before the reactor runs daphne's loop
        loop = asyncio.get_event_loop()
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, on_signal, number)
        mark_lost_rows()
        warn_about_models()

    if options.get("action_logger") is not None:
        options["action_logger"] = without_query(options["action_logger"])
    server = Server(signal_handlers=False, ready_callable=ready, **options)
    return server


def mark_lost_rows() -> None:
    """The rows a process that died (this one's previous life, say) left `running`: marked lost."""
    from django.db import DatabaseError

    from quotes.services import generations_mark_lost

    try:
        if marked := generations_mark_lost():
            logger.warning("%d log rows left running by a process that died were marked lost", marked)
    except DatabaseError as exc:  # not migrated yet, or down: the next start, or the prune, marks them
        logger.warning("the rows left running were not marked lost: %s", exc)
    except Exception:  # the server starts all the same
        logger.exception("the rows left running could not be marked lost")


def warn_about_models() -> None:
    """What `manage.py check --database default` says of the models personas and settings name
    (retired by Cloudflare, or unknown), once, as the server starts."""
    from quotes import checks

    try:
        found = [
            *checks.settings_on_retired_models(),
            *checks.personas_on_retired_models(databases=["default"]),
        ]
    except Exception:
        logger.exception("the models of the personas could not be checked")
        return
    for message in found:
        logger.warning("%s %s", message.msg, message.hint)


async def drain_then_stop(server: Server) -> None:
    # Imported once daphne has loaded the app, and Django with it.
    from django.conf import settings

    from quotes.admission import drain
    from quotes.backends import reset_backends
    from quotes.rows import writer

    try:
        cut = await drain(settings.QUOTES_DRAIN_TIMEOUT_S)
        if cut:
            logger.warning(
                "draining: %d streams still open at the deadline were told to resume elsewhere", cut
            )
        await asyncio.sleep(0.5)  # their last bytes reach the clients
        await reset_backends()
        await writer().flush(10.0)
        logger.info("drained")
    except Exception:
        logger.exception("draining failed; stopping anyway")
    finally:
        server.stop()


class DrainingCommandLineInterface(CommandLineInterface):
    description = "Persona Quotes: daphne, draining open streams on SIGTERM"
    server_class = staticmethod(draining_server)

    def run(self, args: list[str]) -> None:
        super().run(args)
        from quotes.rows import write_refusals_left  # Django is set up once daphne has loaded the app

        try:
            write_refusals_left()  # answered after the drain's last write
        except Exception:
            logger.exception("could not write the last refusal counts")


if __name__ == "__main__":
    DrainingCommandLineInterface.entrypoint()
