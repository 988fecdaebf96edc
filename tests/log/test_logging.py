"""Request ids, JSON log lines, and what never reaches a log line."""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

import pytest

from quotes.logging import JsonFormatter, RequestIdFilter, TextFormatter
from tests.asgi import request
from tests.fixtures import TEST_API_TOKEN

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


@pytest.mark.integration
async def test_request_id_is_taken_from_the_proxy_returned_and_logged(captured: Capture) -> None:
    response = await request("GET", "/", headers={"x-request-id": "edge-1234.abc"})
    assert response.headers["x-request-id"] == "edge-1234.abc"
    access = [r for r in captured.records if r.name == "quotes.request"]
    assert access and access[-1].request_id == "edge-1234.abc"  # type: ignore[attr-defined]
    assert access[-1].status == 200  # type: ignore[attr-defined]


@pytest.mark.integration
@pytest.mark.parametrize("incoming", ["", "has space", "x" * 200, "new\nline", 'quote"'])
async def test_a_missing_or_odd_request_id_is_replaced(incoming: str) -> None:
    headers = {"x-request-id": incoming} if incoming and "\n" not in incoming else {}
    response = await request("GET", "/", headers=headers)
    made = response.headers["x-request-id"]
    assert made != incoming and len(made) == 32 and made.isalnum()


@pytest.mark.integration
async def test_stream_log_lines_carry_the_request_id(
    captured: Capture, workers_ai_settings: Any, fake_workers_ai: Any, persona: Any
) -> None:
    from harness.workers_ai import Scenario

    fake_workers_ai.script(Scenario.out_of_capacity())
    response = await request(
        "POST", "/api/quotes/stream", json_body={"persona": persona.slug}, headers={"x-request-id": "rid-42"}
    )
    assert response.status == 429
    backend_lines = [r for r in captured.records if r.name == "quotes.ai.backends.workers_ai"]
    assert backend_lines and all(r.request_id == "rid-42" for r in backend_lines)  # type: ignore[attr-defined]


@pytest.mark.integration
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


@pytest.mark.integration
def test_json_formatter_writes_one_object_per_line_with_the_request_id() -> None:
    formatter = JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s")
    # A fresh context: outside any request there is no request id, whatever ran before.
    line = contextvars.Context().run(lambda: formatter.format(_record("hello %s", "world")))
    data = json.loads(line)
    assert data["message"] == "hello world" and data["level"] == "WARNING" and data["logger"] == "quotes.test"
    assert data["request_id"] == "-" and "timestamp" in data


@pytest.mark.integration
@pytest.mark.parametrize("formatter", [JsonFormatter("%(message)s"), TextFormatter("%(message)s")])
def test_formatters_never_write_the_api_token(formatter: logging.Formatter, settings: Any) -> None:
    settings.CLOUDFLARE_API_TOKEN = TEST_API_TOKEN
    line = formatter.format(_record("upstream said: bad token %s", TEST_API_TOKEN))
    assert TEST_API_TOKEN not in line and "[redacted]" in line


@pytest.mark.integration
@pytest.mark.parametrize("formatter", [JsonFormatter("%(message)s"), TextFormatter("%(message)s")])
def test_formatters_never_write_the_metrics_token(formatter: logging.Formatter, settings: Any) -> None:
    settings.QUOTES_METRICS_TOKEN = "metrics-token-5b1e9c0d7a"
    line = formatter.format(_record("a scrape sent %s", "Bearer metrics-token-5b1e9c0d7a"))
    assert "metrics-token-5b1e9c0d7a" not in line and "[redacted]" in line


# --- visitors' topics stay out of every log the project configures (issue 13) -----------------

SECRET_TOPIC = "my-secret-topic-4711"
#: What an EventSource sends: a GET of the stream without it is refused (406) before its query is read.
EVENTSOURCE = {"accept": "text/event-stream"}


@pytest.fixture(params=["json", "text"])
def console(request: pytest.FixtureRequest, settings: Any) -> Any:
    """The console handler's formatter as config/settings.py builds it, writing to a buffer."""
    import io
    import logging.config

    import config.asgi

    config = settings.LOGGING["formatters"][request.param]
    formatter = logging.config.DictConfigurator({"version": 1}).configure_custom(dict(config))
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    yield buffer
    root.removeHandler(handler)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("path", "query", "status"),
    [
        ("/nope/", f"topic={SECRET_TOPIC}", 404),  # the URL resolver's 404
        ("/api/quotes/stream", f"persona=Not+A+Slug&topic={SECRET_TOPIC}", 404),  # EventSource's GET
        ("/api/quotes/stream", f"persona=test-watts&topic={SECRET_TOPIC}&messages=nope", 400),
    ],
)
async def test_django_request_log_has_no_query_string(
    console: Any, settings: Any, persona: Any, path: str, query: str, status: int
) -> None:
    """django.request logs every 4xx with the request on the record, whose repr has the query."""
    settings.QUOTES_LOG_CONTENT = False

    response = await request("GET", path, query=query, headers=EVENTSOURCE)

    assert response.status == status
    output = console.getvalue()
    assert "django.request" in output and path in output  # the line is there, without the query
    assert SECRET_TOPIC not in output


@pytest.mark.integration
async def test_django_request_log_keeps_the_query_when_content_logging_is_on(
    console: Any, settings: Any
) -> None:
    settings.QUOTES_LOG_CONTENT = True
    await request("GET", "/nope/", query=f"topic={SECRET_TOPIC}")
    assert SECRET_TOPIC in console.getvalue()


@pytest.mark.system
@pytest.mark.parametrize(
    "source", ["systemd/persona-quotes@.service", "systemd/persona-quotes.service", "Dockerfile"]
)
def test_deployed_nginx_and_daphne_log_no_topic(source: str, tmp_path: Any) -> None:
    """The chain as deployed: a real nginx with the project's log format and proxy rules, in
    front of daphne started with the flags of `source` under production settings (the
    Dockerfile's CMD is run here without Docker). A topic in a query string, or in the Referer,
    reaches neither nginx's access log nor daphne's output (its access log, the app's logs)."""

    import httpx

    from harness.daphne import ROOT, environment, running_daphne
    from harness.services import deploy_site, free_port, nginx

    app_port, proxy_port = free_port(), free_port()
    env = environment(
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DATABASE_URL=f"sqlite:///{tmp_path / 'unused.sqlite3'}",  # the requests below need none
    )
    site = deploy_site(
        proxy_port,
        [f"127.0.0.1:{app_port}"],
        http=f"include {ROOT / 'deploy/nginx/persona-quotes-log.conf'};",
        server=f"access_log {tmp_path / 'nginx-access.log'} persona_quotes;",
    )
    # JSON answers (the HTML error pages would need collectstatic's manifest), each logged by
    # django.request: the stream API's 404 for an unknown persona, and the feedback API's 405.
    paths = [
        ("/api/quotes/stream", f"persona=Not+A+Slug&topic={SECRET_TOPIC}", 404),
        ("/api/quotes/00000000-0000-4000-8000-000000000000/feedback", f"topic={SECRET_TOPIC}", 405),
    ]
    app_log = tmp_path / "daphne.log"
    with running_daphne(source, app_port, env, app_log), nginx(tmp_path, site=site, port=proxy_port) as proxy:
        headers = {"Referer": f"http://127.0.0.1/personas/alan-watts/?topic={SECRET_TOPIC}", **EVENTSOURCE}
        for path, query, status in paths:
            response = httpx.get(f"{proxy.url}{path}?{query}", headers=headers, timeout=10)
            assert response.status_code == status, response.text

    access = (tmp_path / "nginx-access.log").read_text()
    app_output = app_log.read_text()
    for path, _, status in paths:
        assert f'"GET {path} HTTP/1.1" {status}' in access, access
        assert f'"path": "{path}"' in app_output, app_output  # the app's own access line
    assert "/personas/alan-watts/" in access  # the Referer, without its query
    assert '"logger": "django.request"' in app_output, app_output
    assert SECRET_TOPIC not in access
    assert SECRET_TOPIC not in app_output


@pytest.mark.integration
def test_nginx_site_logs_every_server_in_the_query_free_format() -> None:
    from pathlib import Path

    site = (Path(__file__).resolve().parents[2] / "deploy/nginx/persona-quotes.conf").read_text()
    servers = site.count("server {")
    assert servers == 4  # the public site on 80 and 443, and one metrics port per daphne process
    assert site.count("access_log /var/log/nginx/persona-quotes.access.log persona_quotes;") == servers
    assert "include /etc/nginx/snippets/persona-quotes-log.conf;" in site


# --- issue 20: a developer's server, and a raw quote in a query string ----------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "query",
    [
        f"topic=it's-{SECRET_TOPIC}",  # a raw quote ended the redaction, leaving the rest
        f"topic=x'>{SECRET_TOPIC}",
        f'topic=x"{SECRET_TOPIC}',
        f"persona=Not+A+Slug&topic=a'b'c'{SECRET_TOPIC}",
    ],
)
async def test_django_request_log_has_no_query_string_with_quotes_in_it(
    console: Any, settings: Any, persona: Any, query: str
) -> None:
    settings.QUOTES_LOG_CONTENT = False

    response = await request("GET", "/api/quotes/stream", query=query, headers=EVENTSOURCE)

    assert response.status in (400, 404)
    output = console.getvalue()
    assert "django.request" in output and "/api/quotes/stream" in output
    assert SECRET_TOPIC not in output, output


def _raw_get(url: str, target: str, headers: str = "") -> int:
    """One request sent byte for byte (httpx would percent-encode a quote or a `>`); its status."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(
            f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


#: A CSRF cookie, so Django's CSRF check reads the form's fields (and meets what is wrong with them).
FORM = {"content-type": "application/x-www-form-urlencoded", "cookie": "csrftoken=" + "a" * 32}


@pytest.fixture(scope="module", params=["development", "production"])
def served_output(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """What the server of `make run` (the Makefile's `serve`: `python -m quotes.server` with
    daphne's access log on) writes for visitors' topics in query strings and for clients'
    mistakes, in development (DEBUG, text lines) and under production settings (JSON lines).
    Returns (each request's status, the output)."""

    import httpx

    from harness.daphne import environment, make_command, running
    from harness.services import free_port

    tmp = tmp_path_factory.mktemp(f"served-{request.param}")
    env = environment(
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DATABASE_URL=f"sqlite:///{tmp / 'unused.sqlite3'}",  # the requests below need none
    )
    if request.param == "development":
        env["DJANGO_DEBUG"] = "true"
    port, log = free_port(), tmp / "server.log"
    statuses: dict[str, int] = {}
    serve = make_command("serve", port)
    with running(serve, port, env, log, path="/api/quotes/stream", any_status=True) as (_, url):
        stream = "/api/quotes/stream?persona=Not+A+Slug&topic="
        statuses["topic"] = httpx.get(f"{url}{stream}{SECRET_TOPIC}", headers=EVENTSOURCE).status_code
        accept = "Accept: text/event-stream\r\n"
        statuses["quote"] = _raw_get(url, f"{stream}it's-{SECRET_TOPIC}", accept)
        statuses["quote-bracket"] = _raw_get(url, f"{stream}x'>{SECRET_TOPIC}", accept)
        feedback = f"/api/quotes/00000000-0000-4000-8000-000000000000/feedback?topic={SECRET_TOPIC}"
        statuses["feedback"] = httpx.get(url + feedback).status_code
        statuses["bad-host"] = httpx.get(url + "/", headers={"host": "evil.example"}).status_code
        big = b"csrfmiddlewaretoken=x&a=" + b"x" * (10 * 1024 * 1024)
        statuses["10-mb-form"] = httpx.post(url + "/admin/login/", content=big, headers=FORM).status_code
        fields = "&".join(f"f{n}=1" for n in range(2000)).encode()
        statuses["2000-fields"] = httpx.post(url + "/admin/login/", content=fields, headers=FORM).status_code
    return statuses, log.read_text()


def _lines(output: str) -> list[tuple[str, str, str]]:
    """(level, logger, line) of each log line, text or JSON; daphne's access lines are ("", "")."""
    import re

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
def test_served_output_has_no_topic_in_any_line(served_output: Any) -> None:
    statuses, output = served_output
    assert statuses["topic"] == statuses["quote"] == statuses["quote-bracket"] == 404, statuses
    assert statuses["feedback"] == 405
    access = [
        line for level, _, line in _lines(output) if not level and '"GET /api/quotes/stream" 404' in line
    ]
    assert len(access) == 3, output  # daphne's access lines are there, without their query
    assert SECRET_TOPIC not in output, output


@pytest.mark.system
def test_served_output_logs_clients_mistakes_below_error_without_a_traceback(served_output: Any) -> None:
    statuses, output = served_output
    assert statuses["bad-host"] == statuses["10-mb-form"] == statuses["2000-fields"] == 400, statuses
    lines = _lines(output)
    security = {logger: level for level, logger, _ in lines if logger.startswith("django.security.")}
    assert security == {
        "django.security.DisallowedHost": "WARNING",
        "django.security.RequestDataTooBig": "WARNING",
        "django.security.TooManyFieldsSent": "WARNING",
    }, output
    assert [line for level, _, line in lines if level in ("ERROR", "CRITICAL")] == []
    assert "Traceback" not in output
