"""The PD router: the OpenAI API in front of prefill + decode (or monolithic) engines.

Each request gets a prefill and a decode worker (least busy, by the router's own count of
requests in flight; the prefill, or mono, worker by prefix affinity within a load bound, see
affinity.py) and a random bootstrap room, and goes to both at once; the client reads the
decode's answer. A request that fails before its first byte is retried once on another pair.

Holding under load (see admission.py, upstream.py, relay.py): at most --max-inflight requests
are inside the router, up to --max-queue more wait up to --queue-timeout seconds, the rest get
429 with Retry-After. Prefill legs, decode streams and control traffic (health checks,
/v1/models) have separate connection pools, the data ones sized so an admitted request never
waits for a connection.

This module places and relays requests (`Router`); the workers, their pool and health checks are
`workers`, the HTTP app and `dsv4 router`'s process are `app`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from dsv4_router.router_args import RouterArgs
from dsv4_router.workers import Health, RouterMetrics, Worker, WorkerPool
from dsv4_router.admission import Admission, Overloaded, Slot
from dsv4_router.affinity import ConversationKeys
from dsv4_router.body import body_limit, parse_body, read_limited
from dsv4_router.cache_index import CacheIndex
from dsv4_router.cache_placement import CachePlacement, Tokenize, prompt_ids
from dsv4_router.cache_subscriber import CacheSubscriber
from dsv4_router.hangup import SCOPE_KEY as HANGUP, Hangup
from dsv4_router.hold import PlannedHold, draining_refusal, may_keep_waiting
from dsv4_router.migration import (
    BROKEN,
    DRAINING,
    NEVER_RAN,
    REFUSED,
    STALLED,
    TRUNCATED,
    UNREACHABLE,
    Resume,
    allowed_resends,
)
from dsv4_router.relay import Outlet, RelayResponse, error_events, first_event_error, split_events, sse
from dsv4_router.sessions import session_into_body
from dsv4_router.stall import StallWatch
from dsv4_router.tenancy import admit_sequences, apply_cache_salt
from dsv4_router.upstream import CONNECTION_FAILURES, Upstreams
from dsv4_wire import tracing
from dsv4_wire.tracing import TRACE_HEADERS, Tracing
from dsv4_wire import APIError, admin_refusal, authorization_header
from dsv4_wire.request_fields import ROUTER_ONLY_FIELDS
from dsv4_wire.sequences import MAX_SEQUENCES_PER_REQUEST, sequence_count, too_many_sequences
from dsv4_router.request_id import request_id

# A request carrying this header (and the admin token) goes to the decode/mono worker it names,
# canary or not: how a rollout probes one engine through the router.
PIN_HEADER = "x-dsv4-pin-worker"

GC_YOUNG_THRESHOLD = 20_000  # allocations between collections of the youngest generation (700 by default)

log = logging.getLogger("dsv4.router")


@dataclass
class Retry:
    """An attempt that failed before any output: what the engine said, if anything, and why
    (a reason of dsv4_router.migration)."""

    status: int
    content: bytes
    reason: str = REFUSED


class Router:
    def __init__(self, args: RouterArgs):
        self.args = args
        self.pool = WorkerPool()
        for u in args.prefill:
            self.pool.add(u, "prefill")
        for u in args.decode:
            self.pool.add(u, "decode")
        for u in args.mono:
            self.pool.add(u, "mono")
        self.metrics = RouterMetrics()
        self.keys = ConversationKeys()  # prefix-affinity keys, remembering short plain prompts
        self.admission = Admission(args.max_inflight, args.max_queue, args.queue_timeout)
        self.hold = PlannedHold()  # a planned change's lease (hold.py, POST /admin/hold)
        self.metrics.inflight.set_function(lambda: self.admission.inflight)
        self.metrics.queued.set_function(lambda: self.admission.queued)
        self.metrics.planned_hold.set_function(lambda: self.hold.left(time.monotonic()))
        self.waiting_for_engine = 0  # requests waiting for a healthy engine (pair): held, not stuck here
        self.metrics.engine_wait.set_function(lambda: self.waiting_for_engine)
        self.up: Optional[Upstreams] = None
        self.tracing = Tracing(args.otlp_traces_endpoint, "dsv4-router")
        self._tasks: list[asyncio.Task] = []
        self.health = Health(args.health_interval, self.pool, self.metrics)
        self.stalls = StallWatch(self.health, args.stall_check_after)  # frozen engines: their requests move
        # what each engine holds (its KV cache events) and placement by it; `tokenize` (set by
        # the CLI from the engine's own code) would let it score text and chat prompts too
        self.index = CacheIndex()
        self.placement = CachePlacement(self.index)
        self.subscriber: Optional[CacheSubscriber] = None
        self.tokenize: Optional[Tokenize] = None

    async def start(self) -> None:
        self.up = Upstreams(
            self.args.max_inflight,
            self.args.request_timeout,
            self.args.health_timeout,
            self.args.pd_secret or self.args.engine_api_key,
        )
        self.health.control = self.up.control
        if self.args.cache_events:
            secret = self.args.pd_secret or self.args.engine_api_key
            self.subscriber = CacheSubscriber(self.index, headers=authorization_header(secret))
            self.subscriber.start()
            self._tasks.append(asyncio.create_task(self._follow_loop()))
        await self.health.check_all()
        # Everything loaded so far lives as long as the process: out of the collector's sight,
        # a full collection (which the per-request garbage triggers) no longer walks it.
        gc.freeze()
        # A collection of the youngest objects every 700 allocations was a few % of the router's
        # CPU at fleet rates (bench/suites/relay_bench.py); most of a request's objects are gone
        # again before 20,000, and the older generations follow the same ratios as before.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        self._tasks.append(asyncio.create_task(self.health.loop()))
        self._tasks.append(asyncio.create_task(self.stalls.loop()))
        if self.args.discover_namespace:
            from dsv4_router.discovery import watch_pods

            self._tasks.append(asyncio.create_task(watch_pods(self, self.args.discover_namespace, self.args.selector)))

    async def stop(self) -> None:
        for t in [*self._tasks, *self.health.checking.values()]:
            t.cancel()
        if self.up:
            await self.up.aclose()
        if self.subscriber is not None:
            await self.subscriber.aclose()
        self.tracing.shutdown()

    async def _follow_loop(self) -> None:
        """Follow every worker's cache events (cache_subscriber.py); forget removed workers."""
        while True:
            for url in set(self.subscriber.following()) - set(self.pool.workers):
                self.subscriber.drop(url)
            for url in self.pool.workers:
                self.subscriber.follow(url)
            await asyncio.sleep(min(self.args.health_interval, 1.0))

    # ---- requests --------------------------------------------------------------------------------

    def _pinned(self, pin: str) -> Worker:
        w = self.pool.workers.get(pin.rstrip("/"))
        if w is None or w.role == "prefill":
            raise APIError(f"{PIN_HEADER}: {pin} is not a decode or mono worker of this router", 400)
        if not w.healthy:
            raise APIError(f"the pinned worker {w.url} is not ready: {w.reason}", 503, "service_unavailable")
        return w

    def _placer(self, st: Optional[Resume], key: Optional[str], held_only: bool = False):
        """Placement by what each engine holds, for this request (None: its tokens are unknown).
        `held_only`: decode's, which is balanced by load unless an engine holds the prompt (a
        conversation's decode-side cache): the prefill's session tie-break must not pile every
        stream of one conversation start onto one decode."""
        ids = getattr(st, "prompt_ids", None)
        if not ids:
            return None
        body = st.body
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        session = body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None
        return lambda ready: self.placement.pick(ready, ids, salt, session or key or "", session or key, held_only)

    def _pair(
        self, exclude: set[str], key: Optional[str] = None, pin: Optional[str] = None, st: Optional[Resume] = None
    ) -> tuple[Optional[Worker], Worker]:
        """key: the request's prefix-affinity key; it steers the engine that prefills (prefill or
        mono: the one whose prefix cache it hopes to hit), never decode (it receives every page).
        pin: the decode or mono worker this request must reach (a canary probe's)."""
        placed = self._placer(st, key)
        if pin is not None:
            w = self._pinned(pin)
            if w.role == "mono":
                return None, w
            p = self.pool.pick("prefill", exclude, key, placed=placed)
            if p is None or p.bootstrap_port is None:
                raise APIError("no healthy prefill is available", 503, "service_unavailable")
            return p, w
        if any(w.role == "prefill" for w in self.pool.workers.values()):
            # decode too goes where the conversation is held, when decode engines publish events
            p = self.pool.pick("prefill", exclude, key, placed=placed)
            d = self.pool.pick("decode", exclude, placed=self._placer(st, key, held_only=True))
            if p is None or d is None or p.bootstrap_port is None:
                raise APIError("no healthy prefill/decode pair is available", 503, "service_unavailable")
            return p, d
        m = self.pool.pick("mono", exclude, key, placed=placed)
        if m is None:
            raise APIError("no healthy engine is available", 503, "service_unavailable")
        return None, m

    async def handle(self, path: str, http: Request, body: Optional[dict] = None) -> Response:
        """`body`: the request's, already read (an agent API's, translated to chat: agent_routes.py;
        counted under the path the client called)."""
        self.metrics.requests_of(http.url.path if body is not None else path).inc()
        pin = http.headers.get(PIN_HEADER)
        if pin is not None:  # only an admin may aim a request at one engine (a canary)
            refusal = admin_refusal(http.headers, self.args.admin_token, http.client.host if http.client else None)
            if refusal is not None:
                status, message = refusal
                return self.error(
                    APIError(
                        f"{PIN_HEADER}: {message}",
                        status,
                        "authentication_error" if status == 401 else "permission_error",
                    )
                )
        try:
            if body is None:
                raw = await read_limited(http.headers.get("content-length"), http.stream(), self.body_limit())
                body = parse_body(raw)
        except APIError as e:
            return self.error(e)
        except ClientDisconnect:
            return Response(status_code=499)
        for k in ROUTER_ONLY_FIELDS:  # a client chooses no prefill for a decode and forges no answer so far
            body.pop(k, None)
        try:  # unique whatever the client sends, and safe to log
            body["rid"] = request_id(body.get("rid"), chat="chat" in path)
        except APIError as e:
            return self.error(e)
        sequences = sequence_count(body)
        if sequences > MAX_SEQUENCES_PER_REQUEST:
            return self.error(APIError(too_many_sequences(sequences), 400, "invalid_request_error", param="n"))
        refused = admit_sequences(http.scope, sequences)  # the caller's key pays per sequence
        if refused is not None:
            return self.error(refused, {"Retry-After": str(refused.retry_after)})
        trace_in = {k: http.headers[k] for k in TRACE_HEADERS if k in http.headers}
        apply_cache_salt(body, http.scope)
        session_into_body(body, http.headers)
        # A client that hangs up (queued or not) cancels the work: closing the upstream
        # connections is what makes the engines abort (and, through them, the PD peer).
        slot = Slot(self.admission)
        if http.scope.get(HANGUP, False) is None:  # the fast lane's: one watch, the work inline
            return await self._watched(http, slot, self._admitted(path, body, slot, trace_in, pin))
        work = asyncio.ensure_future(self._admitted(path, body, slot, trace_in, pin))
        gone = asyncio.ensure_future(self._wait_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            slot.release()
            return Response(status_code=499)
        try:
            result = work.result()
        except BaseException:
            slot.release()
            raise
        if not isinstance(result, RelayResponse):
            slot.release()  # a stream keeps its slot until it ends
        return result

    @staticmethod
    async def _watched(http: Request, slot: Slot, work) -> Response:
        """Run `work` in this task, watched for a hang-up (hangup.py); a stream keeps its slot
        and the watch until it ends (relay.RelayResponse)."""
        hang = http.scope[HANGUP] = Hangup(http.receive)
        try:
            result = await work
        except asyncio.CancelledError:
            slot.release()
            if hang.caught():
                return Response(status_code=499)
            raise
        except BaseException:
            slot.release()
            raise
        if not isinstance(result, RelayResponse):
            slot.release()  # a stream keeps its slot until it ends
        return result

    @staticmethod
    async def _wait_disconnect(http: Request) -> None:
        # The body is read: the next ASGI message is the disconnect, whenever it comes.
        while (await http.receive())["type"] != "http.disconnect":
            pass

    async def _admitted(
        self, path: str, body: dict, slot: Slot, trace_in: Optional[dict] = None, pin: Optional[str] = None
    ) -> Response:
        try:
            await slot.acquire()
        except Overloaded as e:
            self.metrics.rejected.inc()
            return self.error(
                APIError(e.reason, 429, "rate_limit_exceeded", code="router_overloaded"),
                {"Retry-After": str(e.retry_after)},
            )
        return await self._route(path, body, slot, trace_in or {}, pin)

    async def _route(self, path: str, body: dict, slot: Slot, trace_in: dict, pin: Optional[str] = None) -> Response:
        rid = body.get("rid") if isinstance(body.get("rid"), str) else request_id(None, chat="chat" in path)
        st = Resume(rid, body, stream=bool(body.get("stream")), client_wants_ids=body.get("return_token_ids") is True)
        st.trace_in = trace_in
        st.pin = pin
        st.span = self.tracing.start(
            "router.request",
            headers=trace_in,
            kind="server",
            attributes={"dsv4.rid": rid, "http.route": path, "dsv4.stream": st.stream},
        )
        key = self.keys.key(path, body)
        st.prompt_ids = await self._prompt_ids(path, body) if self.subscriber is not None else None
        handed_off = False
        try:
            placed = await self._place(path, st, key)
            if not isinstance(placed, Leg):
                return placed
            if st.stream:
                handed_off = True
                outlet = Outlet()
                return RelayResponse(
                    self._relay(path, st, placed, key, outlet),
                    on_close=lambda: self._stream_closed(st, slot),
                    outlet=outlet,
                )
            try:
                content = await placed.resp.aread()
            except httpx.HTTPError as e:  # the body of a non-streaming answer broke off
                self.health.connection_failed(placed.d, e)
                return self.error(
                    APIError(f"the decode engine's answer broke off: {type(e).__name__}", 502, "server_error")
                )
            finally:
                await placed.close()
            return Response(_with_id(content, st.rid), 200, media_type="application/json")
        finally:
            if not handed_off:
                self._log_moves(st)

    def body_limit(self) -> int:
        """The largest body accepted: --max-body-bytes, or derived from the engines' context."""
        return body_limit(self.args.max_body_bytes, (w.max_model_len for w in self.pool.workers.values()))

    async def _prompt_ids(self, path: str, body: dict) -> Optional[list]:
        """The prompt's token ids for placement: as sent, or rendered and tokenized (--tokenizer)
        on a worker thread, so a long conversation does not hold up every other stream."""
        ids = prompt_ids(path, body)
        if ids is None and self.tokenize is not None:
            ids = await asyncio.to_thread(prompt_ids, path, body, self.tokenize)
        return ids

    def error(self, e: APIError, headers: Optional[dict] = None) -> JSONResponse:
        self.metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def _place(
        self, path: str, st: Resume, key: Optional[str], reason: Optional[str] = None, failed: frozenset = frozenset()
    ) -> "Leg | Response":
        """Send the request (again, after `reason`, away from the workers in `failed`) until an
        engine is on its way with it: a Leg, or the final answer (a 4xx, or the one clear error
        once --migration-limit or --migration-timeout is spent).

        A first send has no time bound of its own (a prefill may queue); re-placing does: the
        time from each break to the next first event, summed over the request. An engine that
        cannot even be connected to does not count against the limit (it is out of rotation at
        once), so a request can wait, within the time bound, for one that is coming back."""
        a = self.args
        tried = set(failed)
        last: Optional[Retry] = None
        t_break = time.monotonic() if reason is not None else None  # the bound runs from the first failure
        budget = a.migration_timeout
        held_since: Optional[float] = None  # a first send waiting for a healthy engine (pair)
        try:
            while True:
                if reason is not None:
                    t_break = t_break or time.monotonic()
                    now = time.monotonic()
                    # a planned change's hold (hold.py) stretches the bound while it lasts
                    budget = max(a.migration_timeout - st.placing_s - (now - t_break), self.hold.left(now))
                    if (
                        reason not in NEVER_RAN and st.resends >= allowed_resends(a.migration_limit, st.started)
                    ) or budget <= 0:
                        return self._gave_up(st, last, budget <= 0)
                try:
                    p, d = self._pair(tried, key, st.pin, st)
                except APIError as e:
                    if reason is None:
                        # None healthy now (a restart, the roll of a one-replica role): hold the
                        # request, within --engine-wait-timeout (or a planned hold, hold.py), for
                        # one to come back, rather than a 503 (never a pinned one: the probe wants its answer)
                        now = time.monotonic()
                        held_since = held_since or now
                        if (
                            e.status == 503
                            and st.pin is None
                            and may_keep_waiting(
                                now - held_since, a.engine_wait_timeout, self.hold.left(now), a.request_timeout
                            )
                        ):
                            await self._wait_for_engine()
                            continue
                        return self.error(e, {"Retry-After": "2"})
                    if budget <= 0.25 or a.migration_limit == 0:
                        return self._gave_up(st, last, timed_out=a.migration_limit > 0)
                    await self._wait_for_engine()  # nothing healthy now: wait, within the bound, for one to come back
                    continue
                tried.update({d.url} | ({p.url} if p else set()))
                if reason is not None:
                    tracing.event(
                        st.span, "migration", reason=reason, tokens_carried=len(st.tokens), attempt=st.attempts
                    )
                    st.reasons.append(f"{reason} after {len(st.tokens)} token(s)")
                    st.resends += reason not in NEVER_RAN  # an engine that never had it costs only time
                    self.metrics.migrations.labels(reason).inc()
                    if not st.started:
                        self.metrics.retries.inc()
                body = st.attempt_body()
                st.attempts += 1
                span = self.tracing.start(
                    "router.attempt",
                    parent=st.span,
                    attributes={
                        "dsv4.attempt": st.attempts,
                        "dsv4.decode": d.url,
                        "dsv4.prefill": p.url if p else None,
                        "dsv4.migration_reason": reason,
                        "dsv4.continuation_tokens": len(st.tokens),
                    },
                )
                opening = self._open(path, body, p, d, span, st.trace_in)
                load = _Load(len(getattr(st, "prompt_ids", None) or ()), p, d)
                try:
                    result = await (opening if reason is None else asyncio.wait_for(opening, max(budget, 0.01)))
                except BaseException as e:
                    load.release()
                    tracing.end(span, error=type(e).__name__)
                    raise
                load.hand_to(result)
                if not isinstance(result, Retry):
                    if not isinstance(result, Leg):
                        tracing.end(span, error=f"answered {result.status_code}")
                    return result
                tracing.end(span, error=f"failed: {result.reason} ({result.status})")
                last = result
                if result.reason in NEVER_RAN:
                    tried.discard(d.url)  # out of rotation now; welcome back once /ready passes
                reason = result.reason
        except asyncio.TimeoutError:
            return self._gave_up(st, last, True)
        finally:
            if t_break is not None:
                st.placing_s += time.monotonic() - t_break

    async def _wait_for_engine(self) -> None:
        """A pause of a request that finds no healthy engine (pair), counted in
        dsv4_router:engine_wait_requests: the watchdog tells it from a router that is stuck."""
        self.waiting_for_engine += 1
        try:
            await asyncio.sleep(0.25)
        finally:
            self.waiting_for_engine -= 1

    def _gave_up(self, st: Resume, last: Optional[Retry], timed_out: bool) -> Response:
        if last is not None and last.content and not st.started and not timed_out:
            self.metrics.errors.labels(str(last.status)).inc()
            return Response(last.content, last.status, media_type="application/json")
        why = (
            f"no engine took it over within --migration-timeout ({self.args.migration_timeout:g}s)"
            if timed_out
            else f"it failed on {st.attempts} engine(s) (--migration-limit {self.args.migration_limit})"
        )
        return self.error(
            APIError(f"the request could not be completed: {why}; see the engines' logs", 503, "service_unavailable"),
            {"Retry-After": "2"},
        )

    def _log_moves(self, st: Resume) -> None:
        tracing.end(
            st.span, migrations=len(st.reasons), completion_tokens_relayed=len(st.tokens) if st.stream else None
        )
        st.span = None
        if st.reasons:
            log.info(
                "request %s: migrations=%d (%s), %.2fs re-placing",
                st.rid,
                len(st.reasons),
                "; ".join(st.reasons),
                st.placing_s,
            )

    async def _open(
        self, path: str, body: dict, p: Optional[Worker], d: Worker, span=None, trace_in: Optional[dict] = None
    ) -> "Leg | Response | Retry":
        """One send to one pair, up to the decode's first event: a Leg on its way, a final
        answer (4xx), or a Retry (failed before any output)."""
        prefill: Optional[asyncio.Task] = None
        if p is not None:
            body.update(bootstrap_host=p.host, bootstrap_port=p.bootstrap_port, bootstrap_room=random.getrandbits(63))
            leg = {k: v for k, v in body.items() if k != "stream_options"}  # stream_options needs stream
            prefill = asyncio.create_task(self._prefill(path, dict(leg, stream=False), p, span, trace_in))
        d.inflight += 1
        self.metrics.worker_requests_of(d.url, d.role).inc()
        opening = asyncio.create_task(self._open_decode(path, body, d, self.tracing.headers(span, trace_in)))
        frozen = asyncio.get_running_loop().create_future()  # set by the stall watch: an engine froze

        def froze(w: Worker) -> None:
            if not frozen.done():
                frozen.set_result(w)
                if prefill is None:
                    opening.cancel()  # one engine: what waits on it needs no asyncio.wait (below)

        watched = self.stalls.watch((p, d) if p is not None else (d,), froze)
        handed_off = False
        try:
            if prefill is None:
                try:
                    await opening
                except asyncio.CancelledError:
                    if frozen.done() and not asyncio.current_task().cancelling():
                        return Retry(502, b"", STALLED)  # silent, and its /ready unanswered: another
                    raise
            waits = {opening, frozen} | ({prefill} if prefill is not None else set())
            while not opening.done():
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if frozen.done():  # silent, and its /ready unanswered: another pair
                    opening.cancel()  # closing the connections aborts the request where it was
                    await asyncio.gather(opening, return_exceptions=True)
                    return Retry(502, b"", STALLED)
                # A prefill leg that fails before decode's first byte dooms the attempt: answer or
                # retry now instead of letting decode wait out its deadline for KV that will not come.
                if prefill is not None and prefill.done() and prefill in waits:
                    waits.discard(prefill)
                    watched.workers = (d,)  # the prefill's part is over
                    if not opening.done() and prefill.exception() is None:
                        status, content = prefill.result()
                        if status == 0 or status >= 400:
                            opening.cancel()  # closing decode's connection aborts its side of the room
                            await asyncio.gather(opening, return_exceptions=True)
                            if 400 <= status < 500:  # the client's request (or a full engine: 429)
                                self.metrics.errors.labels(str(status)).inc()
                                return Response(content, status, _retry_after(status), media_type="application/json")
                            if draining_refusal(status, content):  # shutting down: out now, not counted
                                self.health.mark_failed(p, "draining: it refused a request (shutting down)")
                                return Retry(status, content, DRAINING)
                            return Retry(status or 502, content, UNREACHABLE if status == 0 else REFUSED)
            opened = await opening
            if not isinstance(opened, tuple):
                return opened
            resp, chunks, first = opened
            handed_off = True
            return Leg(d, prefill, resp, chunks, first, span=span)
        finally:
            self.stalls.unwatch(watched)
            if not opening.done():
                opening.cancel()  # it closes its response itself
            elif (
                not handed_off
                and not opening.cancelled()
                and opening.exception() is None
                and isinstance(opening.result(), tuple)
            ):
                await opening.result()[0].aclose()  # opened, then abandoned (client left)
            if not handed_off:
                d.inflight -= 1
                if prefill is not None and not prefill.done():
                    prefill.cancel()  # closing the connection aborts the request on prefill

    async def _open_decode(
        self, path: str, body: dict, d: Worker, headers: Optional[dict] = None
    ) -> "tuple[httpx.Response, AsyncIterator[bytes], bytes] | Response | Retry":
        """Send to decode and read up to its first event: (response, its byte stream, first
        bytes) when it is on its way, else the final answer or a Retry."""
        try:
            resp = await self.up.open_stream(f"{d.url}{path}", body, headers)
        except httpx.HTTPError as e:
            self.health.connection_failed(d, e)
            return Retry(502, b"", UNREACHABLE if isinstance(e, CONNECTION_FAILURES) else BROKEN)
        try:
            if resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                if 400 <= resp.status_code < 500:
                    self.metrics.errors.labels(str(resp.status_code)).inc()
                    return Response(
                        _with_id(content, body.get("rid")),
                        resp.status_code,
                        _retry_after(resp.status_code),
                        media_type="application/json",
                    )
                if draining_refusal(resp.status_code, content):  # shutting down: out now, not counted
                    self.health.mark_failed(d, "draining: it refused a request (shutting down)")
                    return Retry(resp.status_code, content, DRAINING)
                return Retry(resp.status_code, content, REFUSED)
            if not body.get("stream"):
                return resp, None, b""
            first = b""
            chunks = resp.aiter_raw()
            async for chunk in chunks:
                first += chunk
                if b"\n\n" in first:
                    break
            err = first_event_error(first.split(b"\n\n", 1)[0])
            if err is not None:
                # failed before producing anything (e.g. the KV transfer): another pair may do
                await resp.aclose()
                return Retry(502, err, REFUSED)
            return resp, chunks, first
        except httpx.HTTPError as e:
            await resp.aclose()
            self.health.connection_failed(d, e)
            return Retry(502, b"", BROKEN)
        except BaseException:
            await resp.aclose()
            raise

    async def _prefill(
        self, path: str, body: dict, p: Worker, parent=None, trace_in: Optional[dict] = None
    ) -> tuple[int, bytes]:
        """The prefill leg; (0, b"") when the prefill engine could not be reached."""
        p.inflight += 1
        self.metrics.worker_requests_of(p.url, p.role).inc()
        span = self.tracing.start("router.prefill_leg", parent=parent, attributes={"dsv4.prefill": p.url})
        error = None
        try:
            r = await self.up.prefill.post(f"{p.url}{path}", json=body, headers=self.tracing.headers(span, trace_in))
            error = f"answered {r.status_code}" if r.status_code >= 400 else None
            return r.status_code, r.content
        except httpx.HTTPError as e:
            error = type(e).__name__
            self.health.connection_failed(p, e)
            return (0, b"") if isinstance(e, CONNECTION_FAILURES) else (502, b"")
        except BaseException:
            error = "cancelled"
            raise
        finally:
            p.inflight -= 1
            tracing.end(span, error=error)

    async def _relay(
        self, path: str, st: Resume, leg: "Leg", key: Optional[str], outlet: Optional[Outlet] = None
    ) -> AsyncIterator[bytes]:
        """The client's stream, across every engine the request visits. Whole events only: a
        stream that breaks mid-event leaves no half event with the client. With an `outlet`,
        plain token events go straight from the engine's connection to the client while this
        waits (relay.py); everything else passes here."""
        st.leg = leg
        while True:
            pending, chunks, reason = leg.first, leg.chunks, None
            watched = self._watch_stream(leg)
            direct = _direct(st, outlet, watched) if outlet is not None and hasattr(leg.resp, "sink") else None
            try:
                while reason is None:
                    whole, pending = split_events(pending)
                    if whole:
                        out, what = st.filter(whole)
                        if out:
                            yield out
                        if what == "done":
                            return
                        reason = what
                        if reason is not None:
                            break
                    if direct is not None and not pending:
                        leg.resp.sink = direct
                    try:
                        chunk = await anext(chunks, None)
                    finally:
                        if direct is not None:
                            leg.resp.sink = None
                    if chunk is None:
                        reason = TRUNCATED
                        break
                    watched.event(time.monotonic())
                    pending += chunk
            except httpx.HTTPError as e:  # the decode engine died or the connection broke
                if watched.frozen is None:
                    self.health.connection_failed(leg.d, e)
                reason = STALLED if watched.frozen is not None else BROKEN
            finally:
                self.stalls.unwatch(watched)
            failed = frozenset({leg.d.url})
            await leg.close()
            st.leg = None
            if st.finished:  # everything was said but the end: say it
                if st.parent is None:
                    yield sse("[DONE]")
                return
            if st.splittable and st.started:  # an engine continues one sequence: one request per choice
                async for out in self._split(path, st, key, reason, failed):
                    yield out
                return
            placed = await self._place(path, st, key, reason, failed)
            if not isinstance(placed, Leg):
                yield self._failed_events(st, placed)
                return
            leg = st.leg = placed

    def _watch_stream(self, leg: "Leg"):
        """The stall watch on a relayed stream: a frozen engine's read raises at once (the
        engine would never close the connection itself)."""

        def frozen(w: Worker) -> None:
            interrupt = getattr(leg.resp, "interrupt", None)  # the stream client's answers (http engines)
            if interrupt is not None:
                interrupt(httpx.ReadError(f"{w.url} is frozen: no event, and no answer to /ready"))

        return self.stalls.watch((leg.d,), frozen)

    @staticmethod
    def _failed_events(st: Resume, placed: Response) -> bytes:
        st.failed = True
        msg = json.loads(placed.body) if placed.body else {}
        message = msg.get("error", {}).get("message") if isinstance(msg, dict) else None
        return error_events(message or "the decode engine's stream broke off", 503)

    async def _split(
        self, path: str, st: Resume, key: Optional[str], reason: str, failed: frozenset
    ) -> AsyncIterator[bytes]:
        """A stream of n > 1 choices broke: each unfinished choice goes on as its own n = 1
        request (see migration.py), their events merged into the client's stream as they come;
        then one usage chunk for all of them and [DONE]. The first child that gives up ends the
        stream with its one error."""
        kids = [st.child(j) for j in range(st.n) if j not in st.choice_done]
        q: asyncio.Queue = asyncio.Queue()

        async def run(kid: Resume) -> None:
            try:
                placed = await self._place(path, kid, key, reason, failed)
                if not isinstance(placed, Leg):
                    await q.put(self._failed_events(kid, placed))
                    return
                gen = self._relay(path, kid, placed, key)
                try:
                    async for out in gen:
                        await q.put(out)
                finally:
                    await gen.aclose()
            finally:
                await q.put(None)

        tasks = [asyncio.create_task(run(k)) for k in kids]
        try:
            left = len(tasks)
            while left:
                out = await q.get()
                if out is None:
                    left -= 1
                    continue
                yield out
                if any(k.failed for k in kids):
                    st.failed = True
                    return
            st.resends = max(k.resends for k in kids) if kids else st.resends
            usage = st.usage()
            if usage is not None:
                yield sse(usage)
            yield sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for k in kids:
                if k.leg is not None:
                    await k.leg.close()
                    k.leg = None

    async def _stream_closed(self, st: Resume, slot: Slot) -> None:
        slot.release()
        self._log_moves(st)
        for r in (st, *st.kids):
            if r.leg is not None:
                await r.leg.close()  # a client that left closes the decode stream: decode aborts


def _direct(st: Resume, outlet: Outlet, watched) -> Callable[[bytes], bool]:
    """The engine connection's sink for a relayed stream: a chunk that is one plain token event
    is written to the client at once; anything else is left to the relay loop."""

    plain, pass_on, now = st.plain_event, outlet.pass_on, time.monotonic

    def sink(chunk: bytes) -> bool:
        if not pass_on(chunk, plain):
            return False
        watched.event(now())
        return True

    return sink


@dataclass
class Leg:
    """One engine (pair) on its way with a request: the decode's response and its prefill leg."""

    d: Worker
    prefill: Optional[asyncio.Task]
    resp: httpx.Response
    chunks: Optional[AsyncIterator[bytes]]
    first: bytes
    closed: bool = False
    span: object = None  # its router.attempt span (tracing on)
    tokens: int = 0  # counted in d.load_tokens while the stream runs

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        tracing.end(self.span)
        self.d.inflight -= 1
        self.d.load_tokens -= self.tokens
        self.tokens = 0
        if self.prefill is not None and not self.prefill.done():
            self.prefill.cancel()
        await self.resp.aclose()


class _Load:
    """A request's prompt tokens counted in its workers' `load_tokens` from the moment it is
    sent: on prefill until its leg ends, on decode (or mono) until the stream ends."""

    def __init__(self, n: int, p: Optional[Worker], d: Worker):
        self.n, self.p, self.d = n, p, d
        for w in (p, d):
            if w is not None:
                w.load_tokens += n

    def release(self) -> None:
        for w in (self.p, self.d):
            if w is not None:
                w.load_tokens -= self.n
        self.n = 0

    def hand_to(self, result) -> None:
        """The attempt's outcome: a Leg carries the decode's share; the prefill's ends with its leg."""
        if not isinstance(result, Leg) or not self.n:
            return self.release()
        result.tokens = self.n
        p, n = self.p, self.n
        if p is not None:
            if result.prefill is None or result.prefill.done():
                p.load_tokens -= n
            else:
                result.prefill.add_done_callback(lambda _: setattr(p, "load_tokens", p.load_tokens - n))
        self.n = 0


def _retry_after(status: int) -> Optional[dict]:
    """An engine's 429 (its --max-queued-requests) reaches the client with a Retry-After, as the
    router's own 429s do."""
    return {"Retry-After": "1"} if status == 429 else None


def _with_id(content: bytes, rid: Optional[str]) -> bytes:
    """A JSON answer under the client's response id (a re-sent request ran under its own)."""
    if rid is None:
        return content
    try:
        obj = json.loads(content)
    except ValueError:
        return content
    if isinstance(obj, dict) and "id" in obj and obj["id"] != rid:
        obj["id"] = rid
        return json.dumps(obj).encode()
    return content
