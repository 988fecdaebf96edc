"""Malformed requests to every HTTP endpoint, through the real ASGI app (config.asgi): each gets
its 4xx answer, never a 500 — JSON errors from the API, readable pages from the HTML endpoints;
a Hypothesis fuzz of the stream endpoint's input; template-injection topics reach the model as
literal text; and the API token never shows in the admin's log pages or its CSV export (the
other secret paths are covered in tests/backends/test_workers_ai_endpoint.py).
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pytest
from django.conf import settings as django_settings
from django.test import Client
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.ai.backends import _backends
from quotes.models import Generation, Persona
from tests.asgi import AsgiStream, StreamedResponse
from tests.fixtures import TEST_API_TOKEN

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

STREAM_URL = "/api/quotes/stream"
FORM_URL = "/quotes/stream"  # the persona page's form
JSON = {"content-type": "application/json"}
#: What an EventSource sends: a GET of the stream must accept the stream (or be a fetch()).
ES = {"accept": "text/event-stream"}
#: An id of a quote nobody is writing, and a resume key that is not its own.
UNKNOWN_ID = "00000000-0000-4000-8000-000000000000"
#: a CSRF cookie, so Django's CSRF check reads a form's fields (and meets what is wrong with them)
FORM = {"content-type": "application/x-www-form-urlencoded", "cookie": "csrftoken=" + "a" * 32}
MAX_BODY = django_settings.QUOTES_MAX_BODY_BYTES
TOO_LONG_TOPIC = "x" * (django_settings.QUOTES_MAX_TOPIC_CHARS + 1)
INJECTIONS = ("{topic}", "{{7*7}}", "{% debug %}", "%(x)s", "${7*7}", "{0.__class__}", "</script><b>x")


@pytest.fixture(autouse=True)
async def _close_workers_ai_on_this_loop() -> AsyncIterator[None]:
    """The workers-ai backend's httpx client belongs to the test's loop (the embedded model stays loaded)."""
    yield
    backend = _backends.pop("workers-ai", None)
    if backend is not None:
        await backend.aclose()


async def send(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, query: str = ""
) -> StreamedResponse:
    """One request; a 200 stream is closed after its headers (its body is not the point here)."""
    stream = AsgiStream(method, path, body=body, headers=headers, query=query)
    response = await stream.start()
    if response.status == 200 and response.headers.get("content-type") == "text/event-stream":
        await stream.disconnect()
        return response
    return await stream.read_all()


def assert_json_error(response: StreamedResponse, status: int, code: str | None = None) -> None:
    assert response.status == status, (response.status, response.body[:300])
    assert response.headers["content-type"] == "application/json", response.headers
    payload = response.json()
    assert set(payload) == {"error"} and set(payload["error"]) == {"code", "message"}, payload
    assert isinstance(payload["error"]["code"], str) and payload["error"]["code"]
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"].strip()
    if code is not None:
        assert payload["error"]["code"] == code, payload


def assert_readable_page(response: StreamedResponse, status: int) -> None:
    assert response.status == status, (response.status, response.body[:300])
    assert response.headers["content-type"].startswith("text/html"), response.headers
    page = response.body.decode()
    assert "<html" in page.lower() or "<!doctype" in page.lower(), page[:300]
    assert "Traceback" not in page


# -- the battery ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    query: str = ""
    status: int = 400
    #: the JSON error code; None: an HTML page is expected
    code: str | None = None


def post_json(body: object, **kwargs: Any) -> Bad:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Bad("POST", STREAM_URL, raw, {**JSON, "content-length": str(len(raw))}, **kwargs)


def nested(depth: int) -> bytes:
    return b'{"persona": "test-watts", "topic": ' + b"[" * depth + b"]" * depth + b"}"


BATTERY = [
    # -- POST /api/quotes/stream: the body
    pytest.param(
        Bad("POST", STREAM_URL, b'{"persona":"test-watts"}', status=415, code="unsupported_media_type"),
        id="no-content-type",
    ),
    pytest.param(
        Bad(
            "POST",
            STREAM_URL,
            b'{"persona":"test-watts"}',
            {"content-type": "text/plain"},
            status=415,
            code="unsupported_media_type",
        ),
        id="text-plain",
    ),
    pytest.param(
        Bad(
            "POST",
            STREAM_URL,
            b"persona=test-watts",
            {"content-type": "application/x-www-form-urlencoded"},
            status=415,
            code="unsupported_media_type",
        ),
        id="form-encoded",
    ),
    pytest.param(post_json(b"", code="invalid_json"), id="empty-body"),
    pytest.param(post_json(b'{"persona": "test-watts"', code="invalid_json"), id="truncated-json"),
    pytest.param(post_json(b'{"persona": "\xff\xfe\xfd"}', code="invalid_json"), id="invalid-utf8"),
    pytest.param(post_json(b"\xef\xbb\xbf\x00\x00", code="invalid_json"), id="bom-and-nul-bytes"),
    pytest.param(post_json(["test-watts"], code="invalid_json"), id="json-array"),
    pytest.param(post_json("test-watts", code="invalid_json"), id="json-string"),
    pytest.param(post_json(None, code="invalid_json"), id="json-null"),
    pytest.param(post_json(42, code="invalid_json"), id="json-number"),
    pytest.param(post_json(b"NaN", code="invalid_json"), id="json-nan"),
    pytest.param(post_json(b"x" * (MAX_BODY + 1), status=413, code="body_too_large"), id="huge-body"),
    pytest.param(
        post_json(
            {"persona": "test-watts", "topic": "y" * (MAX_BODY + 1)}, status=413, code="body_too_large"
        ),
        id="huge-topic-body",
    ),
    pytest.param(
        # As a chunked request arrives: no Content-Length header.
        Bad(
            "POST",
            STREAM_URL,
            json.dumps({"persona": "test-watts", "topic": "y" * (MAX_BODY + 1)}).encode(),
            JSON,
            status=413,
            code="body_too_large",
        ),
        id="huge-body-without-content-length",
    ),
    pytest.param(
        post_json(nested(5000), code="invalid_json"),
        id="deeply-nested-json",
    ),
    # -- POST /api/quotes/stream: the fields
    pytest.param(post_json({}, code="missing_persona"), id="no-persona"),
    pytest.param(post_json({"persona": ""}, code="missing_persona"), id="empty-persona"),
    pytest.param(post_json({"persona": 7}, code="invalid_persona"), id="persona-int"),
    pytest.param(post_json({"persona": ["test-watts"]}, code="invalid_persona"), id="persona-list"),
    pytest.param(post_json({"persona": {"slug": "test-watts"}}, code="invalid_persona"), id="persona-object"),
    pytest.param(post_json({"persona": "nobody"}, status=404, code="unknown_persona"), id="unknown-persona"),
    pytest.param(
        post_json({"persona": "{{7*7}}"}, status=404, code="unknown_persona"), id="persona-template"
    ),
    pytest.param(
        post_json({"persona": "test-watts\u0000"}, status=404, code="unknown_persona"), id="persona-nul"
    ),
    pytest.param(
        post_json({"persona": "x" * 5000}, status=404, code="unknown_persona"), id="persona-5000-chars"
    ),
    pytest.param(post_json({"persona": "test-watts", "topic": 7}, code="invalid_topic"), id="topic-int"),
    pytest.param(post_json({"persona": "test-watts", "topic": ["a"]}, code="invalid_topic"), id="topic-list"),
    pytest.param(
        post_json({"persona": "test-watts", "topic": TOO_LONG_TOPIC}, code="topic_too_long"),
        id="topic-too-long",
    ),
    pytest.param(
        post_json({"persona": "test-watts", "messages": "hi"}, code="invalid_messages"), id="messages-string"
    ),
    pytest.param(
        post_json({"persona": "test-watts", "messages": [{"role": "user"}]}, code="invalid_messages"),
        id="messages-no-content",
    ),
    pytest.param(
        post_json(
            {"persona": "test-watts", "messages": [{"role": "system", "content": "x"}]},
            code="invalid_message_role",
        ),
        id="messages-system-role",
    ),
    pytest.param(
        post_json(
            {"persona": "test-watts", "messages": [{"role": ["user"], "content": "x"}]},
            code="invalid_message_role",
        ),
        id="messages-role-list",
    ),
    pytest.param(
        post_json(
            {"persona": "test-watts", "messages": [{"role": "user", "content": ""}]}, code="invalid_messages"
        ),
        id="messages-empty-content",
    ),
    pytest.param(
        post_json(
            {"persona": "test-watts", "messages": [{"role": "user", "content": "x"}] * 1000},
            code="too_many_messages",
        ),
        id="messages-too-many",
    ),
    # -- issue 13: text that is not Unicode (a lone surrogate, as a JSON escape)
    pytest.param(
        post_json(b'{"persona": "test-watts", "topic": "rain \\ud800"}', code="invalid_unicode"),
        id="topic-lone-surrogate",
    ),
    pytest.param(
        post_json(
            b'{"persona": "test-watts", "messages": [{"role": "user", "content": "\\udfff"}]}',
            code="invalid_unicode",
        ),
        id="message-lone-surrogate",
    ),
    # -- issue 13: another site's page cannot start a generation
    pytest.param(
        Bad(
            "GET",
            STREAM_URL,
            headers={"sec-fetch-site": "cross-site", "accept": "text/event-stream"},
            query="persona=test-watts",
            status=403,
            code="cross_site",
        ),
        id="get-cross-site",
    ),
    # -- issue 20: nor can a sibling subdomain's (the same site, another origin)
    pytest.param(
        Bad(
            "GET",
            STREAM_URL,
            headers={"sec-fetch-site": "same-site", "accept": "text/event-stream"},
            query="persona=test-watts",
            status=403,
            code="cross_site",
        ),
        id="get-same-site",
    ),
    pytest.param(
        Bad(
            "POST",
            STREAM_URL,
            b'{"persona": "test-watts"}',
            {**JSON, "origin": "https://evil.example"},
            status=403,
            code="cross_site",
        ),
        id="post-foreign-origin",
    ),
    # -- other methods and GET
    pytest.param(Bad("PUT", STREAM_URL, b"{}", JSON, status=405, code="method_not_allowed"), id="put"),
    pytest.param(Bad("DELETE", STREAM_URL, status=405, code="method_not_allowed"), id="delete"),
    pytest.param(Bad("PATCH", STREAM_URL, b"{}", JSON, status=405, code="method_not_allowed"), id="patch"),
    pytest.param(Bad("GET", STREAM_URL, headers=ES, code="missing_persona"), id="get-no-persona"),
    pytest.param(
        Bad("GET", STREAM_URL, headers=ES, query="persona=nobody", status=404, code="unknown_persona"),
        id="get-unknown-persona",
    ),
    pytest.param(
        Bad(
            "GET",
            STREAM_URL,
            headers=ES,
            query=f"persona=test-watts&topic={TOO_LONG_TOPIC}",
            code="topic_too_long",
        ),
        id="get-topic-too-long",
    ),
    pytest.param(
        Bad("GET", STREAM_URL, headers=ES, query="persona=%ff%fe", status=404, code="unknown_persona"),
        id="get-invalid-utf8-query",
    ),
    pytest.param(
        Bad("GET", STREAM_URL, headers=ES, query="persona=%00", status=404, code="unknown_persona"),
        id="get-nul-query",
    ),
    # -- issue 29: a GET that is no EventSource nor fetch() (an <img>, a link), and resume ids
    pytest.param(
        Bad(
            "GET",
            STREAM_URL,
            headers={"accept": "image/avif,image/webp,*/*"},
            query="persona=test-watts",
            status=406,
            code="not_acceptable",
        ),
        id="get-as-an-image",
    ),
    pytest.param(
        Bad("GET", STREAM_URL, query="persona=test-watts", status=406, code="not_acceptable"),
        id="get-without-accept",
    ),
    pytest.param(
        Bad(
            "GET", STREAM_URL, headers=ES, query=f"last_event_id={UNKNOWN_ID}:0", code="invalid_last_event_id"
        ),
        id="resume-by-the-id-alone",
    ),
    pytest.param(
        Bad(
            "GET",
            STREAM_URL,
            headers={**ES, "last-event-id": f"{UNKNOWN_ID}.{'0' * 16}:0"},
            status=404,
            code="resume_unavailable",
        ),
        id="resume-with-a-key-not-its-own",
    ),
    # -- the HTML endpoints
    pytest.param(Bad("GET", "/personas/nobody/", status=404), id="persona-page-unknown"),
    pytest.param(Bad("GET", "/personas/{{7*7}}/", status=404), id="persona-page-template-slug"),
    pytest.param(Bad("GET", "/personas/%00/", status=404), id="persona-page-nul"),
    pytest.param(Bad("GET", "/personas/" + "a" * 3000 + "/", status=404), id="persona-page-long-slug"),
    pytest.param(
        Bad(
            "POST",
            "/personas/test-watts/",
            b"x=1",
            {"content-type": "application/x-www-form-urlencoded"},
            status=403,
        ),
        id="persona-page-post-no-csrf",
    ),
    pytest.param(
        Bad("POST", "/", b"x=1", {"content-type": "application/x-www-form-urlencoded"}, status=403),
        id="index-post-no-csrf",
    ),
    pytest.param(Bad("GET", "/no/such/page/", status=404), id="unknown-path"),
    pytest.param(
        Bad(
            "POST",
            "/admin/login/",
            b"username=a&password=b",
            {"content-type": "application/x-www-form-urlencoded"},
            status=403,
        ),
        id="admin-login-no-csrf",
    ),
    # -- issue 20: what Django answers 400 itself, and logged at ERROR with a traceback
    pytest.param(Bad("GET", "/", headers={"host": "evil.example"}), id="bad-host-header"),
    pytest.param(Bad("GET", STREAM_URL, headers={"host": "evil.example:1/x"}), id="bad-host-header-stream"),
    pytest.param(
        Bad("POST", FORM_URL, b"csrfmiddlewaretoken=x&topic=" + b"x" * (10 * 1024 * 1024), FORM),
        id="form-10-mb",
    ),
    pytest.param(
        Bad("POST", FORM_URL, "&".join(f"f{n}=1" for n in range(2000)).encode(), FORM), id="form-2000-fields"
    ),
    pytest.param(
        Bad("POST", "/admin/login/", "&".join(f"f{n}=1" for n in range(2000)).encode(), FORM),
        id="admin-login-2000-fields",
    ),
    pytest.param(
        Bad(
            "GET",
            STREAM_URL,
            headers=ES,
            query="persona=nobody&topic=it's'>x",
            status=404,
            code="unknown_persona",
        ),
        id="get-raw-quotes-in-query",
    ),
    pytest.param(
        Bad("POST", FORM_URL, b"--x\r\nbroken", {**FORM, "content-type": "multipart/form-data; boundary="}),
        id="form-multipart-without-boundary",
    ),
]


@pytest.fixture
def log_output() -> Iterator[io.StringIO]:
    """What the console handler that config/settings.py configures (its filters, its format)
    writes during the test."""
    import config.asgi  # noqa: F401  (its first import configures logging)

    [console] = [h for h in logging.getLogger().handlers if h.get_name() == "console"]
    assert isinstance(console, logging.StreamHandler)
    buffer = io.StringIO()
    previous = console.setStream(buffer)
    yield buffer
    console.setStream(previous)


def assert_no_error_logged(output: str) -> None:
    """A client's mistake is logged at WARNING at most, without a traceback (issue 20)."""
    errors = re.findall(r"^.*\b(?:ERROR|CRITICAL)\b.*$", output, re.MULTILINE)
    assert errors == [], output
    assert "Traceback" not in output, output


@pytest.mark.parametrize("bad", BATTERY)
async def test_bad_input_gets_its_4xx_and_never_a_500(
    persona: Persona, unlimited: Any, log_output: io.StringIO, bad: Bad
) -> None:
    response = await send(bad.method, bad.path, bad.body, bad.headers, bad.query)

    if bad.code is not None:
        assert_json_error(response, bad.status, bad.code)
        if bad.status == 405:
            assert response.headers["allow"] == "GET, POST"
    else:
        assert_readable_page(response, bad.status)
    assert not await Generation.objects.aexists()  # refused before the gateway: nothing to log
    assert_no_error_logged(log_output.getvalue())


def test_bad_input_battery_is_at_least_30_cases() -> None:
    assert len(BATTERY) >= 30


def test_bad_input_admin_login_without_csrf_token_is_403(persona: Persona) -> None:
    client = Client(enforce_csrf_checks=True)
    assert client.get("/admin/login/").status_code == 200

    response = client.post("/admin/login/", {"username": "admin", "password": "x"})

    assert response.status_code == 403
    assert response["content-type"].startswith("text/html")
    assert b"CSRF" in response.content


@pytest.mark.parametrize("topic", INJECTIONS)
async def test_bad_input_template_injection_topic_reaches_the_model_as_literal_text(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, topic: str
) -> None:
    stream = AsgiStream(
        "POST", STREAM_URL, body=json.dumps({"persona": persona.slug, "topic": topic}).encode(), headers=JSON
    )
    await stream.start()
    response = await stream.read_all()

    assert response.status == 200
    [upstream] = fake_workers_ai.requests
    user_prompt = upstream.json["messages"][-1]["content"]
    assert user_prompt == persona.user_prompt_template.replace("{topic}", topic)
    assert "49" not in user_prompt
    row = await Generation.objects.aget()
    assert row.topic == topic


# -- fuzz ------------------------------------------------------------------------------------------

#: Valid requests use these topics, answered from the cache (warmed once per test); the rest of
#: the strategies still reach the model now and then, with a 2-token budget.
WARM_TOPICS = ("rain", "hard honest work", "  rain  ")


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    _containers,
    max_leaves=12,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "persona": st.sampled_from(["test-watts", "", "nobody"]) | json_values,
        "topic": st.sampled_from(WARM_TOPICS) | json_values,
        "messages": st.just([{"role": "user", "content": "and then?"}]) | json_values,
        "fresh": json_values,
    },
)
valid_fields = st.fixed_dictionaries(
    {"persona": st.just("test-watts")}, optional={"topic": st.sampled_from(WARM_TOPICS)}
)
bodies = (
    valid_fields.map(lambda value: json.dumps(value).encode())
    | fields.map(lambda value: json.dumps(value).encode())
    | json_values.map(lambda value: json.dumps(value).encode())
    | st.binary(max_size=200)
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "",
        "multipart/form-data",
        "a/b/c",
    ]
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)


@pytest.fixture
async def warm_answers(persona: Persona, local_backend: Any, unlimited: Any) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=2)
    for topic in WARM_TOPICS[:2]:
        stream = AsgiStream(
            "POST",
            STREAM_URL,
            body=json.dumps({"persona": "test-watts", "topic": topic}).encode(),
            headers=JSON,
        )
        assert (await stream.start()).status == 200
        await stream.read_all()


@hypothesis_settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
    body=bodies,
    content_type=content_types,
    extra=st.dictionaries(st.sampled_from(["accept", "x-forwarded-for", "cookie", "origin"]), header_values),
    query=st.text(max_size=40),
)
async def test_bad_input_fuzzed_stream_requests_never_get_a_500(
    warm_answers: None,
    log_output: io.StringIO,
    method: str,
    body: bytes,
    content_type: str,
    extra: dict[str, str],
    query: str,
) -> None:
    headers = {**extra, "content-length": str(len(body))}
    if content_type:
        headers["content-type"] = content_type
    response = await send(method, STREAM_URL, body, headers, quote(query, safe="=&"))

    event(f"HTTP {response.status}")
    assert response.status < 500, (response.status, response.body[:300])
    if response.status >= 400:
        assert_json_error(response, response.status)
    else:
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
    assert_no_error_logged(log_output.getvalue())


# -- secrets in the admin -------------------------------------------------------------------------


async def test_bad_input_admin_log_pages_and_csv_export_never_show_the_api_token(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, admin_user: Any
) -> None:
    # Upstreams that echo the token back: in a 401 message, in the streamed text, in a header.
    fake_workers_ai.script(
        Scenario.unauthorized(message=f"Invalid API token {TEST_API_TOKEN}"),
        Scenario(echo_headers=True, headers={"cf-aig-log-id": TEST_API_TOKEN}),
        Scenario(tokens=("Bearer ", TEST_API_TOKEN[:10], TEST_API_TOKEN[10:]), drop_after_tokens=3),
    )
    for topic in ("one", "two", "three"):
        stream = AsgiStream(
            "POST",
            STREAM_URL,
            body=json.dumps({"persona": persona.slug, "topic": topic}).encode(),
            headers=JSON,
        )
        await stream.start()
        await stream.read_all()
    assert await Generation.objects.acount() == 3

    def pages() -> dict[str, bytes]:
        client = Client()
        client.force_login(admin_user)
        urls = ["/admin/quotes/generation/", "/admin/quotes/generation/export.csv"]
        urls += ["/admin/quotes/generation/analytics/", f"/admin/quotes/persona/{persona.pk}/change/"]
        urls += [f"/admin/quotes/generation/{row.pk}/change/" for row in Generation.objects.all()]
        found = {}
        for url in urls:
            response = client.get(url)
            assert response.status_code == 200, url
            found[url] = b"".join(response) if response.streaming else response.content
        return found

    from asgiref.sync import sync_to_async

    for url, content in (await sync_to_async(pages)()).items():
        assert TEST_API_TOKEN.encode() not in content, url
        assert TEST_API_TOKEN[:16].encode() not in content, url


# -- the feedback endpoint and the permalink --------------------------------------------------------

UNKNOWN_ID = "00000000-0000-4000-8000-000000000000"
FEEDBACK_URL = f"/api/quotes/{UNKNOWN_ID}/feedback"


def feedback(body: object, **kwargs: Any) -> Bad:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Bad("POST", FEEDBACK_URL, raw, {**JSON, "content-length": str(len(raw))}, **kwargs)


FEEDBACK_AND_PERMALINK = [
    pytest.param(Bad("GET", FEEDBACK_URL, status=405, code="method_not_allowed"), id="feedback-get"),
    pytest.param(
        Bad("POST", FEEDBACK_URL, b'{"value": 1}', {"content-type": "text/plain"}, status=415),
        id="feedback-text-plain",
    ),
    pytest.param(feedback(b"{not json"), id="feedback-invalid-json"),
    pytest.param(feedback(b'{"value": "\xff"}'), id="feedback-invalid-utf8"),
    pytest.param(feedback([1]), id="feedback-json-array"),
    pytest.param(feedback({"value": "1"}), id="feedback-value-string"),
    pytest.param(feedback({"value": 2}), id="feedback-value-2"),
    pytest.param(feedback({"value": True}), id="feedback-value-true"),
    pytest.param(feedback({"value": 1.0}), id="feedback-value-float"),
    pytest.param(feedback({"value": 1}, status=404), id="feedback-unknown-quote"),
    pytest.param(feedback(b"x" * (MAX_BODY + 1), status=413), id="feedback-huge-body"),
    pytest.param(
        Bad("POST", "/api/quotes/not-a-uuid/feedback", b"{}", JSON, status=404), id="feedback-bad-uuid"
    ),
    pytest.param(Bad("GET", f"/q/{UNKNOWN_ID}/", status=404), id="permalink-unknown"),
    pytest.param(Bad("GET", "/q/{{7*7}}/", status=404), id="permalink-template"),
    pytest.param(Bad("GET", "/q/%00/", status=404), id="permalink-nul"),
    pytest.param(
        Bad(
            "POST",
            f"/q/{UNKNOWN_ID}/",
            b"x=1",
            {"content-type": "application/x-www-form-urlencoded"},
            status=403,
        ),
        id="permalink-post-no-csrf",
    ),
]


@pytest.mark.services
@pytest.mark.parametrize("bad", FEEDBACK_AND_PERMALINK)
async def test_bad_input_feedback_and_permalink_get_their_4xx(
    persona: Persona, log_output: io.StringIO, bad: Bad
) -> None:
    response = await send(bad.method, bad.path, bad.body, bad.headers, bad.query)

    if bad.path.endswith("/feedback") and bad.path != "/api/quotes/not-a-uuid/feedback":
        assert_json_error(response, bad.status, bad.code)
    else:
        assert_readable_page(response, bad.status)
    assert_no_error_logged(log_output.getvalue())


# -- the WebSocket consumer -----------------------------------------------------------------------------

WS_FRAMES = [
    pytest.param(b"\x00\x01", "invalid_frame", id="binary-frame"),
    pytest.param("{not json", "invalid_json", id="not-json"),
    pytest.param(
        '{"type": "start", "persona": "\udcff"}'.encode("utf-8", "surrogatepass").decode("latin-1"),
        None,
        id="odd-text",
    ),
    pytest.param("[1, 2]", "invalid_frame", id="json-array"),
    pytest.param("null", "invalid_frame", id="json-null"),
    pytest.param('{"type": "nope"}', "invalid_frame", id="unknown-type"),
    pytest.param('{"type": ["start"]}', "invalid_frame", id="type-list"),
    pytest.param('{"type": "start"}', "missing_persona", id="start-no-persona"),
    pytest.param('{"type": "start", "persona": 7}', "invalid_persona", id="start-persona-int"),
    pytest.param('{"type": "start", "persona": "nobody"}', "unknown_persona", id="start-unknown-persona"),
    pytest.param(
        '{"type": "start", "persona": "test-watts", "topic": 7}', "invalid_topic", id="start-topic-int"
    ),
    pytest.param(
        json.dumps({"type": "start", "persona": "test-watts", "topic": TOO_LONG_TOPIC}),
        "topic_too_long",
        id="start-topic-too-long",
    ),
    pytest.param(
        '{"type": "start", "persona": "test-watts", "messages": "hi"}',
        "invalid_messages",
        id="start-messages-str",
    ),
    pytest.param(
        '{"type": "start", "persona": "test-watts", "topic": ' + "[" * 5000 + "]" * 5000 + "}",
        "invalid_json",
        id="deeply-nested-json",
    ),
    pytest.param(
        '{"type": "start", "persona": "test-watts", "topic": "\\ud800"}',
        "invalid_unicode",
        id="start-topic-surrogate",
    ),
    pytest.param(
        '{"type": "start", "persona": "test-watts", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "invalid_unicode",
        id="start-message-surrogate",
    ),
]


@pytest.mark.parametrize(("frame", "code"), WS_FRAMES)
async def test_bad_input_websocket_frames_get_an_error_frame_and_the_socket_stays_open(
    persona: Persona, unlimited: Any, frame: str | bytes, code: str | None
) -> None:
    from channels.testing import WebsocketCommunicator

    from config.asgi import application

    socket = WebsocketCommunicator(
        application, "/ws/quotes/", headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    )
    connected, _ = await socket.connect()
    assert connected
    try:
        if isinstance(frame, bytes):
            await socket.send_to(bytes_data=frame)
        else:
            await socket.send_to(text_data=frame)
        reply = await socket.receive_json_from(timeout=5)
        assert reply["type"] == "error", reply
        assert isinstance(reply["message"], str) and reply["message"]
        if code is not None:
            assert reply["code"] == code, reply
        # still usable: the next bad frame gets its answer too
        await socket.send_to(text_data='{"type": "nope"}')
        assert (await socket.receive_json_from(timeout=10))["code"] == "invalid_frame"
    finally:
        await socket.disconnect(timeout=10)
    assert not await Generation.objects.aexists()
