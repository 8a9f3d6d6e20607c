"""The HTTP process's handle on the engine core process (`engine_core`).

`EngineClient.start` runs the core as a child (`python -m dsv4_serve.engine_core FD`) joined
by a socket pair, sends it the server's arguments and waits for its HELLO (model loaded, KV
pool sized) or its one-line FATAL. A reader thread then receives outputs (one message per
engine step) and RPC replies; outputs reach each request's asyncio queue through one
`call_soon_threadsafe` per message. When the channel closes — the core died, however — the
client is dead at once: /health fails, every request in flight ends with a 500 error, and new
ones are refused the same way, so nothing hangs on an engine that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, AsyncIterator, Callable, Optional

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.request_output import RequestOutput
from dsv4_serve import core_messages as m
from dsv4_serve.core_spawn import spawn_core
from dsv4_serve.detokenize import OutputProcessor

log = logging.getLogger("dsv4.client")
CORE_ANSWER_TIMEOUT = 10.0  # seconds the core's reader may take to answer a health or admin question


def call_soon(loop: Optional[asyncio.AbstractEventLoop], fn: Callable, *args) -> None:
    """fn(*args) on the loop's thread, from the channel reader: nothing when there is no loop
    yet, or when it has closed (the server is shutting down; checking is_closed first would
    still race with the close)."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


class EngineStartError(RuntimeError):
    """The core could not start (bad model, busy bootstrap port, ...): one line saying why."""


class EngineRefused(EngineStartError):
    """The checkpoint cannot be served as asked (quantization, --page-size, --tp-size): one line,
    said before any weight was read; `dsv4 serve` prints it as a usage error."""


class EngineGone(RuntimeError):
    """The core process is gone: RPCs raise this."""


@dataclass
class EngineRequest:
    """One request as the HTTP process hands it over: ids, sampling, PD target."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    pd: Optional[tuple] = None  # (bootstrap_host, bootstrap_port, room) on prefill/decode engines
    prefill_only: bool = False
    arrival: float = field(default_factory=time.monotonic)
    share_prefix_of: Optional[str] = None  # n > 1: the rid of the request's first choice
    # A migrated request's answer so far (the router's continuation): the engine computes the
    # prompt and these, and generates what follows, as if it had produced them itself.
    output_ids: list[int] = field(default_factory=list)
    # PD decode, chat: the prompt as prefill tokenizes it on its own, when this engine spliced
    # remembered answers into prompt_ids (dsv4_serve.chat.answer_memo): decode then sends prefill
    # its own ids in the registration.
    plain_prompt_ids: Optional[list[int]] = None


def _error_output(rid: str, message: str, code: int, prompt_tokens: int = 0) -> RequestOutput:
    return RequestOutput(
        rid, [], "", True, "error" if code >= 500 and code != 503 else "abort", message, code, prompt_tokens, 0
    )


class _RemoteFaults:
    """The core's fault injector, seen from the HTTP process (pd_routes arms it)."""

    def __init__(self, client: "EngineClient"):
        self.client = client

    def arm(self, name: str, count: int, **params: Any) -> None:
        self.client.ask_sync("faults_arm", (name, count, params))

    def clear(self) -> None:
        self.client.ask_sync("faults_clear")

    def snapshot(self) -> dict:
        return self.client.ask_sync("faults_snapshot")


class _RemotePD:
    """What pd_routes needs of the core's PD controller: peer aborts and fault injection."""

    def __init__(self, client: "EngineClient"):
        self.client = client
        self.faults = _RemoteFaults(client)

    def abort_room(self, room: int, reason: str) -> None:
        self.client.tell("pd_abort", (room, reason))


class EngineClient:
    def __init__(self, proc: subprocess.Popen, conn: Connection, hello: dict):
        self.proc = proc
        self.conn = conn
        self.info = hello
        self.pid: int = hello["pid"]
        self.max_model_len: int = hello["max_model_len"]
        self.vocab_size: int = hello["vocab_size"]
        self.pd = _RemotePD(self)
        self._send_lock = threading.Lock()
        self._keys = itertools.count(1)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._reqs: dict[int, tuple[asyncio.Queue, str]] = {}  # touched on the event loop only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.dead: Optional[str] = None  # why the core is gone, once it is
        self.stopping = False  # shutdown() asked the core to stop: its exit is expected
        self.on_gone: Optional[Callable[[], None]] = None  # called once, on the reader thread
        self._reader = threading.Thread(target=self._read, name="dsv4-engine-channel", daemon=True)
        self._reader.start()

    # ---- start and stop ------------------------------------------------------------------------

    @classmethod
    def start(cls, args, spawned: Optional[tuple[subprocess.Popen, Connection]] = None) -> "EngineClient":
        """Start the core with `args` (a ServerArgs) — or hand them to one `spawn_core` started
        earlier — and wait until it has loaded the model."""
        proc, conn = spawned or spawn_core()
        conn.send_bytes(m.dumps(m.Init(dataclasses.asdict(args))))
        try:
            answer = m.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc.wait()
            raise EngineStartError(f"the engine process exited during start (exit code {proc.returncode})") from None
        if isinstance(answer, (m.Fatal, m.Refused)):
            proc.wait()
            raise (EngineRefused if isinstance(answer, m.Refused) else EngineStartError)(answer.message)
        return cls(proc, conn, answer.facts)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the core's loop and PD controllers, then make sure the process is gone."""
        self.stopping = True
        if self.dead is None:
            try:
                self.ask_sync("shutdown", timeout=timeout)
            except Exception as e:
                log.warning("engine core did not stop cleanly: %s", e)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

    @property
    def alive(self) -> bool:
        return self.dead is None

    # ---- the channel -----------------------------------------------------------------------------

    def _send(self, msg: m.Message) -> None:
        data = m.dumps(msg)
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except OSError as e:
            # a send can meet the broken pipe before the reader meets the end of the channel:
            # say what the reader would say when the process has in fact exited
            self._gone(self._exit_reason() or f"engine process unreachable: {e}")
            raise EngineGone(self.dead) from None

    def _read(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                break
            msg = m.loads(data)
            if isinstance(msg, m.Out):
                call_soon(self._loop, self._deliver, msg.rows)
            elif isinstance(msg, m.Reply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.ok:
                        fut.set_result(msg.value)
                    else:
                        fut.set_exception(_remote(msg.value))
        self._gone(self._exit_reason() or "engine process exited")

    def _exit_reason(self) -> Optional[str]:
        """'engine process exited (exit code N)' once the core has exited (waiting up to 1 s for
        it: its end of the channel closes a moment before it is gone), else None."""
        code = self.proc.poll()
        if code is None:
            try:
                code = self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                return None
        return f"engine process exited (exit code {code})"

    def _gone(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        if not self.stopping:
            log.error("%s: failing every request in flight", why)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineGone(why))
        self._calls.clear()
        call_soon(self._loop, self._fail_all)
        if self.on_gone is not None:
            self.on_gone()

    def _deliver(self, rows: list) -> None:
        for row in rows:
            entry = self._reqs.get(row[0])
            if entry is not None:
                q, rid = entry
                q.put_nowait(m.output_of(row, rid)[1])

    def _fail_all(self) -> None:
        for q, rid in self._reqs.values():
            q.put_nowait(_error_output(rid, f"request failed: {self.dead}", 500))

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self, req: EngineRequest, closed: bool = False, processor: Optional[OutputProcessor] = None
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request as the core produces them, turned into text by `processor`
        (which also judges stop strings); leaving early aborts it."""
        if closed:  # prepared while the drain ran out: never reaches the engine
            yield _error_output(req.rid, "request aborted: server shutting down", 503, len(req.prompt_ids))
            return
        if self.dead is not None:
            yield _error_output(req.rid, f"request failed: {self.dead}", 500, len(req.prompt_ids))
            return
        self._loop = self._loop or asyncio.get_running_loop()
        key = next(self._keys)
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._reqs[key] = (q, req.rid)
        finished = False
        try:
            try:
                self._send(
                    m.add_msg(
                        key,
                        req.rid,
                        req.prompt_ids,
                        req.params,
                        req.pd,
                        req.prefill_only,
                        req.arrival,
                        req.share_prefix_of,
                        req.output_ids,
                        req.plain_prompt_ids,
                    )
                )
            except EngineGone:
                finished = True
                yield _error_output(req.rid, f"request failed: {self.dead}", 500, len(req.prompt_ids))
                return
            while True:
                out = await q.get()
                if processor is not None:
                    out = processor.process(out)
                    if processor.stopped and out.finished:  # a stop string: the core runs on until told
                        self._send(m.Finish(key))
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._reqs.pop(key, None)
            if not finished and self.dead is None:  # the client went away: free its pages
                try:
                    self._send(m.Abort(key, None, "client disconnected", False))
                except EngineGone:
                    pass

    def abort(self, rid: Optional[str] = None, reason: str = "aborted", all_: bool = False) -> None:
        self._send(m.Abort(None, rid, reason, all_))

    # ---- calls -------------------------------------------------------------------------------------

    def _call(self, name: str, arg: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            fut.set_exception(EngineGone(self.dead))
            return fut
        call_id = next(self._keys)
        self._calls[call_id] = fut
        try:
            self._send(m.Call(call_id, name, arg))
        except EngineGone as e:
            self._calls.pop(call_id, None)
            if not fut.done():
                fut.set_exception(e)
        return fut

    async def ask(self, name: str, arg: Any = None, timeout: float = 30.0) -> Any:
        """Ask the core (loads, metrics, stacks, state, drain, ...) without blocking the event loop."""
        return await asyncio.wait_for(asyncio.wrap_future(self._call(name, arg)), timeout)

    def ask_sync(self, name: str, arg: Any = None, timeout: float = 30.0) -> Any:
        """The same, blocking (admin paths that are synchronous by contract, shutdown)."""
        return self._call(name, arg).result(timeout)

    def tell(self, name: str, arg: Any = None) -> None:
        """Ask without waiting for the answer (peer aborts)."""
        self._call(name, arg).add_done_callback(_log_failure)

    def call(self, fn) -> None:
        """pd_routes' `engine.call(fn)`: here fn only talks to the core through this client
        (`self.pd`), so it runs in place."""
        fn()


def _log_failure(fut: concurrent.futures.Future) -> None:
    if fut.exception() is not None:
        log.warning("engine call failed: %s", fut.exception())


def _remote(value: Any) -> BaseException:
    try:
        m.raise_remote(value)
    except BaseException as e:
        return e
    return RuntimeError("unreachable")


def rss_bytes(pid: Optional[int] = None) -> int:
    import psutil

    return psutil.Process(pid or os.getpid()).memory_info().rss
