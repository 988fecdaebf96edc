"""A WebSocket client in a process of its own, for tests of real daphnes: autobahn's asyncio
client (installed with daphne), which cannot run in the test process (daphne's import sets
txaio to Twisted there).

    python -m tests.ws_client ws://host:port/ws/quotes/ http://host:port STEP...

Each STEP is `send:<json>` (send that frame), `read:<n>` (wait for n frames) or
`until:<type>` (wait for a frame of that type). Every frame received is printed as a JSON
line. Exits 1 when a wait takes more than 10 s.
"""

from __future__ import annotations

import asyncio
import json
import sys

from autobahn.asyncio.websocket import WebSocketClientFactory, WebSocketClientProtocol

WAIT_S = 10.0


async def main(url: str, origin: str, steps: list[str]) -> int:
    loop = asyncio.get_running_loop()
    opened: asyncio.Future[WebSocketClientProtocol] = loop.create_future()
    frames: asyncio.Queue[dict[str, object]] = asyncio.Queue()

    class Protocol(WebSocketClientProtocol):  # type: ignore[misc]
        def onOpen(self) -> None:
            opened.set_result(self)

        def onMessage(self, payload: bytes, is_binary: bool) -> None:
            frames.put_nowait(json.loads(payload))

    factory = WebSocketClientFactory(url, origin=origin)
    factory.protocol = Protocol
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    await loop.create_connection(factory, host, int(port))
    socket = await asyncio.wait_for(opened, WAIT_S)

    async def receive() -> dict[str, object]:
        frame = await asyncio.wait_for(frames.get(), WAIT_S)
        print(json.dumps(frame), flush=True)
        return frame

    try:
        for step in steps:
            kind, _, argument = step.partition(":")
            if kind == "send":
                socket.sendMessage(argument.encode())
            elif kind == "read":
                for _ in range(int(argument)):
                    await receive()
            elif kind == "until":
                while (await receive())["type"] != argument:
                    pass
            else:
                raise SystemExit(f"unknown step {step!r}")
    except TimeoutError:
        return 1
    socket.sendClose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
