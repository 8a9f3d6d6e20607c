"""Migration: a request whose engine fails mid-answer continues on another one.

The router reads every event of a stream it relays (with `return_token_ids` asked of the engine)
and keeps the token ids the client has been sent. When the stream breaks -- the connection is
lost, the engine sends a retryable error event (an abort, a failed transfer, a drain that ran out
of grace: any 5xx), or the stream ends without finishing -- the request is sent again with those
tokens as `continuation_token_ids`. The engine that takes it computes prompt + continuation and
goes on as if it had produced them itself: `max_tokens`, `min_tokens`, penalties and `usage`
count the whole answer, the text and stop-string hold-back pick up where the client's text
ends, and a seeded sampler skips the draws already made (dsv4_engine.engine `_add`).

A request with several choices (`n` > 1) streams them interleaved, each tagged with its
`index`; the record keeps tokens and finish per index. An engine continues one sequence only,
so on a break the request splits: each unfinished choice j is sent again as its own n = 1
request (`child`) with choice j's tokens as its continuation and the seed the engine gave
choice j (seed + j), its events relabelled `index` j. Their usage chunks are held back and the
client gets one, counting the prompt once and every choice's tokens. A choice that had finished
is not sent again.

What this module holds is pure: the per-request record and the event filter. The router's
`_relay`, `_split` and `_place` do the I/O.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from dsv4_wire.choices import choice_seed
from dsv4_wire.request_fields import CONTINUATION_FIELD

# Why a request moved (the `reason` label of dsv4:router_migrations_total).
BROKEN = "connection_lost"  # the engine's connection broke (killed, crashed, restarted)
ERROR_EVENT = "engine_error"  # a retryable error event: aborted, transfer failed, drain ran out
TRUNCATED = "stream_cut"  # the stream ended without finishing
REFUSED = "engine_refused"  # a 5xx answer, or a prefill leg that failed, before any output
UNREACHABLE = "unreachable"  # the engine could not be connected to at all
STALLED = "engine_frozen"  # silent far past its pace, and its /ready unanswered (stall.py)
DRAINING = "engine_draining"  # the engine answered that it is shutting down: it never ran the request
# Re-sends that cost only time: the engine never had the request (not counted by --migration-limit).
NEVER_RAN = frozenset({UNREACHABLE, DRAINING})


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


def prompt_count(body: dict) -> int:
    """How many prompts a completion request holds (a list of texts or of token-id lists)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def choice_count(body: dict) -> int:
    """How many choices a streamed request has: `n` per prompt (best_of > n is not streamed)."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    return n * prompt_count(body)


# A plain delta event after its head (Resume.plain_event): one choice, no finish, the token ids
# last (group 1, their list group 2), then the ends of the event; no line break before its end.
_PLAIN_EVENT = re.compile(
    rb'\{"index": 0, "finish_reason": null, [^\n]*(, "token_ids": \[([^\]\n]*)\])(?:\}\]\}|\}\], "usage": null\})\n\n'
)


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
    pin: Optional[str] = None  # the worker an admin pinned this request to (a canary probe)
    # n > 1: per choice index, the tokens sent and whether it finished; role chunks sent (chat)
    choice_tokens: dict[int, list[int]] = field(default_factory=dict)
    choice_done: set[int] = field(default_factory=set)
    roles: set[int] = field(default_factory=set)
    # a child (one choice of a split request): its parent and the client's index it continues
    parent: Optional["Resume"] = None
    index: int = 0
    kids: list["Resume"] = field(default_factory=list)  # a split parent's children
    usage_chunk: Optional[dict] = None  # a child's usage chunk, held back for its parent
    failed: bool = False  # the client got this request's one clear error
    # The fast path (see `_fast`): the bytes every event of the current engine starts with, up
    # to its choices, once one event showed they need no rewriting (its id and created are ours).
    head: Optional[bytes] = None
    prompt_ids: Optional[list] = None  # the prompt's token ids when the router knows them (placement)

    @property
    def n(self) -> int:
        """Choices in the client's stream (indexes 0..n-1)."""
        return choice_count(self.body) if self.parent is None else 1

    @property
    def splittable(self) -> bool:
        """A stream of several choices of one prompt can go on one choice at a time. Several
        prompts cannot: the router, which has no tokenizer, could not count a finished prompt's
        tokens in the usage; their engines refuse the continuation (400) and the client gets it."""
        return self.n > 1 and prompt_count(self.body) == 1

    def child(self, j: int) -> "Resume":
        """Choice j of this request, to be continued alone (n = 1, seed + j)."""
        body = dict(self.body, n=1)
        body.pop("best_of", None)
        if "seed" in body:
            body["seed"] = choice_seed(body["seed"], j)
        kid = Resume(
            f"{self.rid}-c{j}",
            body,
            stream=True,
            client_wants_ids=self.client_wants_ids,
            tokens=list(self.choice_tokens.get(j, ())),
            created=self.created,
            attempts=self.attempts,
            resends=self.resends,
            reasons=self.reasons,
            placing_s=self.placing_s,
            t0=self.t0,
            span=self.span,
            trace_in=self.trace_in,
            parent=self,
            index=j,
        )
        if j in self.roles:
            kid.roles.add(0)
        self.kids.append(kid)
        return kid

    def usage(self) -> Optional[dict]:
        """A split request's usage chunk: the prompt once (every child reports the same prompt),
        the completion tokens of every choice (a continued choice's count is its whole answer;
        one that finished before the split counts the tokens the client had)."""
        chunks = [k.usage_chunk for k in self.kids if k.usage_chunk and k.usage_chunk.get("usage")]
        if not chunks:
            return None
        obj = json.loads(json.dumps(chunks[0]))
        u = obj["usage"]
        continued = {k.index: k.usage_chunk["usage"] for k in self.kids if k.usage_chunk and k.usage_chunk.get("usage")}
        completion = sum(
            continued[j]["completion_tokens"] if j in continued else len(self.choice_tokens.get(j, ()))
            for j in range(self.n)
        )
        u["completion_tokens"] = completion
        u["total_tokens"] = u.get("prompt_tokens", 0) + completion
        thought = [(c.get("completion_tokens_details") or {}).get("reasoning_tokens") for c in continued.values()]
        if any(t is not None for t in thought) and isinstance(u.get("completion_tokens_details"), dict):
            u["completion_tokens_details"]["reasoning_tokens"] = sum(t or 0 for t in thought)
        return obj

    @property
    def started(self) -> bool:
        """The client has bytes: a re-send from here on must continue, not restart."""
        return self.created is not None

    def attempt_body(self) -> dict:
        """The body of the next send: the first under the client's id, later ones under their
        own (the engine it left may still hold the old one) and with the answer so far."""
        rid = self.rid if self.attempts == 0 else f"{self.rid}-m{self.attempts}"  # a child's rid has -cJ
        body = dict(self.body, rid=rid)
        if self.stream:
            body["return_token_ids"] = True  # the router's bookkeeping; stripped unless asked
        if self.tokens:
            body[CONTINUATION_FIELD] = list(self.tokens)
        return body

    def filter(self, whole: bytes) -> tuple[bytes, Optional[str]]:
        """Whole SSE events from an engine -> (bytes for the client, what happened). Pure but for
        this record. The second item: None (keep reading), "done" ([DONE] after a finish),
        or a migration reason (the rest of `whole` is dropped: the next engine redoes it)."""
        out = bytearray()
        for event in whole.split(b"\n\n"):
            if not event:
                continue
            if self.head is not None and event.startswith(self.head):
                fast = self._fast(event)
                if fast is not None:
                    out += fast
                    continue
            if not event.startswith(b"data: "):
                out += event + b"\n\n"
                continue
            data = event[6:].strip()
            if data == b"[DONE]":
                if not self.finished:
                    return bytes(out), TRUNCATED
                if self.parent is None:  # a child's end is its parent's to say
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
            top = self.parent or self
            if (
                self.head is None
                and self.parent is None
                and self.n == 1
                and obj.get("id") == top.rid
                and obj.get("created") == self.created
            ):
                cut = data.find(b'"choices": [{')
                if cut > 0 and data.startswith(b'{"id": '):
                    self.head = b"data: " + data[: cut + len(b'"choices": [')]
            obj["id"] = top.rid
            obj["created"] = self.created
            choices = obj.get("choices")
            if self.parent is not None and not choices and obj.get("usage"):
                self.usage_chunk = obj  # the parent sends one usage for all its choices
                continue
            kept = []
            for c in choices or ():
                j = c.get("index", 0) if isinstance(c.get("index", 0), int) else 0
                delta = c.get("delta")
                if isinstance(delta, dict) and "role" in delta:
                    if j in self.roles:  # a choice restarted from nothing: its role chunk was sent
                        del delta["role"]
                        if (
                            not delta.get("content")
                            and len(delta) <= 1
                            and c.get("finish_reason") is None
                            and not c.get("token_ids")
                        ):
                            continue
                    self.roles.add(j)
                ids = c.get("token_ids") if self.client_wants_ids else c.pop("token_ids", None)
                if self.parent is not None:
                    c["index"] = self.index
                    if ids:
                        self.parent.choice_tokens.setdefault(self.index, []).extend(ids)
                if ids:
                    self.tokens.extend(ids)
                    self.choice_tokens.setdefault(j, []).extend(ids)
                if c.get("finish_reason") is not None:
                    self.choice_done.add(j)
                    if self.parent is not None:
                        self.parent.choice_done.add(self.index)
                        self.parent.finished = len(self.parent.choice_done) >= self.parent.n
                    self.finished = len(self.choice_done) >= self.n
                kept.append(c)
            if choices and not kept:
                continue
            if choices is not None:
                obj["choices"] = kept
            out += b"data: " + json.dumps(obj, separators=(", ", ": ")).encode() + b"\n\n"
        return bytes(out), None

    # The events of a stream, but for its first and last, are one choice's plain delta: nothing
    # in them changes on the way to the client except the token ids the router asked for. They
    # are relayed as bytes: the ids are read and cut out, no JSON is decoded or encoded.
    _PLAIN = b'{"index": 0, "finish_reason": null, '
    _IDS = b', "token_ids": ['
    _ENDS = (b"}]}", b'}], "usage": null}')

    def plain_event(self, chunk: bytes) -> Optional[bytes]:
        """The client's bytes when `chunk` is exactly one plain delta event of this request's
        current engine (what `filter` gives for it, tokens recorded), else None with nothing
        recorded: the chunk then goes through `filter`."""
        head = self.head
        if head is None or not chunk.startswith(head):
            return None
        # _fast's reading in one match on the chunk as it came (every relayed token passes here)
        m = _PLAIN_EVENT.fullmatch(chunk, len(head))
        if m is None:
            return None
        raw = m.group(2)
        try:
            ids = (int(raw),) if b"," not in raw else [int(t) for t in raw.split(b",")]
        except ValueError:
            if raw.strip():
                return None
            ids = ()
        if ids:
            self.tokens.extend(ids)
            mine = self.choice_tokens.get(0)
            if mine is None:
                self.choice_tokens[0] = list(ids)
            else:
                mine.extend(ids)
        if self.client_wants_ids:
            return chunk
        at, close = m.span(1)
        return chunk[:at] + chunk[close:]

    def _fast(self, event: bytes) -> Optional[bytes]:
        """The client's bytes for a plain delta event of this request's current engine (the
        same bytes the JSON path gives), or None when the event needs that path."""
        rest = len(self.head)
        if not event.startswith(self._PLAIN, rest):
            return None
        at = event.rfind(self._IDS, rest)
        if at < 0:
            return None
        close = event.find(b"]", at)
        if close < 0 or event[close + 1 :] not in self._ENDS:
            return None
        raw = event[at + len(self._IDS) : close]
        try:
            ids = [int(t) for t in raw.split(b",")] if raw.strip() else []
        except ValueError:
            return None
        if ids:
            self.tokens.extend(ids)
            self.choice_tokens.setdefault(0, []).extend(ids)
        if self.client_wants_ids:
            return event + b"\n\n"
        return event[:at] + event[close + 1 :] + b"\n\n"


def allowed_resends(limit: int, started: bool) -> int:
    """Re-sends a request may still make: --migration-limit, but a request that has not sent the
    client anything keeps the one retry it always had, even with migration off. Pure."""
    return limit if started else max(limit, 1)
