"""Migration: a request whose engine fails mid-answer continues on another one.

The router reads every event of a stream it relays (with `return_token_ids` asked of the engine)
and keeps the token ids the client has been sent. When the stream breaks -- the connection is
lost, the engine sends a retryable error event (an abort, a failed transfer, a drain that ran out
of grace: any 5xx), or the stream ends without finishing -- the request is sent again with those
tokens as `continuation_token_ids`. The engine that takes it computes prompt + continuation and
goes on as if it had produced them itself: `max_tokens`, `min_tokens`, penalties and `usage`
count the whole answer, the text and stop-string hold-back pick up where the client's text
ends, and a seeded sampler skips the draws already made (dsv4_engine.engine `_add`).

What this module holds is pure: the per-request record and the event filter. The router's
`_relay` and `_place` do the I/O.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# Why a request moved (the `reason` label of dsv4:router_migrations_total).
BROKEN = "connection_lost"  # the engine's connection broke (killed, crashed, restarted)
ERROR_EVENT = "engine_error"  # a retryable error event: aborted, transfer failed, drain ran out
TRUNCATED = "stream_cut"  # the stream ended without finishing
REFUSED = "engine_refused"  # a 5xx answer, or a prefill leg that failed, before any output
UNREACHABLE = "unreachable"  # the engine could not be connected to at all


def retryable(err: dict) -> bool:
    """Whether an engine's error body means "this engine could not finish", not "this request
    is bad": 5xx (and server_error) move, 4xx reach the client. Pure."""
    e = err.get("error") if isinstance(err, dict) else None
    if not isinstance(e, dict):
        return False
    code = e.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return code >= 500
    return e.get("type") == "server_error"


@dataclass
class Resume:
    """One client request across the engines it visits."""

    rid: str
    body: dict
    stream: bool
    client_wants_ids: bool = False
    tokens: list[int] = field(default_factory=list)  # sent to the client so far
    finished: bool = False  # a finish_reason reached the client
    created: Optional[int] = None  # the first chunk's, kept for every later one
    attempts: int = 0  # sends so far
    resends: int = 0  # re-sends that count against --migration-limit
    reasons: list[str] = field(default_factory=list)
    placing_s: float = 0.0  # time spent re-placing (from a break to the next first event)
    t0: float = field(default_factory=time.monotonic)
    leg: Any = None  # the router's current engine leg (closed when the client leaves)
    span: Any = None  # the router.request span (tracing on)
    trace_in: dict = field(default_factory=dict)  # the client's traceparent/tracestate

    @property
    def started(self) -> bool:
        """The client has bytes: a re-send from here on must continue, not restart."""
        return self.created is not None

    def attempt_body(self) -> dict:
        """The body of the next send: the first under the client's id, later ones under their
        own (the engine it left may still hold the old one) and with the answer so far."""
        rid = self.rid if self.attempts == 0 else f"{self.rid}-m{self.attempts}"
        body = dict(self.body, rid=rid)
        if self.stream:
            body["return_token_ids"] = True  # the router's bookkeeping; stripped unless asked
        if self.tokens:
            body["continuation_token_ids"] = list(self.tokens)
        return body

    def filter(self, whole: bytes) -> tuple[bytes, Optional[str]]:
        """Whole SSE events from an engine -> (bytes for the client, what happened). Pure but for
        this record. The second item: None (keep reading), "done" ([DONE] after a finish),
        or a migration reason (the rest of `whole` is dropped: the next engine redoes it)."""
        out = bytearray()
        for event in whole.split(b"\n\n"):
            if not event:
                continue
            if not event.startswith(b"data: "):
                out += event + b"\n\n"
                continue
            data = event[6:].strip()
            if data == b"[DONE]":
                if not self.finished:
                    return bytes(out), TRUNCATED
                out += b"data: [DONE]\n\n"
                return bytes(out), "done"
            try:
                obj = json.loads(data)
            except ValueError:
                return bytes(out), TRUNCATED
            if not isinstance(obj, dict):
                return bytes(out), TRUNCATED
            if "error" in obj:
                if retryable(obj) and not self.finished:
                    return bytes(out), ERROR_EVENT
                out += event + b"\n\n"
                continue
            if self.created is None:
                self.created = obj.get("created")
            obj["id"] = self.rid
            obj["created"] = self.created
            for c in obj.get("choices") or ():
                ids = c.get("token_ids") if self.client_wants_ids else c.pop("token_ids", None)
                if ids:
                    self.tokens.extend(ids)
                if c.get("finish_reason") is not None:
                    self.finished = True
            out += b"data: " + json.dumps(obj, separators=(", ", ": ")).encode() + b"\n\n"
        return bytes(out), None


def allowed_resends(limit: int, started: bool) -> int:
    """Re-sends a request may still make: --migration-limit, but a request that has not sent the
    client anything keeps the one retry it always had, even with migration off. Pure."""
    return limit if started else max(limit, 1)
