"""The rank processes one host runs for an engine, and how they are watched. Torch-free: node 0's
engine core (dsv4_engine.parallel.group) and a worker node's agent (node_agent) both use it.

Each rank is `python -m dsv4_engine.parallel.worker` with its spec in the environment. It touches
a heartbeat file every HEARTBEAT_S, leaves the one line saying why it failed in its error file, and
dumps every thread's stack into its stacks file on SIGUSR1 (faulthandler: works while the rank is
stuck in C code). Whoever spawned the ranks polls them (`exited`) and judges their heartbeats
(`silent`): a rank that exits or stops fails the group with the rank's own reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

# What each rank process runs (after the interpreter). Tests put a script of theirs here that
# sets the rank up as they need (e.g. graph capture on a CPU rank) and then runs the worker.
WORKER = ("-m", "dsv4_engine.parallel.worker")
SPEC_ENV = "DSV4_TP_SPEC"  # a worker's rank, world, rendezvous and engine arguments (JSON)
# The longest one step may wait on the other ranks (generous: a first step may JIT-compile kernels).
TIMEOUT_ENV = "DSV4_TP_TIMEOUT_S"
# The longest a node of a multi-node engine may go without a sign of life on the node channel.
NODE_TIMEOUT_ENV = "DSV4_NODE_TIMEOUT_S"
HEARTBEAT_S = 1.0  # how often a rank touches its heartbeat file (a stopped process cannot)


def _seconds(environ, name: str, default: str) -> float:
    raw = environ.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise ValueError(f"{name} must be a number of seconds > 0, not {raw!r}")
    return value


def step_timeout_s(environ=os.environ) -> float:
    """DSV4_TP_TIMEOUT_S (default 300), checked: a typo must not surface as a bare float() error
    from the engine's start, nor 0 fail every step."""
    return _seconds(environ, TIMEOUT_ENV, "300")


def node_timeout_s(environ=os.environ) -> float:
    """DSV4_NODE_TIMEOUT_S (default 30): a node silent on the node channel this long is lost (a
    host frozen or cut off sends no FIN; a killed process's connection closes at once)."""
    return _seconds(environ, NODE_TIMEOUT_ENV, "30")


class LocalRanks:
    """The rank processes of this host: spawned, polled, judged by heartbeat, killed."""

    def __init__(
        self,
        ranks: list[int],
        size: int,
        init_method: str,
        engine_args: dict,
        local_of: dict[int, int],
        tag: str,
    ) -> None:
        self.ranks = list(ranks)
        stem = os.path.join(tempfile.gettempdir(), f"dsv4-tp-{os.getpid()}-{tag}-rank")
        # Where each rank leaves the one line saying why it failed: named in the group's failure
        # instead of the collective's "connection reset by peer" that follows it. Its heartbeat:
        # its load may take as long as it takes, but not without a sign of life.
        self.error_files = {r: f"{stem}{r}.err" for r in self.ranks}
        self.alive_files = {r: f"{stem}{r}.alive" for r in self.ranks}
        self.stacks_files = {r: f"{stem}{r}.stacks" for r in self.ranks}
        self.procs: dict[int, subprocess.Popen] = {}
        for r in self.ranks:
            spec = {
                "rank": r,
                "size": size,
                "local_rank": local_of[r],
                "local_size": len(local_of),
                "init": init_method,
                "parent": os.getpid(),
                "engine": engine_args,
                "error_file": self.error_files[r],
                "alive_file": self.alive_files[r],
                "stacks_file": self.stacks_files[r],
            }
            env = {**os.environ, SPEC_ENV: json.dumps(spec)}
            self.procs[r] = subprocess.Popen([sys.executable, *WORKER], env=env)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def exited(self, wait_s: float = 0.0) -> Optional[str]:
        """'rank r (pid) exited with code c: why' for the first rank found gone (waiting up to
        wait_s for one to go), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, p in self.procs.items():
                code = p.poll()
                if code is not None:
                    why = ""
                    with contextlib.suppress(OSError):
                        with open(self.error_files[r]) as f:
                            why = f.read().strip()
                    return f"rank {r} (pid {p.pid}) exited with code {code}" + (f": {why}" if why else "")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def all_exited_cleanly(self) -> bool:
        return all(p.poll() == 0 for p in self.procs.values())

    def silent(self, timeout_s: float, floor: float, loading: bool = False) -> Optional[str]:
        """The first rank whose heartbeat is older than timeout_s (a stopped process, alive to
        the poll), or None. Beats before `floor` (wall clock) are not held against a rank; a rank
        that has not written its first beat yet (still starting) is left to the join timeout."""
        now = time.time()
        for r, path in self.alive_files.items():
            try:
                last = os.path.getmtime(path)
            except OSError:
                continue
            if now - max(last, floor) > timeout_s:
                during = " while loading its weights" if loading else ""
                return (
                    f"rank {r} (pid {self.procs[r].pid}) gave no sign of life for more than "
                    f"{timeout_s:g} s{during} (a rank is hung)"
                )
        return None

    def beat_ages(self) -> dict[int, Optional[float]]:
        now = time.time()
        out: dict[int, Optional[float]] = {}
        for r, path in self.alive_files.items():
            try:
                out[r] = max(0.0, now - os.path.getmtime(path))
            except OSError:
                out[r] = None
        return out

    def stacks(self, wait_s: float = 0.5) -> dict[int, str]:
        """Every thread's stack of each rank (faulthandler, on SIGUSR1): what a stuck rank is
        waiting in. A rank that does not answer (stopped, gone) says so."""
        asked = []
        for r, p in self.procs.items():
            with contextlib.suppress(OSError):
                open(self.stacks_files[r], "w").close()
            # Only a rank that beats has its handler (faulthandler) in place: SIGUSR1 kills one
            # still importing.
            if p.poll() is None and os.path.exists(self.alive_files[r]):
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)
                    asked.append(r)
        time.sleep(wait_s if asked else 0)
        out = {}
        for r, p in self.procs.items():
            text = ""
            with contextlib.suppress(OSError):
                with open(self.stacks_files[r], errors="replace") as f:
                    text = f.read()
            if p.poll() is not None:
                text = text or f"(exited with code {p.returncode})\n"
            elif r not in asked:
                text = "(still starting: no stack handler yet)\n"
            out[r] = text or f"(no answer within {wait_s:g} s: the process may be stopped)\n"
        return out

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        self.remove_files()

    def wait(self, timeout: float) -> None:
        """Wait for every rank to exit, killing the ones still there at the deadline."""
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def remove_files(self) -> None:
        for group in (self.error_files, self.alive_files, self.stacks_files):
            for path in group.values():
                with contextlib.suppress(OSError):
                    os.unlink(path)
