"""OpenTelemetry tracing for the router and the engines, off unless `--otlp-traces-endpoint` is
given.

Spans: the router's `router.request` (the client's request, start to end of its answer) with a
`router.attempt` per send (attributes: the pair, the attempt number, the migration reason and
the tokens carried over; a `migration` event on the request span each time it moves; a failed
attempt is a retry) and a `router.prefill_leg` for PD; each engine's `engine.request` (attribute
`dsv4.role`) with its phases as children: `engine.prefill` then `engine.decode` (mono),
`engine.prefill_and_transfer` (prefill: its answer comes once the KV hand-off is done), or
`engine.transfer` (decode: bootstrap and KV wait, up to the first token) then `engine.decode`. A W3C `traceparent` (and `tracestate`) from the client is the
parent of the router's span; the router sends its own onward to the engines. With tracing off
the router still passes the client's `traceparent` on unchanged.

Export: OTLP over HTTP/protobuf to the given URL (a collector's `/v1/traces`), batched off the
event loop.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

TRACE_HEADERS = ("traceparent", "tracestate")


class Tracing:
    """A tracer when an endpoint is set, else nothing (every method is then a cheap no-op)."""

    def __init__(self, endpoint: Optional[str], service: str):
        self.on = bool(endpoint)
        self._tracer = None
        self._provider = None
        if not self.on:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("dsv4")

    def start(
        self,
        name: str,
        headers: Optional[Mapping[str, str]] = None,
        parent=None,
        kind: str = "internal",
        attributes: Optional[dict] = None,
    ):
        """A started span (end it with .end()), child of `parent` or of the traceparent in
        `headers`; None when tracing is off."""
        if not self.on:
            return None
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if parent is not None:
            ctx = trace.set_span_in_context(parent)
        elif headers is not None:
            ctx = TraceContextTextMapPropagator().extract({k: headers[k] for k in TRACE_HEADERS if k in headers})
        else:
            ctx = None
        return self._tracer.start_span(
            name,
            context=ctx,
            kind=getattr(SpanKind, kind.upper()),
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
        )

    @contextmanager
    def span(self, name: str, **kw) -> Iterator[object]:
        s = self.start(name, **kw)
        try:
            yield s
        finally:
            if s is not None:
                s.end()

    def headers(self, span, incoming: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The trace headers to send onward: this span's context, or (tracing off) the client's
        own traceparent passed through."""
        if span is None:
            return {k: incoming[k] for k in TRACE_HEADERS if incoming is not None and k in incoming}
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        out: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(span))
        return out

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def end(span, error: Optional[str] = None, **attributes) -> None:
    """End a span (None: tracing off), marking it failed when `error` is given."""
    if span is None:
        return
    for k, v in attributes.items():
        if v is not None:
            span.set_attribute(k, v)
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def event(span, name: str, **attributes) -> None:
    if span is not None:
        span.add_event(name, {k: v for k, v in attributes.items() if v is not None})
