"""The path every generation takes, whatever the transport (HTTP, EventSource, WebSocket) and
whatever the backend: admission (an adaptive open-stream limit per process, per-client rate
limits), the answer cache, coalescing, retries, fallbacks, timeouts, keep-alive, and one
`Generation` log row on every outcome, a client disconnect included.

    stream_generation (generation.py): one request, from admission to its log row
      admission.py   the process's open-stream limit, then the client's limits
      capacity.py    that limit: it follows the event loop's lag (an optional static ceiling)
      flights.py     one generation shared by identical requests; a listener per request
      policy.py      retries and fallbacks before the first token; the three timeouts
      rows.py        the row each stream gathers, and the group-commit writer

Each part can be driven alone; tests/stream/test_gateway.py drives them all through the stream endpoint.
This `__init__` imports nothing: importing any one part (say `capacity`) runs it first.
"""
