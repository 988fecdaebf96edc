"""WhiteNoise, given an async entry point.

WhiteNoise's middleware is sync-only, and one sync middleware makes Django hop to a thread on
every request, the SSE stream included. This subclass keeps WhiteNoise's file finding,
compression negotiation and caching headers, but only requests under STATIC_URL touch a
thread; everything else passes straight through on the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        super().__init__(get_response)
        markcoroutinefunction(self)

    def add_files(self, root: str, prefix: str | None = None) -> None:
        # Before collectstatic has run (development, tests) the finders serve the files, so a
        # missing STATIC_ROOT is expected; without finders WhiteNoise's warning stays.
        if self.use_finders and not os.path.isdir(root):
            return
        super().add_files(root, prefix)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if request.path_info.startswith(self.static_prefix):
            response = await sync_to_async(self._serve_static, thread_sensitive=False)(request)
            if response is not None:
                return response
        return await self.get_response(request)

    def _serve_static(self, request: HttpRequest) -> HttpResponse | None:
        path = request.path_info
        static_file: Any = self.find_file(path) if self.autorefresh else self.files.get(path)
        if static_file is None:
            return None
        found = static_file.get_response(request.method, request.META)
        # Static files are small: read them here, in the thread, so the event loop never does file I/O.
        body = b""
        if found.file is not None:
            with found.file:
                body = found.file.read()
        response = HttpResponse(body, status=int(found.status))
        del response["Content-Type"]
        for key, value in found.headers:
            response[key] = value
        return response
