"""An OTLP/HTTP trace receiver, a process of its own on 127.0.0.1: it takes what any OpenTelemetry
exporter POSTs to `/v1/traces` (protobuf, as the OTLP specification's HTTP binding sends it,
gzip or not), decodes it with the `opentelemetry-proto` messages and writes one JSON line per span
to its output file. Tests start it (`Receiver`) and read the spans back; anyone can run it to see
what the site exports:

    .venv/bin/python -m harness.otlp --port 4318 --out spans.jsonl
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 make serve
    .venv/bin/python -m harness.otlp --out spans.jsonl --tree     # the traces, as trees
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from harness.services import free_port, stop_process


def value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, kind) if kind else None


def spans_of(request: ExportTraceServiceRequest) -> Iterator[dict[str, Any]]:
    """Each span of an export, flattened: ids in hex, attributes and events as plain values."""
    for resource_spans in request.resource_spans:
        resource = {kv.key: value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield {
                    "resource": resource,
                    "scope": scope_spans.scope.name,
                    "name": span.name,
                    "kind": span.kind,
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "start_ns": span.start_time_unix_nano,
                    "end_ns": span.end_time_unix_nano,
                    "status": span.status.code,
                    "attributes": {kv.key: value(kv.value) for kv in span.attributes},
                    "events": [
                        {"name": e.name, "attributes": {kv.key: value(kv.value) for kv in e.attributes}}
                        for e in span.events
                    ],
                }


def serve(port: int, out: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            request = ExportTraceServiceRequest.FromString(body)
            with out.open("a") as file:
                for span in spans_of(request):
                    file.write(json.dumps(span) + "\n")
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    out.touch()  # listening: the file says so
    server.serve_forever()


def tree(spans: list[dict[str, Any]]) -> str:
    """The spans as indented trees, one per trace, children in start order; each line the span's
    name, its duration and its attributes (what docs/deployment.md shows of a trace)."""
    children: dict[str, list[dict[str, Any]]] = {}
    for span in sorted(spans, key=lambda s: s["start_ns"]):
        children.setdefault(span["parent_span_id"], []).append(span)
    lines: list[str] = []

    def show(span: dict[str, Any], depth: int) -> None:
        took = (span["end_ns"] - span["start_ns"]) / 1e6
        lines.append(f"{'  ' * depth}{span['name']}  {took:.1f} ms")
        for key, item in span["attributes"].items():
            lines.append(f"{'  ' * depth}    {key} = {item!r}")
        for event in span["events"]:
            lines.append(f"{'  ' * depth}    event {event['name']} {event['attributes'] or ''}".rstrip())
        for child in children.get(span["span_id"], []):
            show(child, depth + 1)

    for root in children.get("", []):
        show(root, 0)
    return "\n".join(lines)


class Receiver:
    """The receiver in a subprocess, on a free port: `endpoint` for OTEL_EXPORTER_OTLP_ENDPOINT,
    `spans()` what it has received so far."""

    def __init__(self, out: Path) -> None:
        self.out, self.port = out, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]

    def __enter__(self) -> Receiver:
        command = [sys.executable, "-m", "harness.otlp", "--port", str(self.port), "--out", str(self.out)]
        self.process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + 10
        while not self.out.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the OTLP receiver did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info: object) -> None:
        stop_process(self.process)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--out", type=Path, required=True, help="the JSON lines file spans go to")
    parser.add_argument("--tree", action="store_true", help="print the spans in --out as trees, and exit")
    args = parser.parse_args()
    if args.tree:
        print(tree([json.loads(line) for line in args.out.read_text().splitlines() if line]))
    else:
        serve(args.port, args.out)
