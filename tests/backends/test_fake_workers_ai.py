"""The fake upstream itself: routes, scripting, recording, and the bytes it puts on the wire."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from harness.workers_ai import FakeWorkersAI, Scenario, render_body

MODEL = "@cf/meta/llama-3.1-8b-instruct"


def run_url(fake: FakeWorkersAI, model: str = MODEL) -> str:
    return f"{fake.api_base_url}/accounts/acct-test/ai/run/{model}"


def post(fake: FakeWorkersAI, url: str | None = None, **kwargs) -> httpx.Response:
    return httpx.post(url or run_url(fake), json={"messages": [], "stream": True}, timeout=5, **kwargs)


@pytest.mark.integration
def test_fake_answers_the_default_scenario_in_the_documented_format(fake_workers_ai):
    response = post(fake_workers_ai)

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["connection"] == "close"
    assert response.content == render_body(Scenario())
    assert response.content.startswith(b'data: {"response":"Stay"}\n\n')
    assert response.content.endswith(
        b'data: {"response":"","usage":{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}}\n\ndata: [DONE]\n\n'
    )


@pytest.mark.integration
def test_fake_records_both_routes(fake_workers_ai):
    post(fake_workers_ai, headers={"Authorization": "Bearer t", "cf-aig-skip-cache": "true"})
    post(fake_workers_ai, f"{fake_workers_ai.gateway_base_url}/acct-test/gw-1/workers-ai/{MODEL}")

    run, gateway = fake_workers_ai.requests
    assert (run.method, run.route, run.account, run.model) == ("POST", "run", "acct-test", MODEL)
    assert run.headers["authorization"] == "Bearer t"
    assert run.headers["cf-aig-skip-cache"] == "true"
    assert run.json == {"messages": [], "stream": True}
    assert (gateway.route, gateway.account, gateway.gateway, gateway.model) == (
        "gateway",
        "acct-test",
        "gw-1",
        MODEL,
    )
    assert run.received_at <= gateway.received_at


@pytest.mark.integration
def test_fake_answers_404_and_405_in_the_v4_envelope(fake_workers_ai):
    missing = post(fake_workers_ai, f"{fake_workers_ai.base_url}/client/v4/nowhere")
    wrong_method = httpx.get(run_url(fake_workers_ai), timeout=5)

    assert missing.status_code == 404
    assert missing.json() == {
        "success": False,
        "errors": [{"code": 7003, "message": "No route for that URI"}],
        "messages": [],
        "result": None,
    }
    assert wrong_method.status_code == 405


@pytest.mark.integration
def test_fake_consumes_scripted_scenarios_in_order_then_the_default(fake_workers_ai):
    fake_workers_ai.script(Scenario.out_of_capacity(), Scenario(tokens=["x"], usage=None))

    statuses = [post(fake_workers_ai) for _ in range(3)]

    assert [r.status_code for r in statuses] == [429, 200, 200]
    assert statuses[0].json()["errors"] == [
        {"code": 3040, "message": "Capacity temporarily exceeded, please try again."}
    ]
    assert statuses[1].content == b'data: {"response":"x"}\n\ndata: [DONE]\n\n'
    assert statuses[2].content == render_body(Scenario())
    assert fake_workers_ai.pending == 0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("scenario", "status", "code"),
    [
        (Scenario.model_not_found(), 400, 5007),
        (Scenario.incomplete_request(), 400, 3003),
        (Scenario.lora_not_supported(), 405, 5005),
        (Scenario.terms_not_accepted(), 403, 5016),
        (Scenario.account_blocked(), 403, 3023),
        (Scenario.invalid_model_id(), 404, 3042),
        (Scenario.request_too_large(), 413, 3006),
        (Scenario.upstream_timeout(), 408, 3007),
        (Scenario.quota_exceeded(), 429, 3036),
        (Scenario.out_of_capacity(), 429, 3040),
        (Scenario.unauthorized(), 401, 10000),
    ],
)
def test_fake_error_constructors_use_the_documented_status(fake_workers_ai, scenario, status, code):
    fake_workers_ai.script(scenario)

    response = post(fake_workers_ai)

    assert response.status_code == status
    assert response.json()["errors"][0]["code"] == code


@pytest.mark.integration
def test_fake_sends_html_error_pages(fake_workers_ai):
    fake_workers_ai.script(Scenario.server_error(502, html=True))

    response = post(fake_workers_ai)

    assert response.status_code == 502
    assert response.headers["content-type"].startswith("text/html")
    assert b"<h1>502 Bad Gateway</h1>" in response.content


@pytest.mark.integration
def test_fake_sends_each_split_piece_as_its_own_chunk(fake_workers_ai):
    fake_workers_ai.script(Scenario(tokens=["日本"], usage=None, split=[3, 10, 11]))

    with httpx.stream("POST", run_url(fake_workers_ai), json={}, timeout=5) as response:
        chunks = list(response.iter_raw())

    body = 'data: {"response":"日本"}\n\ndata: [DONE]\n\n'.encode()
    assert chunks == [body[:3], body[3:10], body[10:11], body[11:]]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "eol"), [({}, b"\n"), ({"crlf": True}, b"\r\n"), ({"cr_only": True}, b"\r")]
)
def test_fake_uses_the_line_ending_asked(options, eol):
    body = render_body(Scenario(tokens=["a"], usage=None, comments=True, **options))

    assert (
        body
        == b": keepalive"
        + eol
        + eol
        + b'data: {"response":"a"}'
        + eol
        + eol
        + b": keepalive"
        + eol
        + eol
        + b"data: [DONE]"
        + eol
        + eol
    )


@pytest.mark.unit
def test_fake_pads_every_event():
    body = render_body(Scenario(tokens=["a", "b"], padding=True, seed=1))

    events = [json.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    assert all("p" in event for event in events)


@pytest.mark.integration
def test_fake_drops_the_connection_mid_stream(fake_workers_ai):
    fake_workers_ai.script(Scenario(drop_after_tokens=2))

    with pytest.raises(httpx.RemoteProtocolError):
        post(fake_workers_ai)


@pytest.mark.integration
def test_fake_rejects_a_wrong_token_when_told_to_check(fake_workers_ai):
    fake_workers_ai.expected_token = "right"

    wrong = post(fake_workers_ai, headers={"Authorization": "Bearer wrong"})
    right = post(fake_workers_ai, headers={"Authorization": "Bearer right"})

    assert (wrong.status_code, right.status_code) == (401, 200)


@pytest.mark.integration
def test_fake_notices_a_client_that_goes_away(fake_workers_ai):
    fake_workers_ai.script(Scenario(stall_before_s=30))
    host, port = fake_workers_ai.host, fake_workers_ai.port
    with socket.create_connection((host, port), timeout=5) as sock:
        path = f"/client/v4/accounts/a/ai/run/{MODEL}"
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        assert sock.recv(1024).startswith(b"HTTP/1.1 200 OK")
        closed_at = time.monotonic()

    [request] = fake_workers_ai.requests
    assert request.client_disconnected.wait(5)
    assert request.disconnected_at is not None
    assert request.disconnected_at - closed_at < 1.0


@pytest.mark.integration
def test_fake_records_concurrent_requests_from_many_threads(fake_workers_ai):
    threads = [threading.Thread(target=post, args=(fake_workers_ai,)) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(fake_workers_ai.requests) == 16


@pytest.mark.integration
def test_fake_reset_clears_script_and_records(fake_workers_ai):
    fake_workers_ai.script(Scenario.out_of_capacity())
    post(fake_workers_ai)
    fake_workers_ai.script(Scenario.out_of_capacity())

    fake_workers_ai.reset()

    assert fake_workers_ai.requests == []
    assert fake_workers_ai.pending == 0
    assert post(fake_workers_ai).status_code == 200
