"""The real operator (kopf + handlers + health server) in a thread of the test process, against
an API server given by a kubeconfig — for the operator's and the watchdog's integration tests."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Optional

from dsv4_operator.leader import LeaderElection
from dsv4_operator.main import make_settings, serve_operator
from dsv4_operator.telemetry import HealthState, OperatorMetrics
from bench.harness.commands import free_port  # noqa: F401 (re-exported: tests import it from here)


class OperatorThread:
    """The real operator (kopf + handlers + health server) in its own thread and event loop,
    talking to the emulator over HTTP through a kubeconfig, as `dsv4 operator` does."""

    def __init__(
        self,
        kubeconfig: Path,
        namespaces: list[str],
        health_port: int,
        standalone: bool = True,
        leader_election: Optional[LeaderElection] = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.standalone = standalone
        self.namespaces = namespaces
        self.health_port = health_port
        self.leader_election = leader_election
        self.state = HealthState()
        self.metrics = OperatorMetrics()
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="dsv4-operator", daemon=True)

    def _run(self) -> None:
        settings = make_settings(standalone=self.standalone)
        settings.watching.reconnect_backoff = 0.05
        settings.posting.level = 30  # logging.WARNING
        try:
            asyncio.run(
                serve_operator(
                    namespaces=self.namespaces,
                    standalone=self.standalone,
                    health_host="127.0.0.1",
                    health_port=self.health_port,
                    kubeconfig=str(self.kubeconfig),
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    settings=settings,
                    state=self.state,
                    metrics=self.metrics,
                    leader_election=self.leader_election,
                )
            )
        except BaseException as e:  # surfaced by stop()
            self.error = e

    async def start(self, timeout: float = 15.0, wait_ready: bool = True) -> "OperatorThread":
        """``wait_ready=False``: return at once (a leader-election candidate may stand by)."""
        self.thread.start()
        if not wait_ready:
            return self
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(None, self.ready_flag.wait, timeout)
        if not ok:
            raise RuntimeError(f"the operator did not start within {timeout}s (error: {self.error!r})")
        return self

    async def stop(self, timeout: float = 15.0) -> None:
        self.stop_flag.set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.thread.join, timeout)
        if self.thread.is_alive():
            raise RuntimeError("the operator did not stop")
