"""A worker node of a multi-node engine: `dsv4 serve --nnodes N --node-rank R` with R > 0.

Torch-free. It joins node 0 over the node channel (retrying while node 0 starts), spawns this
host's ranks (global ranks R*k .. R*k+k-1, one per local GPU; they join torch.distributed at
--dist-init-addr and then run what rank 0 broadcasts), and watches both:

- one of its ranks exits or stops beating -> it tells node 0 why (node 0 fails the group at once,
  naming this node and rank), kills its other ranks and exits 1;
- node 0 is gone (its channel closes), fails the group, or stops beating -> it kills its ranks and
  exits 1 with node 0's reason;
- node 0 announced an orderly stop and its ranks exited 0 -> it exits 0;
- SIGTERM (its pod deleted) -> the group cannot go on without it: it tells node 0, stops its ranks
  and exits.

Its small HTTP surface (dsv4_serve.node_server) answers /health (alive and not failed), /ready
(the group serves), /metrics, /v1/loads and /debug/stacks (its ranks' stacks, via SIGUSR1).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from typing import Optional

from dsv4_engine.parallel.layout import NodeLayout, set_socket_interface
from dsv4_engine.parallel.node_channel import NodeClient, config_fingerprint, group_secret
from dsv4_engine.parallel.ranks import LocalRanks, node_timeout_s, step_timeout_s

log = logging.getLogger("dsv4.node")

WATCH_INTERVAL_S = 0.2
FAIL_GRACE_S = 1.0  # time for node 0 to read this node's reason before the connection closes


class NodeAgent:
    def __init__(self, engine_args: dict, layout: NodeLayout) -> None:
        self.engine_args = dict(engine_args)
        self.layout = layout
        self.step_timeout = step_timeout_s()
        self.failed: Optional[str] = None
        self.stopped = False  # an orderly end: node 0 stopped the engine
        self.ranks: Optional[LocalRanks] = None
        self.client: Optional[NodeClient] = None
        self.started = time.time()
        self._beat_floor = time.time()
        self._done = threading.Event()
        self._lock = threading.Lock()

    # ---- start -----------------------------------------------------------------------------------

    def join(self) -> None:
        """Join node 0 (raises ConnectionError with node 0's refusal or its silence), then start
        this host's ranks."""
        lay = self.layout
        set_socket_interface(lay)  # the ranks inherit it
        hello = {
            "node": lay.node_rank,
            "nnodes": lay.nnodes,
            "tp_size": lay.tp_size,
            "ranks": lay.local_ranks(),
            "host": socket.gethostname(),
            "model": config_fingerprint(self.engine_args.get("model", "")),
        }
        self.client = NodeClient(
            lay.init_host,
            lay.channel_port,
            hello,
            node_timeout_s(),
            self.step_timeout,
            self._node0_lost,
            group_secret(),
        )
        ranks = lay.local_ranks()
        self.ranks = LocalRanks(
            ranks,
            lay.tp_size,
            lay.init_method(),
            self.engine_args,
            {r: i for i, r in enumerate(ranks)},
            f"node{lay.node_rank}",
        )
        self.client.line.send({"pids": {str(r): pid for r, pid in self.ranks.pids().items()}})
        log.info("%s: joined node 0 at %s, ranks %s started", lay.describe(), lay.dist_init_addr, ranks)

    # ---- the watch loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Watch until the group ends; the exit code of `dsv4 serve`."""
        last_round = time.time()
        while not self._done.is_set():
            now = time.time()
            if now - last_round > self.step_timeout / 2:  # this process was frozen: not its ranks' fault
                self._beat_floor = now
            last_round = now
            assert self.ranks is not None and self.client is not None
            if self.client.stopping and self.ranks.all_exited_cleanly():
                with self._lock:
                    if self.failed is None:
                        self.stopped = True
                self._done.set()
                break
            gone = self.ranks.exited()
            if gone is not None and not self.client.stopping:
                self.fail(gone, tell=True)
                break
            silent = self.ranks.silent(self.step_timeout, self._beat_floor) or self.client.silent()
            if silent is not None:
                self.fail(silent, tell=True)
                break
            self._done.wait(WATCH_INTERVAL_S)
        self._done.wait()  # a failure from another thread (node 0 lost) finishes there
        self.close()
        return 0 if self.stopped and self.failed is None else 1

    def fail(self, reason: str, tell: bool = False) -> None:
        with self._lock:
            if self.failed is not None or self.stopped:
                self._done.set()
                return
            self.failed = reason
        print(f"dsv4: node {self.layout.node_rank}: the group failed: {reason}", file=sys.stderr, flush=True)
        log.critical("node %d: the group failed: %s", self.layout.node_rank, reason)
        if tell and self.client is not None:
            self.client.report_failure(reason)
            time.sleep(FAIL_GRACE_S)  # node 0 reads the reason before the connection closes
        if self.ranks is not None:
            self.ranks.kill()
        self._done.set()

    def _node0_lost(self, reason: str) -> None:
        if self.client is not None and self.client.stopping:
            # Orderly: the ranks got rank 0's stop and exit 0; the loop sees it. A rank still
            # running after a grace is stopped.
            threading.Thread(target=self._finish_stop, name="dsv4-node-stop", daemon=True).start()
            return
        self.fail(reason)

    def _finish_stop(self) -> None:
        if self.ranks is not None:
            self.ranks.wait(10.0)
        with self._lock:
            if self.failed is None:
                self.stopped = True
        self._done.set()

    def terminate(self, why: str) -> None:
        """SIGTERM: this node leaves, so the group cannot go on (node 0 is told why)."""
        self.fail(f"node {self.layout.node_rank} was stopped ({why})", tell=True)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.kill()
        if self.client is not None:
            self.client.close()

    # ---- what its HTTP surface shows ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.failed is None and self.client is not None and self.client.ready

    def status(self) -> dict:
        lay = self.layout
        ranks = []
        if self.ranks is not None:
            ages = self.ranks.beat_ages()
            for r, p in self.ranks.procs.items():
                code = p.poll()
                ranks.append(
                    {
                        "rank": r,
                        "pid": p.pid,
                        "running": code is None,
                        "exit_code": code,
                        "beat_age_seconds": None if ages.get(r) is None else round(ages[r], 3),
                    }
                )
        return {
            "role": "node",
            "model": self.engine_args.get("served_model_name"),
            "node_rank": lay.node_rank,
            "nnodes": lay.nnodes,
            "tp_size": lay.tp_size,
            "dist_init_addr": lay.dist_init_addr,
            "joined": self.client is not None and self.client.joined,
            "group_ready": self.ready,
            "failed": self.failed,
            "ranks": ranks,
            "uptime_seconds": round(time.time() - self.started, 3),
        }

    def rank_stacks(self) -> str:
        if self.ranks is None:
            return "(no ranks yet: still joining node 0)\n"
        return "".join(
            f"=== rank {r} (pid {self.ranks.procs[r].pid}) ===\n{text}\n" for r, text in self.ranks.stacks().items()
        )
