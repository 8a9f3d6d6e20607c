"""dsv4 commands as real processes, for the tests and the chaos clusters: free ports, `Proc`
(a `dsv4 ...` process with its log), `serving` (`dsv4 serve` on a free port until it is ready)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


_HANDED: set[int] = set()  # ports this process handed out: never twice, even before they are bound


def free_port_block(offsets=(0, 1, 2, 3, 100, 101)) -> int:
    """A base port P with P+offset free for every offset (`dsv4 up --port P` puts engines on
    P+1.. and prefill bootstrap ports on P+100..). Drawn below the kernel's ephemeral range
    (32768-60999 here): a port that bind(0) found free is one an outgoing connection, or UCX's
    listener in a NIXL agent, may take before the server binds it."""
    import random

    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000)
        ports = [base + off for off in offsets]
        if any(p in _HANDED for p in ports):
            continue
        socks = []
        try:
            for port in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _HANDED.update(ports)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports found")


def free_port() -> int:
    """One free port for a server a test starts (free_port_block's rules)."""
    return free_port_block((0,))


class Proc:
    """A dsv4 command running as a real process, with its log kept for failing tests."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self._terminated = False
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "dsv4_cli", *map(str, args)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, url: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.popen.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url} not ready after {timeout}s:\n{self.log()}")

    def wait_workers_healthy(self, url: str, count: int, timeout: float = 30.0) -> None:
        """For a router: wait until `count` of its workers are in rotation. /ready turns 200 with
        the first healthy worker, so a test that depends on which worker a request reaches (prefix
        affinity) must also wait for the others to pass their first health check."""
        deadline = time.monotonic() + timeout
        workers: list = []
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.popen.returncode}:\n{self.log()}")
            try:
                workers = httpx.get(f"{url}/admin/workers", timeout=1.0).json()["workers"]
                if sum(bool(w["healthy"]) for w in workers) >= count:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url}: fewer than {count} healthy workers after {timeout}s: {workers}\n{self.log()}")

    def terminate(self) -> None:
        """SIGTERM, once (a second one tells an engine to hurry its drain), without waiting."""
        if self.popen.poll() is None and not self._terminated:
            self.popen.terminate()
            self._terminated = True

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()


def stop_all(procs) -> None:
    """Stop several processes together: SIGTERM to each, then wait for each. An idle engine takes
    over a second from SIGTERM to exit, mostly waiting: one after another, a cluster's teardown
    added those seconds up."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        p.terminate()
    for p in procs:
        p.stop()


@contextlib.contextmanager
def serving(args: list, log_path: Path, env: dict | None = None):
    """`dsv4 serve ARGS --port <free>` as a real process; yields its URL once it is ready."""
    port = free_port()
    proc = Proc(["serve", *args, "--port", port], log_path, env)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_ready(url)
        yield url
    finally:
        proc.stop()


@contextlib.contextmanager
def serving_all(runs: list[tuple[list, Path]], env: dict | None = None):
    """Several `dsv4 serve` at once, [(ARGS, log path), ...]: their loading overlaps, where
    `serving` one after the other waits for each in turn. Yields their URLs, in order, once every
    one is ready."""
    procs, urls = [], []
    try:
        for args, log_path in runs:
            port = free_port()
            procs.append(Proc(["serve", *args, "--port", port], log_path, env))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls):
            proc.wait_ready(url)
        yield urls
    finally:
        stop_all(procs)
