import asyncio
import uuid

from streaming import Done, Endings, Error, Streams, Token, sse

streams = Streams(Endings(*(Error(code, code) for code in ("abandoned", "ended_early", "failed"))))


async def model(text="A stream outlives the connection that reads it."):  # any async generator of events
    for word in text.split():
        await asyncio.sleep(0.2)
        yield Token(word + " ")
    yield Done()


async def app(scope, receive, send):  # GET /?id=<id>&after=<n>: a stream's events after its n-th
    query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
    if (stream := streams.get(query.get("id", ""))) is None:  # a new one: it runs on 30 s unread
        stream = streams.open(uuid.uuid4().hex, grace_s=30)
        stream.start(model())
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    n = int(query.get("after", 0))
    async for event in stream.read(n):
        n, out = n + 1, sse.data({"text": event.text}) if type(event) is Token else sse.named("end", {})
        await send(
            {"type": "http.response.body", "body": sse.with_id(out, f"{stream.id}:{n}"), "more_body": True}
        )
    await send({"type": "http.response.body", "body": b""})
