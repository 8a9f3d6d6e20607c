"""The engine core process: scheduler, model, KV pool and PD controllers, away from HTTP.

`dsv4 serve` (the HTTP process, `engine_client.EngineClient`) starts this module as a child
with one end of a socket pair. The HTTP process does HTTP, validation, tokenising and chat
templates; this process runs the engine loop (its own thread, as before), the prefill's
bootstrap server (decode engines reach it directly), and a reader on the channel that turns
messages into `Engine.submit` / `abort` / `call` and answers read-only questions (/v1/loads,
/metrics, stacks, loop state) itself, as the HTTP thread did when both shared a process.

Outputs: each request's sink appends to a list on the engine thread; after every step the list
goes out as one message. The core never decides to exit on a signal: SIGTERM/SIGINT belong to
the HTTP process, which drains and then says SHUTDOWN. When the channel closes (the HTTP
process is gone, even by SIGKILL) the core exits at once, freeing the bootstrap port.

Profiling: DSV4_CORE_PROFILE=<file> runs the engine thread under cProfile and writes the stats
to <file> at shutdown (see bench/suites/serve_bench.py --profile-core).
"""

from __future__ import annotations

from dsv4_wire import switches

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Optional

from dsv4_serve import core_messages as m

if TYPE_CHECKING:
    from dsv4_engine.engine import Engine
    from dsv4_serve.server_args import ServerArgs

log = logging.getLogger("dsv4.core")


class CoreServer:
    """The channel end inside the core: requests in, outputs and replies out."""

    def __init__(self, engine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()
        self.seqs: dict[int, Any] = {}  # channel key -> Sequence, until its final output is sent
        self._outputs: deque = deque()  # (key, RequestOutput), appended by sinks on any thread
        engine.after_step = self.flush
        self.bytes_in = self.bytes_out = self.msgs_in = self.msgs_out = 0

    def send(self, msg: m.Message) -> None:
        data = m.dumps(msg)
        with self._send_lock:
            self.conn.send_bytes(data)
            self.bytes_out += len(data)
            self.msgs_out += 1

    def flush(self) -> None:
        """Send every output collected since the last flush as one message (engine thread)."""
        if not self._outputs:
            return
        rows = []
        while self._outputs:
            key, out = self._outputs.popleft()
            rows.append(m.output_row(key, out))
            if out.finished:
                self.seqs.pop(key, None)
        try:
            self.send(m.Out(rows))
        except OSError:  # the HTTP process is gone: nothing left to serve
            os._exit(0)

    # ---- requests in -------------------------------------------------------------------------

    def serve(self) -> None:
        """Read the channel until it closes or SHUTDOWN comes (main thread)."""
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                log.warning("the HTTP process closed the channel: exiting")
                os._exit(0)
            self.bytes_in += len(data)
            self.msgs_in += 1
            try:
                msg = m.loads(data)
                if self._handle(msg):
                    return
            except Exception:  # a malformed message must not end the core
                log.error("engine core could not handle a message of %d bytes:\n%s", len(data), traceback.format_exc())

    def _handle(self, msg: m.Message) -> bool:
        """One message from the HTTP process; True once it asked the core to shut down."""
        if isinstance(msg, m.Add):
            self._add(msg)
        elif isinstance(msg, m.Abort):
            if msg.key is not None:
                seq = self.seqs.get(msg.key)
                if seq is not None:
                    self.engine.abort(seq=seq, reason=msg.reason)
            else:
                self.engine.abort(msg.rid, reason=msg.reason, all_=msg.all)
        elif isinstance(msg, m.Finish):
            seq = self.seqs.get(msg.key)
            if seq is not None:
                engine = self.engine
                engine.call(lambda: engine.finish(seq, "stop"))  # no-op if it ended meanwhile
        elif isinstance(msg, m.Call):
            if msg.name == "shutdown":
                self._shutdown()
                self.send(m.Reply(msg.call_id, True, None))
                return True
            try:
                handler = RPCS.get(msg.name)
                if handler is None:
                    raise ValueError(f"unknown engine call {msg.name!r}")
                value = handler(self, msg.arg)
            except Exception as e:
                self.send(m.reply_error(msg.call_id, e))
            else:
                try:
                    self.send(m.Reply(msg.call_id, True, value))
                except ValueError:  # marshal refused a value (a numpy scalar, ...): its plain form
                    self.send(m.Reply(msg.call_id, True, m.plain(value)))
        else:
            raise ValueError(f"the core does not take {type(msg).__name__} messages")
        return False

    def _add(self, msg: m.Add) -> None:
        from dsv4_engine.sequence import Sequence

        seq = Sequence(
            rid=msg.rid,
            prompt_ids=msg.prompt_ids,
            params=m.params_of(msg.params),
            arrival=msg.arrival,
            share_prefix_of=msg.share_prefix_of,
            output_ids=list(msg.output_ids),
            plain_prompt_ids=msg.plain_prompt_ids,
        )
        if msg.pd is not None:
            from dsv4_engine.pd import PDRequestInfo

            seq.pd = PDRequestInfo(*msg.pd)
        seq.prefill_only = msg.prefill_only
        outputs = self._outputs
        seq.sink = lambda out, k=msg.key: outputs.append((k, out))
        self.seqs[msg.key] = seq
        self.engine.submit(seq)

    # ---- the calls the HTTP process makes (RPCS, by name) ------------------------------------

    def _state(self, _arg: Any) -> dict:
        engine = self.engine
        return {
            "alive": engine.alive,
            "failed": engine.failed,
            "stalled": time.monotonic() - engine.last_iteration,
            "stall_allowance": engine.step_clock.allowance(),
            "draining": engine.draining,
            "seqs": len(engine.seqs),
        }

    def _loads(self, _arg: Any) -> dict:
        for _ in range(5):  # read without stopping the engine thread; a resized queue retries
            try:
                return self.engine.loads()
            except RuntimeError:
                time.sleep(0.001)
        return self.engine.loads()

    def _metrics(self, _arg: Any) -> str:
        return self.engine.metrics.render()

    def _stacks(self, _arg: Any) -> Any:
        from dsv4_serve.admin import thread_stacks

        return thread_stacks()

    def _drain(self, _arg: Any) -> None:
        self.engine.draining = True

    def _channel(self, _arg: Any) -> dict:
        return {
            "msgs_in": self.msgs_in,
            "msgs_out": self.msgs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "rss_bytes": _rss(),
        }

    def _pd_abort(self, arg: Any) -> None:
        room, reason = arg
        engine = self.engine
        engine.call(lambda: engine.pd.abort_room(room, reason))

    def _kv_snapshot(self, _arg: Any) -> dict:
        """What the prefix cache holds, for a new /v1/kv_events subscriber."""
        engine = self.engine
        cache = engine.prefix_cache
        page = engine.pool.page_size
        return {
            **engine.kv_journal.snapshot(),
            "instance": engine.kv_journal.instance,
            "page_size": page,
            "boundary_tokens": cache.boundary if cache is not None else page,
        }

    def _kv_events(self, seq: Any) -> Optional[list]:
        """The events messages after batch `seq` (None: resync with a new snapshot)."""
        return self.engine.kv_journal.since(int(seq))

    def _session_delete(self, arg: Any) -> Optional[bool]:
        """End session (tenant, id) on the engine thread; whether it was known (None: no cache)."""
        import concurrent.futures

        cache = self.engine.prefix_cache
        if cache is None or cache.pins is None:
            return None
        key = tuple(arg)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.engine.call(lambda: done.set_result(cache.pins.delete(key)))
        return done.result(timeout=10)

    def _faults_arm(self, arg: Any) -> Any:
        fault, count, params = arg
        self.engine.pd.faults.arm(fault, count, **params)
        return self.engine.pd.faults.snapshot()

    def _faults_clear(self, _arg: Any) -> None:
        self.engine.pd.faults.clear()

    def _faults_snapshot(self, _arg: Any) -> Any:
        return self.engine.pd.faults.snapshot()

    def _expert_loads(self, _arg: Any) -> Optional[dict]:
        placer = self.engine.runner.eplb
        return placer.table() if placer is not None else None

    def _eplb_rebalance(self, arg: Any) -> Any:
        """Rebalance the experts between two steps (the engine thread), from the loads table given
        or the live counters; (report, None) or (None, why it cannot)."""
        import concurrent.futures

        from dsv4_engine.parallel.eplb_apply import loads_from_table, rebalance

        placer = self.engine.runner.eplb
        if placer is None:
            return None, "this model has no learned-routing MoE layers to balance"
        try:
            loads = loads_from_table(arg) if arg else None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return None, f"loads: {e}"
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result((rebalance(placer, self.engine.tp, loads), None))
            except ValueError as e:
                done.set_result((None, str(e)))
            except BaseException as e:  # a failed group fails the engine; the caller hears why
                done.set_exception(e)

        self.engine.call(run)
        return done.result(timeout=120)

    def _shutdown(self) -> None:
        self.engine.stop()
        if self.engine.pd is not None:
            self.engine.pd.close()


# The engine core's RPCs by name ("shutdown" is Call's own: it ends the channel's loop).
RPCS: dict[str, Callable[[CoreServer, Any], Any]] = {
    "state": CoreServer._state,
    "loads": CoreServer._loads,
    "metrics": CoreServer._metrics,
    "stacks": CoreServer._stacks,
    "drain": CoreServer._drain,
    "channel": CoreServer._channel,
    "pd_abort": CoreServer._pd_abort,
    "kv_snapshot": CoreServer._kv_snapshot,
    "kv_events": CoreServer._kv_events,
    "session_delete": CoreServer._session_delete,
    "faults_arm": CoreServer._faults_arm,
    "faults_clear": CoreServer._faults_clear,
    "faults_snapshot": CoreServer._faults_snapshot,
    "expert_loads": CoreServer._expert_loads,
    "eplb_rebalance": CoreServer._eplb_rebalance,
}


def _refusal(args) -> Optional[str]:
    """Why this checkpoint cannot be served as `args` ask, in one line naming the model, before
    any weight is read: limits that serve nothing, a kernel backend this device cannot run, a
    quantization it cannot load, states that do not fit --page-size, a --tp-size it cannot split into. Checked here, not in the HTTP process: both need torch."""
    from dsv4_engine.engine import args_refusal, serving_refusal
    from dsv4_engine.quant import UnsupportedQuantization, checkpoint_scheme

    flags = args_refusal(args)
    if flags:
        return flags
    try:
        checkpoint_scheme(args.model)
    except UnsupportedQuantization as e:
        return f"{args.model}: {e}"
    refusal = serving_refusal(args.model, args.role, args.page_size, args.tp_size)
    if refusal is None and args.dp_size > 1:  # with the server's options too (--transfer-checksum)
        from dsv4_engine.engine import dp_refusal_for

        refusal = dp_refusal_for(args)
    if refusal is None and args.ep_redundant_experts:
        import json
        from pathlib import Path

        from dsv4_engine.parallel.eplb import ep_checkpoint_refusal

        refusal = ep_checkpoint_refusal(
            json.loads((Path(args.model) / "config.json").read_text()), args.ep_redundant_experts
        )
    if refusal is None:  # weights that cannot fit the device: said before they are read
        from dsv4_engine.start_fit import memory_refusal

        refusal = memory_refusal(args)
    if refusal is None and args.speculative_algorithm is not None:
        from dsv4_engine.spec_decode.build import speculation_refusal

        refusal = speculation_refusal(args)
    return f"{args.model}: {refusal}" if refusal else None


def _set_cpu_threads(args) -> None:
    import torch

    from dsv4_engine.model_runner import default_device

    on_cpu = (torch.device(args.device) if args.device else default_device()).type == "cpu"
    n = cpu_threads(len(os.sched_getaffinity(0)), dict(os.environ)) if on_cpu and args.tp_size == 1 else None
    if n is not None:
        torch.set_num_threads(n)
        log.info("torch threads: %d (one CPU left to the HTTP process; OMP_NUM_THREADS overrides)", n)


def cpu_threads(cpus: int, env: dict) -> Optional[int]:
    """torch's intra-op threads for an engine core on a CPU: every CPU but one, which the HTTP
    process needs (tokenising, detokenising, streaming). Given every CPU, torch's OpenMP threads
    and the HTTP process take turns on the same cores, and every parallel op waits for its
    slowest thread: on this 2-core machine, 32 streams of v4-tiny ran at 623 tok/s with 2 threads
    and 1,592 with 1 (mla512: 499 and 649). None (torch's own choice) when the user set
    OMP_NUM_THREADS, or on a single CPU."""
    if env.get("OMP_NUM_THREADS") or cpus <= 1:
        return None
    return cpus - 1


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def make_engine(args: ServerArgs) -> Engine:
    """The engine itself, built here in the core process (the HTTP process never imports torch
    nor this function's imports)."""
    from dsv4_engine.engine import Engine

    engine = Engine(args.engine_args())
    if args.role != "mono":
        from dsv4_engine.pd import attach_role

        attach_role(engine, args)
    return engine


def _start_bootstrap(engine, args) -> None:
    """The prefill's bootstrap server, on a thread of the core (decode engines call it)."""
    import asyncio

    import uvicorn

    from dsv4_serve.pd_routes import build_bootstrap_app
    from dsv4_serve.uvicorn_server import UvicornServer

    from dsv4_wire.slow_clients import bounded

    app, limits = bounded(
        build_bootstrap_app(engine, args), getattr(args, "client_timeout", 30.0), getattr(args, "max_connections", 4096)
    )
    server = UvicornServer(uvicorn.Config(app, host=args.host, port=args.bootstrap_port, log_level="warning", **limits))
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as e:  # uvicorn exits on a busy port
            failed.append(e)

    t = threading.Thread(target=run, name="dsv4-bootstrap", daemon=True)
    t.start()
    while not server.started:
        if not t.is_alive():
            raise RuntimeError(f"the bootstrap server could not listen on {args.host}:{args.bootstrap_port}")
        time.sleep(0.01)


def _profiled(run: Callable[[], None], path: str) -> Callable[[], None]:
    """The engine loop under cProfile on the thread's CPU clock (idle waits cost nothing), and
    at its end the CPU seconds every thread of the process spent while the loop ran
    (`path`.threads.json: the loop vs torch's worker threads vs the channel reader)."""

    def wrapped() -> None:
        import cProfile
        import json

        before = _thread_cpu()
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            run()
        finally:
            prof.disable()
            prof.dump_stats(path)
            after = _thread_cpu()
            with open(path + ".threads.json", "w") as f:
                json.dump({k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}, f, indent=1)

    return wrapped


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "channel reader (main thread)"
    tick = os.sysconf("SC_CLK_TCK")
    cpu: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields_ = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), NATIVE_THREADS)
        cpu[name] = cpu.get(name, 0.0) + (int(fields_[11]) + int(fields_[12])) / tick
    return cpu


NATIVE_THREADS = "native (torch/OpenMP workers, ...)"


def main(argv: list[str]) -> None:
    # Signals are the HTTP process's: it drains, then tells the core to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    fd = int(argv[0])
    os.set_inheritable(fd, False)  # the channel must close when this process dies, not live on in children
    conn = Connection(fd)
    # The engine's arguments only: the core imports none of the HTTP process's modules (fastapi,
    # the app, the OpenAI handlers); make_engine imports torch and the engine.
    from dsv4_serve.server_args import ServerArgs

    try:
        init = m.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the parent gave up before saying what to serve (a bad flag)
        sys.exit(0)
    assert isinstance(init, m.Init)
    args = ServerArgs(**init.args)
    try:
        refusal = _refusal(args)
        if refusal:  # no traceback, no log: the HTTP process prints this one line as `dsv4 serve`'s error
            conn.send_bytes(m.dumps(m.Refused(refusal)))
            sys.exit(2)
        _set_cpu_threads(args)  # after the refusal: a refusal is the only line printed
        engine = make_engine(args)
        if args.role == "prefill":
            _start_bootstrap(engine, args)
    except Exception as e:
        log.error("engine start failed:\n%s", traceback.format_exc())
        conn.send_bytes(m.dumps(m.Fatal(f"{type(e).__name__}: {e}")))
        sys.exit(1)
    from dsv4_engine.pd import BOOT_ID

    engine.detokenize = False  # text and stop strings are the HTTP process's (dsv4_serve.detokenize)
    engine.exit_on_device_failure = True  # a dead device takes the process down: its requests migrate
    # /v1/kv_events: what the cache gains and loses, from the start. An engine without a prefix
    # cache (decode, --disable-prefix-cache) publishes its journal too: it holds nothing.
    from dsv4_engine.kv_journal import KVJournal

    engine.kv_journal = KVJournal(BOOT_ID)
    if engine.prefix_cache is not None:
        engine.prefix_cache.journal = engine.kv_journal
        if engine.prefix_cache.host is not None:
            engine.prefix_cache.host.on_evict = lambda h: engine.kv_journal.evicted("host", h)
            disk = engine.prefix_cache.host.disk
            if disk is not None:
                engine.prefix_cache.host.on_spill = lambda h: engine.kv_journal.stored("disk", h)
                disk.on_evict = lambda h: engine.kv_journal.evicted("disk", h)
    core = CoreServer(engine, conn)
    profile = switches.read("DSV4_CORE_PROFILE")
    if profile:
        engine.run = _profiled(engine.run, profile)
    engine.start()
    core.send(
        m.Hello(
            {
                "pid": os.getpid(),
                "boot_id": BOOT_ID,
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.cfg.vocab_size,
                "num_pages": engine.pool.num_pages,
                "page_size": engine.pool.page_size,
                "kernel_backend": engine.runner.kernel_backend,
                "kernel_summary": engine.runner.kernel_summary,
            }
        )
    )
    core.serve()
    logging.shutdown()
    os._exit(0)  # threads of NIXL, uvicorn or torch must not hold the exit up


if __name__ == "__main__":
    main(sys.argv[1:])
