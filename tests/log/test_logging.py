"""Request ids, JSON and text log lines (quotes/ops/logging.py), and what never reaches a line:
visitors' topics in query strings, and the configured credentials."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import logging.config
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daphne import environment, make_command, running
from harness.services import free_port
from harness.workers_ai import Scenario
from quotes.ops.logging import JsonFormatter, RequestIdFilter, TextFormatter
from tests.asgi import request
from tests.fixtures import TEST_API_TOKEN

SECRET_TOPIC = "my-secret-topic-4711"
UNKNOWN_ID = "00000000-0000-4000-8000-000000000000"
ES = {"accept": "text/event-stream"}  # a GET of the stream without it is refused before its query is read


@pytest.fixture(params=["json", "text"])
def console(request: pytest.FixtureRequest, settings: Any) -> Iterator[tuple[io.StringIO, list[Any]]]:
    """The console handler's formatter as config/settings.py builds it, writing to a buffer; and
    the records it wrote."""
    import config.asgi  # noqa: F401  (its first import configures logging, which replaces root handlers)

    formatter = logging.config.DictConfigurator({"version": 1}).configure_custom(
        dict(settings.LOGGING["formatters"][request.param])
    )
    buffer, records = io.StringIO(), []
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    handler.addFilter(lambda record: records.append(record) or True)
    logging.getLogger().addHandler(handler)
    yield buffer, records
    logging.getLogger().removeHandler(handler)


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_request_id_is_taken_from_the_proxy_returned_and_logged(console: Any) -> None:
    buffer, records = console
    response = await request("GET", "/", headers={"x-request-id": "edge-1234.abc"})

    assert response.headers["x-request-id"] == "edge-1234.abc"
    [access] = [r for r in records if r.name == "quotes.request"]
    assert (access.request_id, access.status) == ("edge-1234.abc", 200)
    assert "edge-1234.abc" in buffer.getvalue()
    for odd in ("has space", "x" * 200, 'quote"'):  # replaced, so no line carries what a client made up
        made = (await request("GET", "/", headers={"x-request-id": odd})).headers["x-request-id"]
        assert made != odd and len(made) == 32 and made.isalnum()


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_a_streams_lines_carry_its_request_id(console: Any, fake: Any, persona: Any) -> None:
    fake.script(Scenario.model_not_found())
    body, headers = {"persona": persona.slug}, {"x-request-id": "rid-42"}
    response = await request("POST", "/api/quotes/stream", json_body=body, headers=headers)

    assert response.status == 502
    backend_lines = [r for r in console[1] if r.name == "quotes.backends.workers_ai"]
    assert backend_lines and all(r.request_id == "rid-42" for r in backend_lines)


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("path", "query", "status"),
    [
        ("/nope/", f"topic={SECRET_TOPIC}", 404),  # the URL resolver's 404
        ("/api/quotes/stream", f"persona=Not+A+Slug&topic={SECRET_TOPIC}", 404),  # EventSource's GET
        ("/api/quotes/stream", f"persona=test-watts&topic={SECRET_TOPIC}&messages=nope", 400),
        ("/api/quotes/stream", f"topic=it's-{SECRET_TOPIC}", 400),  # a raw quote must not end the redaction
        ("/api/quotes/stream", f"persona=Not+A+Slug&topic=x'>{SECRET_TOPIC}", 404),
        ("/api/quotes/stream", f'topic=x"{SECRET_TOPIC}', 400),
    ],
)
async def test_no_line_has_a_query_string_unless_content_logging_is_on(
    console: Any, settings: Any, persona: Any, path: str, query: str, status: int
) -> None:
    """django.request logs every 4xx with the request on the record, whose repr has the query; the
    access line has the path."""
    buffer, records = console

    assert (await request("GET", path, query=query, headers=ES)).status == status

    assert "django.request" in buffer.getvalue() and path in buffer.getvalue()  # the lines, without the query
    assert [r.path for r in records if r.name == "quotes.request"] == [path]
    assert SECRET_TOPIC not in buffer.getvalue()
    settings.QUOTES_LOG_CONTENT = True
    await request("GET", path, query=query, headers=ES)
    assert SECRET_TOPIC in buffer.getvalue()
    assert [r.path for r in records if r.name == "quotes.request"][-1].startswith(f"{path}?")


@pytest.mark.unit
def test_json_lines_are_one_object_each_and_no_formatter_writes_a_secret(settings: Any) -> None:
    settings.CLOUDFLARE_API_TOKEN, settings.QUOTES_METRICS_TOKEN = TEST_API_TOKEN, "metrics-token-5b1e9c0d7a"
    record = logging.LogRecord("quotes.test", logging.WARNING, __file__, 1, "hello %s", ("world",), None)
    formatter = JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s")

    def format_outside_any_request() -> str:  # a fresh context: no request id, whatever ran before
        RequestIdFilter().filter(record)
        return formatter.format(record)

    data = json.loads(contextvars.Context().run(format_outside_any_request))
    assert (data["message"], data["level"], data["logger"]) == ("hello world", "WARNING", "quotes.test")
    assert data["request_id"] == "-" and "timestamp" in data

    for formatter in (JsonFormatter("%(message)s"), TextFormatter("%(message)s")):
        for secret in (TEST_API_TOKEN, "Bearer metrics-token-5b1e9c0d7a"):
            record.msg, record.args = "upstream said: %s", (secret,)
            line = formatter.format(record)
            assert secret.split()[-1] not in line and "[redacted]" in line, line


def _lines(output: str) -> list[tuple[str, str, str]]:
    """(level, logger, line) of each log line, text or JSON; daphne's access lines are ("", "")."""
    found = []
    for line in output.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            found.append((data["level"], data["logger"], line))
        elif match := re.match(r"\d{4}-\d\d-\d\d [\d:,]+ (\w+) (\S+) ", line):
            found.append((match[1], match[2], line))
        else:
            found.append(("", "", line))
    return found


@pytest.mark.system
@pytest.mark.parametrize("mode", ["development", "production"])
def test_the_served_output_has_no_topic_and_clients_mistakes_are_no_errors(tmp_path: Path, mode: str) -> None:
    """The server of `make run` (`python -m quotes.ops.server` with daphne's access log on), in
    development (DEBUG, text lines) and under production settings (JSON lines): visitors' topics
    in query strings reach no line, and a client's mistake is logged below ERROR, without a
    traceback."""
    env = environment(DJANGO_ALLOWED_HOSTS="127.0.0.1", DATABASE_URL=f"sqlite:///{tmp_path / 'unused.db'}")
    if mode == "development":
        env["DJANGO_DEBUG"] = "true"
    port, log = free_port(), tmp_path / "server.log"
    stream, sent = "/api/quotes/stream?persona=Not+A+Slug&topic=", (SECRET_TOPIC, f"it's-{SECRET_TOPIC}")
    form = {"content-type": "application/x-www-form-urlencoded", "cookie": "csrftoken=" + "a" * 32}
    server = running(make_command("serve", port), port, env, log, path="/api/quotes/stream", any_status=True)
    with server as (_, url):
        topics = [httpx.get(f"{url}{stream}{t}", headers=ES).status_code for t in sent]
        feedback = httpx.get(f"{url}/api/quotes/{UNKNOWN_ID}/feedback?topic={SECRET_TOPIC}")
        bad_host = httpx.get(url + "/", headers={"host": "evil.example"})
        big_form = httpx.post(url + "/admin/login/", content=b"a=" + b"x" * (10 * 1024 * 1024), headers=form)
        fields = "&".join(f"f{n}=1" for n in range(2000))
        many_fields = httpx.post(url + "/admin/login/", content=fields, headers=form)
    output = log.read_text()

    assert topics == [404, 404] and feedback.status_code == 405
    assert bad_host.status_code == big_form.status_code == many_fields.status_code == 400
    assert len([line for level, _, line in _lines(output) if not level and "/api/quotes/stream" in line]) >= 2
    assert SECRET_TOPIC not in output, output
    security = {logger: level for level, logger, _ in _lines(output) if logger.startswith("django.security.")}
    assert security == {
        "django.security.DisallowedHost": "WARNING",
        "django.security.RequestDataTooBig": "WARNING",
        "django.security.TooManyFieldsSent": "WARNING",
    }, output
    assert [line for level, _, line in _lines(output) if level in ("ERROR", "CRITICAL")] == []
    assert "Traceback" not in output
