"""Every persona as a model any OpenAI client can call (issue 43): the official `openai` SDK
against a real daphne on the fake Workers AI, and the bytes on the wire checked against OpenAI's
published OpenAPI description of Chat Completions (harness/openai_chat_completions.json).

- A streamed quote, a non-streamed one, usage in the stream only when asked for; the row, the
  metrics and the upstream call are the site's own.
- A 429 that the SDK retries after the Retry-After it is sent, and then gets its quote.
- An unknown persona is the SDK's NotFoundError, a temperature out of range its BadRequestError
  (the message says the range).
- A client that closes the stream mid-way: the upstream call is closed, the row says cancelled.
- A dropped stream resumes with Last-Event-ID, the rest of the same answer and nothing twice.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from harness.daphne import Site, start_site, wait_for, workers_ai_env
from harness.openai_schema import violation
from harness.services import client_address
from harness.workers_ai import FakeWorkersAI, Scenario

pytestmark = pytest.mark.system

TICKS = tuple(f" tick{n}" for n in range(40))
RAIN = [{"role": "user", "content": "rain"}]


@pytest.fixture(scope="module")
def site(fake_workers_ai_server: FakeWorkersAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    settings = {"QUOTES_METRICS_ALLOW": "127.0.0.0/8"}
    with start_site(
        tmp_path_factory.mktemp("site"), **workers_ai_env(fake_workers_ai_server), **settings
    ) as running:
        yield running


def sdk(site: Site, address: str = "127.0.0.1", **options: Any) -> openai.OpenAI:
    """The official client, as its README shows it: a base URL, and a key the site never reads."""
    transport = httpx2.HTTPTransport(local_address=address)
    http = httpx2.Client(transport=transport, event_hooks=options.pop("event_hooks", {}))
    return openai.OpenAI(base_url=f"{site.url}/v1", api_key="unused", http_client=http, **options)


def raw_events(response: httpx.Response) -> list[tuple[str, str]]:
    """(id, data) of each event of an SSE body, as the WHATWG parser reads it."""
    events, id_, data = [], "", []
    for line in response.iter_lines():
        if line == "":
            if data:
                events.append((id_, "\n".join(data)))
            id_, data = "", []
        elif line.startswith("id: "):
            id_ = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
    return events


def rows(site: Site) -> list[tuple[str, str, str]]:
    wait_for(lambda: not site.query("SELECT 1 FROM quotes_generation WHERE status = 'running'"), "rows done")
    return site.query("SELECT status, error_code, text FROM quotes_generation ORDER BY id")


def test_a_streamed_quote_with_usage_and_a_whole_one_through_the_official_sdk(
    fake_workers_ai: FakeWorkersAI, site: Site
) -> None:
    fake_workers_ai.default = Scenario(tokens=TICKS[:5], usage=(40, 5))
    before = len(rows(site))

    with sdk(site) as client:
        chunks = list(
            client.chat.completions.create(
                model="alan-watts", messages=RAIN, stream=True, stream_options={"include_usage": True}
            )
        )
        plain = list(
            client.chat.completions.create(model="alan-watts", messages=RAIN, stream=True, max_tokens=5)
        )
        whole = client.chat.completions.create(model="alan-watts", messages=RAIN, temperature=0.2)

    text = "".join(TICKS[:5])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert {c.model for c in chunks} == {"alan-watts"} and {c.object for c in chunks} == {
        "chat.completion.chunk"
    }
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (40, 5)
    # Without include_usage, no usage chunk; all five tokens of the five allowed: `length`.
    assert all(c.choices and c.usage is None for c in plain)
    assert [c.choices[0].finish_reason for c in plain][-1] == "length"
    assert whole.object == "chat.completion" and whole.model == "alan-watts"
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "stop" and whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (40, 5, 45)
    # The site's own path: three upstream calls asked for the topic, three rows, the metrics.
    sent = [r.json for r in fake_workers_ai.requests]
    assert len(sent) == 3 and all("rain" in r["messages"][-1]["content"] for r in sent)
    assert [r["max_tokens"] for r in sent][1] == 5 and sent[2]["temperature"] == 0.2
    assert rows(site)[before:] == [("ok", "", text)] * 3
    metrics = httpx.get(f"{site.url}/metrics", timeout=10).text
    assert 'transport="openai"' in metrics


def test_the_wire_format_is_openais_published_one(fake_workers_ai: FakeWorkersAI, site: Site) -> None:
    fake_workers_ai.default = Scenario(tokens=TICKS[:3], usage=(10, 3))
    body = {
        "model": "alan-watts",
        "messages": RAIN,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{site.url}/v1/chat/completions", json=body) as response:
            events = raw_events(response)
        whole = client.post(
            f"{site.url}/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
        )
        models = client.get(f"{site.url}/v1/models")
        one = client.get(f"{site.url}/v1/models/alan-watts")
        missing = client.post(f"{site.url}/v1/chat/completions", json={**body, "model": "nobody"})

    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1][1] == "[DONE]" and len(events) == 3 + 4  # role, 3 tokens, finish, usage, [DONE]
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert [violation("CreateChatCompletionStreamResponse", chunk) for chunk in chunks] == [""] * len(chunks)
    assert all(id_ for id_, _ in events[:-2])  # each resumable (the usage chunk goes with the last)
    assert whole.status_code == 200 and violation("CreateChatCompletionResponse", whole.json()) == ""
    assert models.status_code == 200 and violation("ListModelsResponse", models.json()) == ""
    assert {m["id"] for m in models.json()["data"]} >= {"alan-watts"}
    assert (
        one.status_code == 200 and violation("Model", one.json()) == "" and one.json()["id"] == "alan-watts"
    )
    assert missing.status_code == 404 and violation("ErrorResponse", missing.json()) == ""


def test_an_unknown_persona_and_a_temperature_out_of_range_are_the_sdks_errors(
    fake_workers_ai: FakeWorkersAI, site: Site
) -> None:
    with sdk(site, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            client.chat.completions.create(model="nobody", messages=RAIN)
        with pytest.raises(openai.BadRequestError) as hot:
            client.chat.completions.create(model="alan-watts", messages=RAIN, temperature=7)
        with pytest.raises(openai.BadRequestError) as system:
            client.chat.completions.create(
                model="alan-watts", messages=[{"role": "system", "content": "x"}, *RAIN]
            )

    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    assert (hot.value.code, hot.value.param) == ("out_of_range", "temperature")
    assert "from 0 to 5" in hot.value.message
    assert system.value.code == "invalid_message_role" and "system prompt" in system.value.message
    assert fake_workers_ai.requests == []  # nothing reached the model


def test_a_429_is_retried_by_the_sdk_after_its_retry_after(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    fake_workers_ai.default = Scenario(tokens=TICKS[:2])
    statuses: list[tuple[int, str | None]] = []

    def seen(response: httpx2.Response) -> None:
        statuses.append((response.status_code, response.headers.get("retry-after")))

    settings = {"QUOTES_RATE_LIMIT": "1/3seconds"}
    with start_site(tmp_path, **workers_ai_env(fake_workers_ai), **settings) as site:
        address = client_address(1)
        # A mistake first, which counts against the client's budget (as on the site's API) ...
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30) as first:
            mistake = first.post(f"{site.url}/v1/chat/completions", json={"model": "alan-watts"})
        # ... so the SDK's request is refused, waits as told, and is served.
        with sdk(site, address, event_hooks={"response": [seen]}) as client:
            answer = client.chat.completions.create(model="alan-watts", messages=RAIN)

    assert mistake.status_code == 400
    assert answer.choices[0].message.content == "".join(TICKS[:2])
    assert [status for status, _ in statuses] == [429, 200], statuses
    assert 1 <= int(statuses[0][1] or 0) <= 3
    assert len(fake_workers_ai.requests) == 1


def test_a_client_that_closes_the_stream_stops_the_upstream_and_its_row_says_cancelled(
    fake_workers_ai: FakeWorkersAI, tmp_path: Path
) -> None:
    fake_workers_ai.default = Scenario(tokens=TICKS, token_delay_s=0.1)
    with start_site(tmp_path, **workers_ai_env(fake_workers_ai), QUOTES_RESUME_GRACE_S="0.5") as site:
        got = []
        with sdk(site) as client:
            stream = client.chat.completions.create(model="alan-watts", messages=RAIN, stream=True)
            for chunk in stream:
                got.append(chunk.choices[0].delta.content)
                if len(got) == 3:
                    break
            stream.close()
        [upstream] = fake_workers_ai.wait_for_requests(1)
        assert upstream.client_disconnected.wait(15), "the upstream call was left running"
        [(status, code, text)] = rows(site)

    assert (status, code) == ("cancelled", "abandoned")
    assert text.startswith("".join(t for t in got if t)) and len(text) < len("".join(TICKS))


def test_a_dropped_stream_resumes_with_last_event_id(fake_workers_ai: FakeWorkersAI, site: Site) -> None:
    release = threading.Event()
    fake_workers_ai.default = Scenario(tokens=TICKS[:6], stall_after_tokens=3, hold=release)
    body = {"model": "alan-watts", "messages": RAIN, "stream": True}
    url = f"{site.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        seen: list[tuple[str, str]] = []
        with client.stream("POST", url, json=body) as response:
            lines = response.iter_lines()
            for line in lines:  # the role chunk and three tokens, then the connection drops
                if line.startswith("id: "):
                    seen.append((line[4:], next(lines)[6:]))
                if len(seen) == 4:
                    break
        release.set()
        with client.stream("POST", url, json=body, headers={"Last-Event-ID": seen[-1][0]}) as resumed:
            rest = raw_events(resumed)

    text = [json.loads(data)["choices"][0]["delta"].get("content") for _, data in seen[1:]]
    more = [json.loads(data) for _, data in rest[:-1]]
    text += [chunk["choices"][0]["delta"].get("content") for chunk in more]
    assert "".join(t for t in text if t) == "".join(TICKS[:6])
    assert more[-1]["choices"][0]["finish_reason"] == "stop" and rest[-1][1] == "[DONE]"
    assert {chunk["id"] for chunk in more} == {json.loads(seen[0][1])["id"]}
    assert len(fake_workers_ai.requests) == 1  # one upstream call served both connections


def test_the_readmes_python_streams_a_quote(
    fake_workers_ai: FakeWorkersAI, site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_workers_ai.default = Scenario(tokens=TICKS[:4])
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## The OpenAI-compatible API", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8000/v1" in code

    exec(compile(code.replace("http://127.0.0.1:8000", site.url), "README.md", "exec"), {})

    assert capsys.readouterr().out == "".join(TICKS[:4])
