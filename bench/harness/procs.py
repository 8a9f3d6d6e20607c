"""Servers under test as real processes: start, wait until they answer, sample their memory,
stop them (only the ones we started, by pid)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import psutil
from bench.harness.commands import free_port  # noqa: F401 (re-exported: tests import it from here)


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process plus all its descendants (vllm runs its engine core in a child)."""
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _own_rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


class RSSSampler:
    """Samples a process tree's RSS every `interval` s in a thread; `peak` is the highest seen.
    Not faster: a walk of /proc for the children costs a few % of a core at 4 Hz already."""

    def __init__(self, pid: int, interval: float = 0.25, tree: bool = True):
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.rss = tree_rss if tree else _own_rss
        self.peak = self.rss(self.proc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss(self.proc))

    def current(self) -> int:
        return self.rss(self.proc)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak


class Server:
    """A server command with its log; `url` answers once `wait_ready` returns."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        log_dir: Path,
        env: Optional[dict] = None,
        ready_path: str = "/ready",
    ):
        self.name = name
        self.argv = argv
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    @classmethod
    def dsv4(cls, name: str, args: list, port: int, log_dir: Path, env: Optional[dict] = None) -> "Server":
        return cls(name, [sys.executable, "-m", "dsv4_cli", *map(str, args)], port, log_dir, env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ready; raises with the log tail if the process dies or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's own process group (it was started in a new session, so the
        group is exactly its tree), then SIGKILL if it lingers."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(5)
        self._log.close()


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
