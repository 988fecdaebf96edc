"""Malformed requests to every HTTP endpoint, through the real ASGI app (config.asgi): each gets its
4xx, never a 500 (JSON errors from the API, readable pages from the HTML endpoints) and no ERROR
line; a Hypothesis fuzz of the stream endpoint; template-injection topics reach the model as
literal text; the API token never shows in the admin's log pages or its CSV export."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import quote

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings
from django.test import Client
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from harness.workers_ai import FakeWorkersAI, Scenario
from quotes.backends import reset_backends
from quotes.models import Generation, Persona
from tests.asgi import FORM_URL, STREAM_URL, AsgiStream, StreamedResponse, post_quote
from tests.fixtures import TEST_API_TOKEN

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

JSON = {"content-type": "application/json"}
TEXT = {"content-type": "text/plain"}
URLENCODED = {"content-type": "application/x-www-form-urlencoded"}
#: a CSRF cookie, so Django's CSRF check reads a form's fields (and meets what is wrong with them)
FORM = {**URLENCODED, "cookie": "csrftoken=" + "a" * 32}
ES = {"accept": "text/event-stream"}  # what an EventSource sends
MAX_BODY = django_settings.QUOTES_MAX_BODY_BYTES
LONG_TOPIC = "x" * (django_settings.QUOTES_MAX_TOPIC_CHARS + 1)
UNKNOWN_ID = "00000000-0000-4000-8000-000000000000"
FEEDBACK = f"/api/quotes/{UNKNOWN_ID}/feedback"
MANY_FIELDS = "&".join(f"f{n}=1" for n in range(2000)).encode()
Sent = tuple[str, str, bytes, dict[str, str], str]


@pytest.fixture(autouse=True)
async def _close_backends_on_this_loop() -> AsyncIterator[None]:
    yield
    await reset_backends()


async def send(method: str, path: str, body: bytes, headers: dict[str, str], query: str) -> StreamedResponse:
    """One request; a 200 stream is closed after its headers (its body is not the point here)."""
    stream = AsgiStream(method, path, body=body, headers=headers, query=query)
    response = await stream.start()
    if response.status == 200 and response.headers.get("content-type") == "text/event-stream":
        await stream.disconnect()
        return response
    return await stream.read_all()


def post(body: object, headers: dict[str, str] = JSON, path: str = STREAM_URL) -> Sent:
    """A POST of `body`: bytes as they are, anything else as JSON (with its Content-Length)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return "POST", path, raw, {**headers, "content-length": str(len(raw))} if headers is JSON else headers, ""


def get(path: str = STREAM_URL, query: str = "", **headers: str) -> Sent:
    return "GET", path, b"", ES if path == STREAM_URL and not headers else headers, query


def es(query: str, **headers: str) -> Sent:
    """A GET of the stream, as an EventSource sends it, with more headers."""
    return get(STREAM_URL, query, **ES, **headers)


def watts(**fields: object) -> dict[str, object]:
    return {"persona": "test-watts", **fields}


def turn(role: object, content: object = "x") -> dict[str, object]:
    return watts(messages=[{"role": role, "content": content}])


CHUNKED = json.dumps(watts(topic="y" * MAX_BODY)).encode()  # no Content-Length: as a chunked body arrives
BIG_FORM = b"csrfmiddlewaretoken=x&topic=" + b"x" * (10 * 1024 * 1024)
LONE_SURROGATE_TURN = json.dumps(turn("user", "@")).replace("@", "\\udfff").encode()
NO_BOUNDARY = {**FORM, "content-type": "multipart/form-data; boundary="}
#: what each request gets: "<status> <JSON error code>", or "<status> page" (a readable HTML page)
BATTERY: dict[str, tuple[str, Sent]] = {
    # POST /api/quotes/stream: the body
    "no-content-type": ("415 unsupported_media_type", post(b"{}", {})),
    "text-plain": ("415 unsupported_media_type", post(b"{}", TEXT)),
    "form-encoded": ("415 unsupported_media_type", post(b"persona=test-watts", URLENCODED)),
    "empty-body": ("400 invalid_json", post(b"")),
    "truncated-json": ("400 invalid_json", post(b'{"persona": "test-watts"')),
    "invalid-utf8": ("400 invalid_json", post(b'{"persona": "\xff\xfe\xfd"}')),
    "bom-and-nul-bytes": ("400 invalid_json", post(b"\xef\xbb\xbf\x00\x00")),
    "json-array": ("400 invalid_json", post(["test-watts"])),
    "json-nan": ("400 invalid_json", post(b"NaN")),
    "deeply-nested-json": ("400 invalid_json", post(b'{"topic": ' + b"[" * 5000 + b"]" * 5000 + b"}")),
    "huge-body": ("413 body_too_large", post(watts(topic="y" * (MAX_BODY + 1)))),
    "huge-body-chunked": ("413 body_too_large", post(CHUNKED, {**JSON})),
    # POST /api/quotes/stream: the fields
    "no-persona": ("400 missing_persona", post({})),
    "persona-list": ("400 invalid_persona", post({"persona": ["test-watts"]})),
    "unknown-persona": ("404 unknown_persona", post({"persona": "nobody"})),
    "persona-nul": ("404 unknown_persona", post({"persona": "test-watts\u0000"})),
    "persona-5000-chars": ("404 unknown_persona", post({"persona": "x" * 5000})),
    "topic-int": ("400 invalid_topic", post(watts(topic=7))),
    "topic-too-long": ("400 topic_too_long", post(watts(topic=LONG_TOPIC))),
    "messages-string": ("400 invalid_messages", post(watts(messages="hi"))),
    "messages-no-content": ("400 invalid_messages", post(watts(messages=[{"role": "user"}]))),
    "messages-system": ("400 invalid_message_role", post(turn("system"))),
    "messages-too-many": ("400 too_many_messages", post(watts(messages=turn("user")["messages"] * 1000))),
    "topic-surrogate": ("400 invalid_unicode", post(b'{"persona": "test-watts", "topic": "rain \\ud800"}')),
    "message-surrogate": ("400 invalid_unicode", post(LONE_SURROGATE_TURN)),
    # Another origin's page cannot start a generation: another site's, or a sibling subdomain's.
    "get-cross-site": ("403 cross_site", es("persona=test-watts", **{"sec-fetch-site": "cross-site"})),
    "get-same-site": ("403 cross_site", es("persona=test-watts", **{"sec-fetch-site": "same-site"})),
    "post-foreign-origin": ("403 cross_site", post(watts(), {**JSON, "origin": "https://evil.example"})),
    # Other methods, and GET
    "put": ("405 method_not_allowed", ("PUT", STREAM_URL, b"{}", JSON, "")),
    "delete": ("405 method_not_allowed", ("DELETE", STREAM_URL, b"", {}, "")),
    "get-no-persona": ("400 missing_persona", get()),
    "get-topic-too-long": ("400 topic_too_long", get(query=f"persona=test-watts&topic={LONG_TOPIC}")),
    "get-invalid-utf8-query": ("404 unknown_persona", get(query="persona=%ff%fe")),
    "get-raw-quotes-in-query": ("404 unknown_persona", get(query="persona=nobody&topic=it's'>x")),
    # A GET that is no EventSource nor fetch() (an <img>, a link); resume ids this site never sent
    "get-as-an-image": ("406 not_acceptable", get(STREAM_URL, "persona=test-watts", accept="image/avif,*/*")),
    "get-without-accept": ("406 not_acceptable", get(STREAM_URL, "persona=test-watts", **{"x-a": "b"})),
    "resume-by-the-id-alone": ("400 invalid_last_event_id", get(query=f"last_event_id={UNKNOWN_ID}:0")),
    "resume-foreign-key": ("404 resume_unavailable", es("", **{"last-event-id": f"{UNKNOWN_ID}.{0:016}:0"})),
    # The feedback endpoint
    "feedback-get": ("405 method_not_allowed", get(FEEDBACK)),
    "feedback-text-plain": ("415 unsupported_media_type", post(b'{"value": 1}', TEXT, FEEDBACK)),
    "feedback-invalid-json": ("400 invalid_json", post(b"{not json", JSON, FEEDBACK)),
    "feedback-value-true": ("400 invalid_feedback", post({"value": True}, JSON, FEEDBACK)),
    "feedback-unknown-quote": ("404 unknown_quote", post({"value": 1}, JSON, FEEDBACK)),
    "feedback-huge-body": ("413 body_too_large", post(b"x" * (MAX_BODY + 1), JSON, FEEDBACK)),
    # The HTML endpoints: readable pages
    "persona-page-unknown": ("404 page", get("/personas/nobody/")),
    "persona-page-long-slug": ("404 page", get("/personas/" + "a" * 3000 + "/")),
    "persona-page-post-no-csrf": ("403 page", post(b"x=1", URLENCODED, "/personas/test-watts/")),
    "feedback-bad-uuid": ("404 page", post(b"{}", JSON, "/api/quotes/not-a-uuid/feedback")),
    "permalink-unknown": ("404 page", get(f"/q/{UNKNOWN_ID}/")),
    "unknown-path": ("404 page", get("/no/such/page/")),
    "admin-login-no-csrf": ("403 page", post(b"username=a&password=b", URLENCODED, "/admin/login/")),
    # What Django answers 400 itself, and would log at ERROR with a traceback
    "bad-host-header": ("400 page", get("/", host="evil.example")),
    "bad-host-header-stream": ("400 page", es("", host="evil.example:1/x")),
    "form-10-mb": ("400 page", post(BIG_FORM, FORM, FORM_URL)),
    "form-2000-fields": ("400 page", post(MANY_FIELDS, FORM, FORM_URL)),
    "admin-login-2000-fields": ("400 page", post(MANY_FIELDS, FORM, "/admin/login/")),
    "form-no-boundary": ("400 page", post(b"--x\r\nbroken", NO_BOUNDARY, FORM_URL)),
}


@pytest.fixture
def log_output() -> Iterator[io.StringIO]:
    """What the console handler config/settings.py configures (its filters, its format) writes."""
    import config.asgi  # noqa: F401  (its first import configures logging)

    [console] = [h for h in logging.getLogger().handlers if h.get_name() == "console"]
    assert isinstance(console, logging.StreamHandler)
    buffer = io.StringIO()
    previous = console.setStream(buffer)
    yield buffer
    console.setStream(previous)


def assert_fine(response: StreamedResponse, status: int, code: str, log: io.StringIO) -> None:
    """The status, then a JSON error with `code` ("" for any) or a readable page ("page"); a
    client's mistake is logged at WARNING at most, without a traceback."""
    assert response.status == status, (response.status, response.body[:300])
    if code == "page":
        assert response.headers["content-type"].startswith("text/html"), response.headers
        page = response.body.decode().lower()
        assert ("<html" in page or "<!doctype" in page) and "traceback" not in page, page[:300]
    else:
        assert response.headers["content-type"] == "application/json", response.headers
        error = response.json()["error"]
        assert set(response.json()) == {"error"} and set(error) == {"code", "message"}, error
        assert error["code"] == (code or error["code"]) and error["message"].strip(), error
    assert_no_error_logged(log)


def assert_no_error_logged(log: io.StringIO) -> None:
    assert re.findall(r"^.*\b(?:ERROR|CRITICAL)\b.*$", log.getvalue(), re.MULTILINE) == [], log.getvalue()
    assert "Traceback" not in log.getvalue()


@pytest.mark.parametrize(("expected", "sent"), BATTERY.values(), ids=BATTERY.keys())
async def test_bad_input_gets_its_4xx_and_never_a_500(
    persona: Persona, unlimited: Any, log_output: io.StringIO, expected: str, sent: Sent
) -> None:
    response = await send(*sent)

    status, code = expected.split()
    assert_fine(response, int(status), code, log_output)
    assert status != "405" or response.headers["allow"] in ("GET, POST", "POST")
    assert not await Generation.objects.aexists()  # refused before any generation: no row


@pytest.mark.parametrize("topic", ["{topic}", "{{7*7}}", "{% debug %}", "%(x)s", "{0.__class__}"])
async def test_template_injection_topic_reaches_the_model_as_literal_text(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, topic: str
) -> None:
    assert (await post_quote(watts(topic=topic))).status == 200

    [upstream] = fake_workers_ai.requests
    assert upstream.json["messages"][-1]["content"] == persona.user_prompt_template.replace("{topic}", topic)
    assert (await Generation.objects.aget()).topic == topic


# -- fuzz ---------------------------------------------------------------------------------------

#: Valid requests use these topics, answered from the cache (warmed once per test); the rest of
#: the strategies still reach the model now and then, with a 2-token budget.
WARM_TOPICS, ME = ("rain", "hard honest work", "  rain  "), "test-watts"
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
keys = st.text(max_size=9)
json_values = st.recursive(scalars, lambda k: st.lists(k, max_size=4) | st.dictionaries(keys, k, max_size=4))
fields = st.fixed_dictionaries(
    {},
    optional={
        "persona": st.sampled_from(["test-watts", "", "nobody"]) | json_values,
        "topic": st.sampled_from(WARM_TOPICS) | json_values,
        "messages": st.just([{"role": "user", "content": "and then?"}]) | json_values,
        "fresh": json_values,
    },
)
valid = st.fixed_dictionaries({"persona": st.just(ME)}, optional={"topic": st.sampled_from(WARM_TOPICS)})
bodies = (valid | fields | json_values).map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200)
types = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", "", "a/b/c"])
values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
extras = st.dictionaries(st.sampled_from(["accept", "x-forwarded-for", "cookie", "origin"]), values)
methods = st.sampled_from(["POST", "POST", "GET", "PUT"])
HEALTH_CHECKS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture
async def warm_answers(persona: Persona, local_backend: Any, unlimited: Any) -> None:
    await Persona.objects.filter(pk=persona.pk).aupdate(max_tokens=2)
    for topic in WARM_TOPICS[:2]:
        assert (await post_quote(watts(topic=topic))).status == 200


@hypothesis_settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=HEALTH_CHECKS)
@given(st.tuples(methods, bodies, types, extras, st.text(max_size=40)))
async def test_fuzzed_stream_requests_never_get_a_500(warm_answers: None, log_output: Any, sent: Any) -> None:
    method, body, content_type, extra, query = sent
    headers = {**extra, "content-length": str(len(body))}
    if content_type:
        headers["content-type"] = content_type
    response = await send(method, STREAM_URL, body, headers, quote(query, safe="=&"))

    event(f"HTTP {response.status}")
    if response.status >= 400:
        assert_fine(response, response.status, "", log_output)  # a 4xx: the JSON error, no ERROR line
    else:
        assert response.status == 200 and response.headers["content-type"] == "text/event-stream"


# -- secrets in the admin -------------------------------------------------------------------------


async def test_admin_log_pages_and_csv_export_never_show_the_api_token(
    persona: Persona, workers_ai_settings: Any, fake_workers_ai: FakeWorkersAI, admin_user: Any
) -> None:
    # Upstreams that echo the token back: in a 401 message, in the streamed text, in a header.
    fake_workers_ai.script(
        Scenario.unauthorized(message=f"Invalid API token {TEST_API_TOKEN}"),
        Scenario(echo_headers=True, headers={"cf-aig-log-id": TEST_API_TOKEN}),
        Scenario(tokens=("Bearer ", TEST_API_TOKEN[:10], TEST_API_TOKEN[10:]), drop_after_tokens=3),
    )
    for topic in ("one", "two", "three"):
        await post_quote(watts(topic=topic))
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

    for url, content in (await sync_to_async(pages)()).items():
        assert TEST_API_TOKEN[:16].encode() not in content, url
