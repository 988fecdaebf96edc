"""The stream endpoint end to end: SSE, WebSocket and htmx, resume, capacity, the gateway."""
