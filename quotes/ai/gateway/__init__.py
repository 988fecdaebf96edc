"""The path every generation takes, whatever the transport and the backend: admission, the
answer cache, coalescing, retries, fallbacks, timeouts, and one log row on every outcome
(docs/architecture.md). This `__init__` imports nothing: importing any one part runs it first.
"""
