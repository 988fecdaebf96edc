"""Request ids, JSON log lines, and what never reaches a log line."""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

import pytest

from quotes.logging import JsonFormatter, RequestIdFilter, TextFormatter
from tests.asgi import request
from tests.fakes.fixtures import TEST_API_TOKEN

pytestmark = pytest.mark.django_db(transaction=True)


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Any:
    # Import the app first: its first import configures logging, which replaces root handlers.
    import config.asgi  # noqa: F401

    handler = Capture()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)


async def test_request_id_is_taken_from_the_proxy_returned_and_logged(captured: Capture) -> None:
    response = await request("GET", "/", headers={"x-request-id": "edge-1234.abc"})
    assert response.headers["x-request-id"] == "edge-1234.abc"
    access = [r for r in captured.records if r.name == "quotes.request"]
    assert access and access[-1].request_id == "edge-1234.abc"  # type: ignore[attr-defined]
    assert access[-1].status == 200  # type: ignore[attr-defined]


@pytest.mark.parametrize("incoming", ["", "has space", "x" * 200, "new\nline", 'quote"'])
async def test_a_missing_or_odd_request_id_is_replaced(incoming: str) -> None:
    headers = {"x-request-id": incoming} if incoming and "\n" not in incoming else {}
    response = await request("GET", "/", headers=headers)
    made = response.headers["x-request-id"]
    assert made != incoming and len(made) == 32 and made.isalnum()


async def test_stream_log_lines_carry_the_request_id(
    captured: Capture, workers_ai_settings: Any, fake_workers_ai: Any, persona: Any
) -> None:
    from tests.fakes.workers_ai import Scenario

    fake_workers_ai.script(Scenario.out_of_capacity())
    response = await request(
        "POST", "/api/quotes/stream", json_body={"persona": persona.slug}, headers={"x-request-id": "rid-42"}
    )
    assert response.status == 429
    backend_lines = [r for r in captured.records if r.name == "quotes.ai.backends.workers_ai"]
    assert backend_lines and all(r.request_id == "rid-42" for r in backend_lines)  # type: ignore[attr-defined]


async def test_access_line_drops_the_query_unless_content_logging_is_on(
    captured: Capture, settings: Any
) -> None:
    await request("GET", "/", query="topic=my+secret+topic")
    assert [r.path for r in captured.records if r.name == "quotes.request"] == ["/"]  # type: ignore[attr-defined]
    settings.QUOTES_LOG_CONTENT = True
    await request("GET", "/", query="topic=my+secret+topic")
    assert captured.records[-1].path == "/?topic=my+secret+topic"  # type: ignore[attr-defined]


def _record(message: str, *args: object) -> logging.LogRecord:
    record = logging.LogRecord("quotes.test", logging.WARNING, __file__, 1, message, args, None)
    RequestIdFilter().filter(record)
    return record


def test_json_formatter_writes_one_object_per_line_with_the_request_id() -> None:
    formatter = JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s")
    # A fresh context: outside any request there is no request id, whatever ran before.
    line = contextvars.Context().run(lambda: formatter.format(_record("hello %s", "world")))
    data = json.loads(line)
    assert data["message"] == "hello world" and data["level"] == "WARNING" and data["logger"] == "quotes.test"
    assert data["request_id"] == "-" and "timestamp" in data


@pytest.mark.parametrize("formatter", [JsonFormatter("%(message)s"), TextFormatter("%(message)s")])
def test_formatters_never_write_the_api_token(formatter: logging.Formatter, settings: Any) -> None:
    settings.CLOUDFLARE_API_TOKEN = TEST_API_TOKEN
    line = formatter.format(_record("upstream said: bad token %s", TEST_API_TOKEN))
    assert TEST_API_TOKEN not in line and "[redacted]" in line


@pytest.mark.parametrize("formatter", [JsonFormatter("%(message)s"), TextFormatter("%(message)s")])
def test_formatters_never_write_the_metrics_token(formatter: logging.Formatter, settings: Any) -> None:
    settings.QUOTES_METRICS_TOKEN = "metrics-token-5b1e9c0d7a"
    line = formatter.format(_record("a scrape sent %s", "Bearer metrics-token-5b1e9c0d7a"))
    assert "metrics-token-5b1e9c0d7a" not in line and "[redacted]" in line
