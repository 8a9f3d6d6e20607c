"""`dsv4 serve --nnodes N --node-rank R` with R > 0: a worker node. It serves no API (node 0 does);
it runs its node agent (dsv4_engine.parallel.node_agent) behind a small HTTP surface that probes,
the operator's watchdog and its evidence capture read:

  GET /health          200 while the agent runs and the group has not failed, else 503
  GET /ready           200 once node 0 said every rank of the engine loaded (the group serves)
  GET /metrics         dsv4:nnodes, dsv4:node_rank, dsv4:node_group_ready, dsv4:node_ranks_running,
                       dsv4:node_rank_beat_age_seconds (Prometheus text)
  GET /v1/loads        the agent's status: its ranks (pid, running, heartbeat age), joined, failed
  GET /debug/stacks    the agent's threads and every one of its ranks' (faulthandler, SIGUSR1)

/v1/loads and /debug/stacks follow the admin rule of every dsv4 surface (the admin token when set,
else loopback clients). Torch-free, like the agent: the ranks are its child processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from dsv4_engine.parallel.layout import NodeLayout
from dsv4_engine.parallel.node_agent import NodeAgent
from dsv4_wire import Paths, admin_refusal
from dsv4_wire.metrics import metric_name


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def node_metrics(status: dict, labels: str) -> str:
    """Pure: the agent's status as Prometheus text."""
    ages = [r["beat_age_seconds"] for r in status["ranks"] if r.get("beat_age_seconds") is not None]
    values = {
        "nnodes": status["nnodes"],
        "node_rank": status["node_rank"],
        "node_group_ready": 1 if status["group_ready"] else 0,
        "node_ranks_running": sum(1 for r in status["ranks"] if r["running"]),
        "node_rank_beat_age_seconds": max(ages) if ages else 0.0,
    }
    return "".join(f"{metric_name(k)}{labels} {float(v)}\n" for k, v in values.items())


def make_handler(agent: NodeAgent, admin_token: Optional[str], role: str, model: str):
    labels = f'{{role="{role}",model_name="{model}"}}'

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # probes every few seconds: not worth a log line
            pass

        def _send(self, status: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _json(self, status: int, doc: dict) -> None:
            self._send(status, json.dumps(doc))

        def _admin(self) -> bool:
            refusal = admin_refusal(dict(self.headers.items()), admin_token, self.client_address[0])
            if refusal is None:
                return True
            status, message = refusal
            kind = "authentication_error" if status == 401 else "permission_error"
            self._json(status, {"error": {"message": message, "type": kind, "code": status}})
            return False

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?", 1)[0]
            if path == Paths.HEALTH:
                ok = agent.failed is None
                self._json(200 if ok else 503, {"status": "ok" if ok else "failed", "reason": agent.failed})
            elif path == Paths.READY:
                if agent.ready:
                    self._json(200, {"ready": True})
                else:
                    why = agent.failed or ("waiting for every rank to load" if agent.client else "joining node 0")
                    self._json(503, {"ready": False, "reason": why})
            elif path == Paths.METRICS:
                self._send(200, node_metrics(agent.status(), labels), "text/plain; version=0.0.4")
            elif path == Paths.LOADS:
                if self._admin():
                    self._json(200, agent.status())
            elif path == Paths.DEBUG_STACKS:
                if self._admin():
                    self._send(
                        200,
                        f"=== node agent (pid {os.getpid()}) ===\n{thread_stacks()}\n{agent.rank_stacks()}",
                        "text/plain",
                    )
            else:
                self._json(404, {"error": {"message": f"{path}: a worker node serves no API (node 0 does)"}})

    return Handler


def run_node_server(values: dict) -> int:
    """The worker node's process: HTTP up first (probes), then join node 0 and watch."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [node]: %(message)s")
    layout = NodeLayout(values["tp_size"], values["nnodes"], values["node_rank"], values["dist_init_addr"])
    engine_args = {k: v for k, v in values.items() if k not in ("admin_token", "pd_secret", "api_keys")}
    agent = NodeAgent(engine_args, layout)
    handler = make_handler(agent, values.get("admin_token"), values.get("role", "mono"), values["served_model_name"])
    server = ThreadingHTTPServer((values["host"], values["port"]), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="dsv4-node-http", daemon=True).start()

    def on_signal(signum: int, _frame) -> None:
        if agent.ranks is None:  # still joining: nothing to stop but this process
            raise SystemExit(0)
        agent.terminate(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(f"dsv4: {layout.describe()}: joining node 0 at {layout.dist_init_addr}", file=sys.stderr, flush=True)
    try:
        agent.join()
    except ConnectionError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2 if "refused" in str(e) else 1
    code = agent.run()
    server.shutdown()
    return code
