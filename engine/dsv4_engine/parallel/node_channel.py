"""The node channel of a multi-node engine: one TCP connection from each worker node's agent to
node 0's engine core, beside torch.distributed's own. Torch-free.

Why a channel of our own: a collective over gloo or NCCL does not say which host went away, and
a host that vanishes without closing its sockets (power, network) can leave a collective waiting
for as long as its timeout. Over this channel node 0 learns at once, with the reason, when

- a node's agent process is gone (its connection closes: killed, crashed, pod deleted);
- a node reports that one of its ranks exited or stopped ("node 1: rank 1 (pid N) exited with
  code -9: ...");
- a node stops beating for DSV4_NODE_TIMEOUT_S (a host frozen or cut off);

and a node learns the same of node 0 (the connection closes, a failure is announced, or node 0
stops beating). Either side then fails the whole group: no half-engine ever serves.

Protocol: newline-delimited JSON. Node 0 listens on the rendezvous port + 1. On connect it sends
a challenge; the node answers with its hello (node rank, world, ranks, pids, host, a fingerprint
of the checkpoint's config.json and, when a PD secret is set, an HMAC of the challenge). Node 0
refuses a node whose layout or checkpoint differs, or that knows no secret, with a reason the
node prints. Then both sides send a beat every second; node 0 sends `ready` once every rank
has loaded, `failed` when the group fails and `stop` before an orderly shutdown.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dsv4_wire import switches
from dsv4_wire.auth import PD_SECRET_ENV

log = logging.getLogger("dsv4.nodes")

BEAT_S = 1.0
SECRET_ENV = PD_SECRET_ENV  # the group's nodes share the deployment's PD secret


def group_secret() -> Optional[str]:
    return switches.read(SECRET_ENV) or None


def config_fingerprint(model_dir: str) -> str:
    """sha256 of the checkpoint's config.json: nodes serving different models must not form a group."""
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unreadable"


def answer(secret: Optional[str], challenge: str) -> Optional[str]:
    if not secret:
        return None
    return hmac.new(secret.encode(), challenge.encode(), hashlib.sha256).hexdigest()


def hello_refusal(hello: dict, expect: dict, secret: Optional[str], challenge: str, joined: set[int]) -> Optional[str]:
    """Pure: why node 0 refuses this hello (one line), or None. `expect`: node 0's nnodes, tp_size,
    model fingerprint."""
    node = hello.get("node")
    if not isinstance(node, int) or not 1 <= node < expect["nnodes"]:
        return f"node rank {node!r} is not a worker node of --nnodes {expect['nnodes']}"
    for key, flag in (("nnodes", "--nnodes"), ("tp_size", "--tp-size")):
        if hello.get(key) != expect[key]:
            return f"node {node} runs {flag} {hello.get(key)}, node 0 runs {flag} {expect[key]}"
    if hello.get("model") != expect["model"]:
        return f"node {node}'s checkpoint differs from node 0's (config.json {hello.get('model')} vs {expect['model']})"
    if secret and not hmac.compare_digest(str(hello.get("proof") or ""), answer(secret, challenge) or ""):
        return f"node {node} does not know the group's secret ({SECRET_ENV})"
    if node in joined:
        return f"node {node} joined already (two processes with --node-rank {node}?)"
    return None


class _Line:
    """One JSON message per line over a socket; send is thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")
        self._lock = threading.Lock()

    def send(self, msg: dict) -> bool:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> Optional[dict]:
        """The next message, None when the connection closed (or broke), {"silent": True} when the
        socket's timeout passed without a byte (the peer beats every BEAT_S: it is frozen or cut off)."""
        try:
            line = self.reader.readline()
        except TimeoutError:
            return {"silent": True}
        except OSError:
            return None
        if not line:
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            return {"garbled": line[:200].decode("utf-8", "replace")}
        return msg if isinstance(msg, dict) else {"garbled": str(msg)[:200]}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class NodeState:
    node: int
    host: str
    peer: str
    pids: dict = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    line: Optional[_Line] = None


class NodeServer:
    """Node 0's end: accepts the worker nodes, watches them, tells them the group's fate.
    `failure()` is polled by the group's watchdog thread."""

    def __init__(self, port: int, expect: dict, timeout_s: float, secret: Optional[str] = None) -> None:
        self.expect = dict(expect)
        self.timeout_s = timeout_s
        self.secret = secret
        self.nodes: dict[int, NodeState] = {}
        self.refused: list[str] = []
        self._failure: Optional[str] = None
        self._lock = threading.Lock()
        self._closing = False
        self.ready = False
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.sock = socket.create_server(("", port))
        self.port = port
        threading.Thread(target=self._accept, name="dsv4-node-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="dsv4-node-beat", daemon=True).start()

    # ---- what the group reads ----------------------------------------------------------------

    def missing(self) -> list[int]:
        with self._lock:
            return [n for n in range(1, self.expect["nnodes"]) if n not in self.nodes]

    def failure(self) -> Optional[str]:
        """Why the group cannot go on (a node lost, or a node's report), or None."""
        with self._lock:
            if self._failure is not None:
                return self._failure
            now = time.monotonic()
            for st in self.nodes.values():
                if now - st.last_seen > self.timeout_s:
                    self._failure = (
                        f"node {st.node} ({st.host}) gave no sign of life on the node channel for more than "
                        f"{self.timeout_s:g} s (host frozen or cut off)"
                    )
                    return self._failure
        return None

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            now = time.monotonic()
            return [
                {"node": st.node, "host": st.host, "peer": st.peer, "pids": st.pids, "seen_s_ago": now - st.last_seen}
                for st in sorted(self.nodes.values(), key=lambda s: s.node)
            ]

    # ---- what the group tells the nodes ------------------------------------------------------

    def announce_ready(self) -> None:
        self.ready = True
        self._send_all({"ready": True})

    def announce_failure(self, reason: str) -> None:
        self._send_all({"failed": reason})

    def announce_stop(self) -> None:
        self._send_all({"stop": True})

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.close()
        with self._lock:
            lines = [st.line for st in self.nodes.values() if st.line is not None]
        for line in lines:
            line.close()

    # ---- internals ----------------------------------------------------------------------------

    def _send_all(self, msg: dict) -> None:
        with self._lock:
            lines = [st.line for st in self.nodes.values() if st.line is not None]
        for line in lines:
            line.send(msg)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failure is None and not self._closing:
                self._failure = reason

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, addr), name="dsv4-node-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        line = _Line(conn)
        peer = str(addr[0]) if isinstance(addr, tuple) else str(addr)
        challenge = secrets.token_hex(16)
        line.send({"challenge": challenge})
        # Reads and writes time out: a node that stops beating (or reading) must not hold a thread.
        conn.settimeout(self.timeout_s)
        hello = line.recv()
        if not hello or not isinstance(hello.get("hello"), dict):
            line.close()
            return  # a port scan, or a client that gave up: not a node
        info = hello["hello"]
        with self._lock:
            refusal = hello_refusal(info, self.expect, self.secret, challenge, set(self.nodes))
            if refusal is None:
                st = NodeState(info["node"], str(info.get("host") or peer), peer, dict(info.get("pids") or {}))
                st.line = line
                self.nodes[st.node] = st
        if refusal is not None:
            log.error("refused a node from %s: %s", peer, refusal)
            self.refused.append(refusal)
            line.send({"refused": refusal})
            line.close()
            return
        log.info("node %d joined from %s (ranks %s)", st.node, peer, info.get("ranks"))
        line.send({"welcome": {"ready": self.ready}})
        if self.ready:
            line.send({"ready": True})
        while True:
            msg = line.recv()
            if msg is not None and msg.get("silent"):
                if not self._closing:
                    self._fail(
                        f"node {st.node} ({st.host}) gave no sign of life on the node channel for more than "
                        f"{self.timeout_s:g} s (host frozen or cut off)"
                    )
                return
            if msg is None:
                if not self._closing:
                    self._fail(f"node {st.node} ({st.host}) is gone: its node channel closed")
                return
            with self._lock:
                st.last_seen = time.monotonic()
                if isinstance(msg.get("pids"), dict):
                    st.pids = dict(msg["pids"])
            if "failed" in msg:
                self._fail(f"node {st.node} ({st.host}): {msg['failed']}")

    def _beat(self) -> None:
        while not self._closing:
            self._send_all({"beat": time.time()})
            time.sleep(BEAT_S)


class NodeClient:
    """A worker node's end: joins node 0 (retrying while node 0 starts), beats, reports its ranks'
    failure, and calls `on_lost(reason)` once when node 0 is gone or fails the group."""

    def __init__(
        self,
        host: str,
        port: int,
        hello: dict,
        timeout_s: float,
        join_timeout_s: float,
        on_lost: Callable[[str], None],
        secret: Optional[str] = None,
    ) -> None:
        self.host, self.port = host, port
        self.hello = dict(hello)
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.secret = secret
        self.ready = False
        self.stopping = False  # node 0 announced an orderly stop
        self.joined = False
        self.last_seen = time.monotonic()
        self._lost = False
        self._lock = threading.Lock()
        self.line = self._connect(join_timeout_s)

    def _connect(self, join_timeout_s: float) -> _Line:
        deadline = time.monotonic() + join_timeout_s
        last = ""
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5)
            except OSError as e:
                last = f"{type(e).__name__}: {e}"
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"node 0's node channel at {self.host}:{self.port} did not answer within "
                        f"{join_timeout_s:g} s ({last})"
                    ) from None
                time.sleep(0.5)
                continue
            sock.settimeout(self.timeout_s)  # node 0 beats every BEAT_S: a longer silence is a loss
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            line = _Line(sock)
            first = line.recv() or {}
            proof = answer(self.secret, str(first.get("challenge") or ""))
            line.send({"hello": {**self.hello, **({"proof": proof} if proof else {})}})
            reply = line.recv()
            if reply is None:
                line.close()
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"node 0 at {self.host}:{self.port} closed the node channel while joining")
                time.sleep(0.5)
                continue
            if "refused" in reply:
                line.close()
                raise ConnectionError(f"node 0 refused this node: {reply['refused']}")
            self.joined = True
            self.last_seen = time.monotonic()
            threading.Thread(target=self._read, args=(line,), name="dsv4-node-read", daemon=True).start()
            threading.Thread(target=self._beat, args=(line,), name="dsv4-node-beat", daemon=True).start()
            return line

    def report_failure(self, reason: str) -> None:
        self.line.send({"failed": reason})

    def silent(self) -> Optional[str]:
        if time.monotonic() - self.last_seen > self.timeout_s:
            return (
                f"node 0 ({self.host}) gave no sign of life on the node channel for more than {self.timeout_s:g} s "
                "(host frozen or cut off)"
            )
        return None

    def close(self) -> None:
        with self._lock:
            self._lost = True  # ours: not a loss
        self.line.close()

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._lost:
                return
            self._lost = True
        self.on_lost(reason)

    def _read(self, line: _Line) -> None:
        while True:
            msg = line.recv()
            if msg is not None and msg.get("silent"):
                self._lose(self.silent() or f"node 0 ({self.host}) gave no sign of life on the node channel")
                return
            if msg is None:
                if self.stopping:
                    self._lose("node 0 stopped the engine")
                else:
                    self._lose(f"node 0 ({self.host}:{self.port}) is gone: the node channel closed")
                return
            self.last_seen = time.monotonic()
            if msg.get("ready"):
                self.ready = True
            if msg.get("stop"):
                self.stopping = True
            if "failed" in msg:
                self._lose(f"node 0 failed the group: {msg['failed']}")
                return

    def _beat(self, line: _Line) -> None:
        while not self._lost:
            if not line.send({"beat": time.time()}):
                return
            time.sleep(BEAT_S)
