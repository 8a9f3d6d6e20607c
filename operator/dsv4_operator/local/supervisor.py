"""`dsv4 up`'s process supervisor: a process that dies is started again at once, the way a
kubelet restarts a crashed container, with its own crash-loop backoff.

A crash is not a wedge. The watchdog (detector + remediation policy) is for engines that are
alive but make no progress; a dead process needs no evidence, drain or abort, only a new
process, and waiting for the watchdog's window and remediation backoff would keep it down for
tens of seconds. The watchdog skips a process that is not running, so the two never act on
the same incarnation.

Crash-loop backoff (`CrashBackoff`): the first crash restarts at once; each further crash in a
row waits twice as long as the one before, from 1 s up to 30 s; a process that ran for 60 s
before it died starts the count again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from dsv4_operator.local.parent_death import term_with_parent


@dataclass(frozen=True)
class CrashBackoff:
    """When to restart a process after its ``crashes``-th crash in a row (pure)."""

    first_s: float = 1.0  # wait before the second restart in a row (the first is immediate)
    cap_s: float = 30.0
    stable_s: float = 60.0  # a process that ran this long before it died was not crash-looping

    def delay(self, crashes: int) -> float:
        if crashes <= 1:
            return 0.0
        return min(self.first_s * 2 ** (crashes - 2), self.cap_s)

    def crashes_after(self, crashes_before: int, ran_for_s: float) -> int:
        """The count of crashes in a row once a process that ran ``ran_for_s`` died."""
        return 1 if ran_for_s >= self.stable_s else crashes_before + 1


@dataclass
class EngineProc:
    """One supervised process: an engine (the local stand-in for a pod) or the router."""

    key: str
    role: str
    port: int
    cmd: list[str]
    log_path: Path
    bootstrap_port: Optional[int] = None
    env: Mapping[str, str] = field(default_factory=dict)  # secrets travel here, never in argv
    popen: Optional[subprocess.Popen] = None
    ever_ready: bool = False
    started_at: float = 0.0  # monotonic
    # Set while someone stops it on purpose (a watchdog restart, shutdown): not a crash.
    stopping: bool = False
    crashes: int = 0  # in a row (see CrashBackoff)
    restarts: int = 0  # by the supervisor, since `dsv4 up` started
    restart_at: Optional[float] = None  # monotonic time of the pending crash restart
    last_exit: Optional[int] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def uid(self) -> Optional[str]:
        return str(self.popen.pid) if self.popen else None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                preexec_fn=term_with_parent(),  # never outlive `dsv4 up` (a kill -9 of it included)
            )
        self.started_at = time.monotonic()
        self.ever_ready = False
        self.stopping = False
        self.restart_at = None

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:  # a wedged engine may not exit politely
            self.popen.kill()
            self.popen.wait(5)

    def tail(self, n: int = 200) -> list[str]:
        try:
            with open(self.log_path, errors="replace") as f:
                return list(deque(f, maxlen=n))
        except OSError:
            return []

    def to_dict(self) -> dict:
        return {
            "pid": self.popen.pid if self.popen else None,
            "running": self.running,
            "port": self.port,
            "restarts": self.restarts,
            "crashes_in_a_row": self.crashes,
            "last_exit": self.last_exit,
            "log": str(self.log_path),
        }


EventSink = Callable[[str, str, str], None]  # (reason, process key, message)


class Supervisor:
    """Restarts processes that exit on their own; `run` until `stop` is set."""

    def __init__(
        self,
        procs: list[EngineProc],
        events: EventSink,
        backoff: CrashBackoff = CrashBackoff(),
        poll_s: float = 0.1,
        on_change: Optional[Callable[[], None]] = None,
    ):
        self.procs = procs
        self.events = events
        self.backoff = backoff
        self.poll_s = poll_s
        self.on_change = on_change

    def tick(self, now: float) -> bool:
        """One look at every process; True when something changed."""
        changed = False
        for p in self.procs:
            if p.popen is None or p.stopping:
                continue
            if p.restart_at is None and p.popen.poll() is not None:
                p.last_exit = p.popen.returncode
                p.crashes = self.backoff.crashes_after(p.crashes, now - p.started_at)
                p.restart_at = now + self.backoff.delay(p.crashes)
                self.events(
                    "Crashed",
                    p.key,
                    f"exit {p.last_exit} after {now - p.started_at:.1f} s; restart in "
                    f"{p.restart_at - now:.0f} s (crash {p.crashes} in a row)",
                )
                changed = True
            if p.restart_at is not None and now >= p.restart_at:
                try:
                    p.start()
                except OSError as e:  # could not even spawn it: counts as one more crash
                    p.crashes += 1
                    p.restart_at = now + self.backoff.delay(p.crashes)
                    self.events("StartFailed", p.key, f"{e}; next try in {p.restart_at - now:.0f} s")
                else:
                    p.restarts += 1
                    self.events("Started", p.key, f"new process {p.uid}")
                changed = True
        return changed

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.tick(time.monotonic()) and self.on_change is not None:
                self.on_change()
            try:
                await asyncio.wait_for(stop.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass
