"""The production layout (harness/faults/layout.py; one for the run, harness.scaleout.shared): two
daphne processes as deploy/systemd runs them behind nginx built from deploy/nginx, one PostgreSQL,
one Redis, the fake Workers AI upstream, and clients on loopback addresses of their own (127.0.x.y).

- harness/scaleout.py's checks (`make scaleout`): what spans processes;
- a visitor's reconnect and Stop, carrying the page's csrftoken cookie, reach the process that
  holds the generation (nginx's consistent hash on that cookie);
- a rolling restart (each process drained with the default 20 s, then started again) under load
  cuts no stream;
- 1,000 streams offered get a whole stream or a 503 with Retry-After, at the upstream's pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from harness import scaleout
from harness.faults.layout import PERSONA, Layout
from harness.services import client_address, client_at
from quotes.admission import LAG_FLOOR

pytestmark = pytest.mark.system

STREAM = "/api/quotes/stream"


@pytest.fixture(scope="module")
def layout() -> Layout:
    """The shared layout, its quotes as harness/scaleout.py's checks expect (each test after them
    sets its own)."""
    layout = scaleout.shared()
    layout.use_tokens(scaleout.TOKENS, 1 / scaleout.TOKEN_DELAY_S)
    return layout


@pytest.mark.parametrize("name", [name for name, _ in scaleout.CHECKS])
def test_scaleout_check(layout: Layout, name: str) -> None:
    print(dict(scaleout.CHECKS)[name](layout))


# -- resume and stop --------------------------------------------------------------------------


def read(lines: Iterator[str], count: int) -> list[tuple[str, str]]:
    """The next `count` events of a stream (all of them when count is 0), as (id, data)."""
    events: list[tuple[str, str]] = []
    event_id = data = ""
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and data:
            events.append((event_id, data))
            event_id = data = ""
            if len(events) == count:
                break
    return events


def text(events: list[tuple[str, str]]) -> str:
    return "".join(json.loads(data)["response"] for _, data in events if data.startswith('{"response"'))


def holder(layout: Layout, last_event_id: str) -> str:
    """Which process holds the generation: the one of the two that resumes it when asked directly."""
    headers = {"Last-Event-ID": last_event_id}
    answers = {
        d.name: httpx.post(d.url + STREAM, json={"persona": PERSONA}, headers=headers) for d in layout.daphnes
    }
    [name] = [name for name, answer in answers.items() if answer.status_code == 200]
    assert [a.json()["error"]["code"] for a in answers.values() if a.status_code != 200] == [
        "resume_unavailable"
    ]
    return name


def test_a_visitors_resume_and_stop_reach_the_process_that_holds_the_generation(layout: Layout) -> None:
    """Each visitor: the page (its cookie), a quote cut after 5 events, the reconnect with
    Last-Event-ID gets exactly the events after it, then Stop ends it at once. Visitors until
    each process has held two of their generations."""
    layout.use_tokens(200, 20)  # 10 s: still streaming when the Stop comes
    whole = layout.text
    held: Counter[str] = Counter()
    for index in range(16):
        with contextlib.closing(layout.visitor(client_address(900 + index))) as visitor:
            body = {"persona": PERSONA, "topic": f"resume {secrets.token_hex(4)}"}
            with visitor.stream("POST", layout.url + STREAM, json=body) as response:
                assert response.status_code == 200
                quote_id = response.headers["x-quote-id"]
                head = read(response.iter_lines(), 5)
            with visitor.stream(
                "POST", layout.url + STREAM, json=body, headers={"Last-Event-ID": head[-1][0]}
            ) as resumed:
                assert resumed.status_code == 200, resumed.read()
                lines = resumed.iter_lines()
                middle = read(lines, 5)
                stop = visitor.post(f"{layout.url}/api/quotes/{quote_id}/stop")
                rest = read(lines, 0)
        assert stop.status_code == 200 and stop.json() == {"id": quote_id, "stopped": True}, stop.text
        # Nothing lost, nothing twice: the event numbers follow each other.
        numbers = [int(event_id.rsplit(":", 1)[1]) for event_id, _ in head + middle + rest if event_id]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
        assert json.loads(rest[-1][1])["error"]["code"] == "stopped"
        said = text(head + middle + rest)
        assert whole.startswith(said) and len(said) < len(whole)
        row = layout.sql(
            "SELECT status, error_code, text FROM quotes_generation WHERE public_id = %s", [quote_id]
        )
        assert row == [("cancelled", "stopped", said)]
        held[holder(layout, rest[-1][0])] += 1
        if min(held["A"], held["B"]) >= 2:
            break
    assert min(held["A"], held["B"]) >= 2, f"the visitors' generations were held by {dict(held)}"


# -- overload -----------------------------------------------------------------------------------

OFFERED = 1000


@dataclass
class Offer:
    status: int = 0
    retry_after: str = ""
    code: str = ""
    times: list[float] = field(default_factory=list)  # when each token arrived
    done: bool = False


async def offer(port: int, index: int) -> Offer:
    """One stream, from a client of its own, over a plain HTTP/1.0 socket (1,000 of them at once
    cost the test little)."""
    result = Offer()
    body = json.dumps({"persona": PERSONA, "topic": f"overload {index}"})
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(client_address(index), 0))
    writer.write(
        f"POST {STREAM} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Cookie: csrftoken={secrets.token_hex(16)}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    result.status = int(head.split()[1])
    headers = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
    result.retry_after = headers.get("retry-after", "")
    while line := await reader.readline():
        if line.startswith(b'data: {"response":" w'):
            result.times.append(time.monotonic())
        elif line.startswith(b"data: [DONE]"):
            result.done = True
        elif line.startswith(b"{"):
            result.code = json.loads(line)["error"]["code"]
    writer.close()
    return result


def test_a_thousand_streams_offered_get_a_stream_or_a_503_and_keep_their_pace(layout: Layout) -> None:
    """1,000 streams of 2 s offered at 200 a second (bench/scaleout_load.py's arrival rate) to
    processes that take what their event loops keep at pace (at least LAG_FLOOR each, at most
    100): each gets a whole stream or a 503 with Retry-After (the app's
    over_capacity, or nginx's own once both processes have max_conns requests in flight), and an
    admitted stream, once it streams, keeps the upstream's pace (a token every 100 ms)."""
    layout.use_tokens(20, 10)
    port = layout.proxy.port

    async def offered_at(index: int) -> Offer:
        await asyncio.sleep(index / 200)
        return await offer(port, index)

    async def all_offered() -> list[Offer]:
        return await asyncio.gather(*(offered_at(index) for index in range(OFFERED)))

    offers = asyncio.run(all_offered())

    by_status = Counter(o.status for o in offers)
    assert set(by_status) == {200, 503}, by_status
    refused = [o for o in offers if o.status == 503]
    assert all(o.retry_after.isdigit() and int(o.retry_after) > 0 for o in refused), refused[:3]
    assert Counter(o.code for o in refused).keys() <= {"over_capacity", "service_unavailable"}
    admitted = [o for o in offers if o.status == 200]
    assert len(admitted) >= 2 * LAG_FLOOR, by_status  # each process takes its floor, lag or not
    assert all(o.done and len(o.times) == 20 for o in admitted), [o for o in admitted if not o.done][:3]
    gaps = sorted(b - a for o in admitted for a, b in zip(o.times, o.times[1:], strict=False))
    spans = sorted(o.times[-1] - o.times[0] for o in admitted)
    figures = f"gaps p50 {statistics.median(gaps):.3f} p99 {gaps[int(0.99 * len(gaps))]:.3f} s; spans {spans[-1]:.2f} s"
    assert gaps[int(0.99 * len(gaps))] < 0.5 and spans[-1] < 1.9 + 1.0, figures
    print(f"{dict(by_status)}; {Counter(o.code for o in refused)}; {figures}")


# -- streams open at once, across the processes (issue 39, point 2) ------------------------------


def test_a_client_and_a_network_get_their_streams_across_every_process_not_per_process(
    layout: Layout,
) -> None:
    """A client that reaches each process (a cookie rotated for each request does it through
    nginx; here, each process's own port) had each process's caps: 3 streams per client and 18
    per network, per process. Redis holds them for the site."""
    layout.use_tokens(400, 20)  # 20 s: every stream still open when the last is asked for
    a, b = layout.daphnes
    opened: list[tuple[str, str, httpx.Client]] = []  # (process url, quote id, its client)

    def ask(address: str, daphne_url: str, stack: contextlib.ExitStack) -> tuple[int, str]:
        client = stack.enter_context(contextlib.closing(client_at(address)))
        response = stack.enter_context(
            client.stream(
                "POST", daphne_url + STREAM, json={"persona": PERSONA, "topic": secrets.token_hex(4)}
            )
        )
        if response.status_code != 200:
            response.read()
            return response.status_code, response.json()["error"]["message"]
        next(response.iter_lines())
        opened.append((daphne_url, response.headers["x-quote-id"], client))
        return 200, ""

    with contextlib.ExitStack() as stack:
        one = [ask("127.0.77.2", d.url, stack) for d in (a, b, a, b)]
        neighbours = [ask(f"127.0.78.{2 + n // 3}", (a, b)[n % 2].url, stack) for n in range(21)]
        stranger = ask("127.0.79.2", b.url, stack)
        for url, quote, client in opened:  # Stop gives each place back at once
            assert client.post(f"{url}/api/quotes/{quote}/stop").json()["stopped"] is True
        again = ask("127.0.77.2", a.url, stack)

    assert [status for status, _ in one] == [200, 200, 200, 429]
    assert "You already have 3 quotes being written" in one[-1][1]
    statuses = [status for status, _ in neighbours]
    assert statuses.count(200) == 18 and statuses.count(429) == 3, statuses
    assert all("Your network already has 18" in said for status, said in neighbours if status == 429)
    assert stranger[0] == 200 and again[0] == 200
