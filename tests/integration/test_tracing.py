"""OpenTelemetry over real processes: a prefill engine, a decode engine and the router, each
started with --otlp-traces-endpoint pointing at a tiny OTLP/HTTP collector in this test. A
client's W3C traceparent becomes the parent of the router's span, and the router's, prefill's
and decode's spans (the request, the attempt, the prefill leg, prefill + transfer, the KV
transfer wait, decode) all land in that one trace, linked parent to child."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from bench.harness.commands import Proc, free_port, stop_all

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class Collector:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            spans.append(
                                {
                                    "service": service,
                                    "name": s.name,
                                    "trace": s.trace_id.hex(),
                                    "id": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(),
                                    "events": [e.name for e in s.events],
                                    "attrs": {a.key: a.value for a in s.attributes},
                                }
                            )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracing")
    col = Collector()
    p_port, b_port, d_port, r_port = (free_port() for _ in range(4))
    common = [
        "--model",
        tiny_model,
        "--kv-pages",
        128,
        "--page-size",
        16,
        "--served-model-name",
        "m",
        "--otlp-traces-endpoint",
        col.url,
    ]
    procs = [
        Proc(["serve", *common, "--role", "prefill", "--port", p_port, "--bootstrap-port", b_port], tmp / "p.log"),
        Proc(["serve", *common, "--role", "decode", "--port", d_port], tmp / "d.log"),
    ]
    p_url, d_url, r_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port))
    procs.append(
        Proc(
            [
                "router",
                "--prefill",
                p_url,
                "--decode",
                d_url,
                "--port",
                r_port,
                "--health-interval",
                "0.5",
                "--otlp-traces-endpoint",
                col.url,
            ],
            tmp / "r.log",
        )
    )
    try:
        for url, proc in zip((p_url, d_url, r_url), procs):
            proc.wait_ready(url)
        yield col, r_url
    finally:
        stop_all(procs)
        col.server.shutdown()


def test_one_trace_across_router_prefill_and_decode(traced):
    col, url = traced
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"},
        timeout=60,
    )
    assert r.status_code == 200 and "[DONE]" in r.text
    want = {
        ("dsv4-router", "router.request"),
        ("dsv4-router", "router.attempt"),
        ("dsv4-router", "router.prefill_leg"),
        ("dsv4-prefill", "engine.request"),
        ("dsv4-prefill", "engine.prefill_and_transfer"),
        ("dsv4-decode", "engine.request"),
        ("dsv4-decode", "engine.transfer"),
        ("dsv4-decode", "engine.decode"),
    }
    deadline = time.monotonic() + 20
    while True:
        mine = [s for s in col.spans if s["trace"] == TRACE_ID]
        if want <= {(s["service"], s["name"]) for s in mine}:
            break
        assert time.monotonic() < deadline, sorted({(s["service"], s["name"]) for s in col.spans})
        time.sleep(0.2)
    by = {(s["service"], s["name"]): s for s in mine}
    ids = {s["id"]: s for s in mine}
    assert by[("dsv4-router", "router.request")]["parent"] == PARENT  # the client's traceparent
    attempt = by[("dsv4-router", "router.attempt")]
    assert attempt["parent"] == by[("dsv4-router", "router.request")]["id"]
    assert by[("dsv4-router", "router.prefill_leg")]["parent"] == attempt["id"]
    assert by[("dsv4-prefill", "engine.request")]["parent"] == by[("dsv4-router", "router.prefill_leg")]["id"]
    assert by[("dsv4-decode", "engine.request")]["parent"] == attempt["id"]
    for phase in (("dsv4-decode", "engine.transfer"), ("dsv4-decode", "engine.decode")):
        assert ids[by[phase]["parent"]]["name"] == "engine.request"
