"""The model backends and their upstreams: Workers AI, OpenAI-compatible, the embedded model, SSE parsing, voice."""
