"""`dsv4 up`: the router, prefill and decode engines as local processes, watched by the same
wedge detector and remediation policy the operator runs on a cluster.

Here a "pod" is an engine process: draining takes it out of the router, a restart stops the
process and starts it again on the same ports (a new PID plays the part of a new pod UID), and
evidence is written to files instead of a ConfigMap.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
from rich.console import Console

from dsv4_wire import EngineFlags as F
from dsv4_wire import Paths

from dsv4_operator.watchdog.detector import Detector, Verdict, verdict_to_dict
from dsv4_operator.watchdog.evidence import build_evidence_configmap
from dsv4_operator.watchdog.policy import (
    ABORT, CAPTURE_EVIDENCE, DRAIN, HELD, REPORT, RESTART, Action, PodInfo, RemediationSettings,
)
from dsv4_operator.watchdog.runner import WatchdogLoop
from dsv4_operator.watchdog.scrape import ScrapeTarget

console = Console(stderr=True, highlight=False)


def cache_dir() -> Path:
    base = os.environ.get("DSV4_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "dsv4")
    return Path(base)


@dataclass
class UpArgs:
    model: Path  # the CLI builds the default tiny model before handing it over
    # How to start `dsv4` (the CLI passes its own entry point: the operator never imports it).
    dsv4_command: list[str] = field(default_factory=lambda: ["dsv4"])
    prefill: int = 1
    decode: int = 1
    port: int = 8000
    host: str = "127.0.0.1"
    mono: bool = False
    enable_fault_injection: bool = False
    deadlines: bool = True
    watchdog: bool = True
    detection_window: float = 20.0
    scrape_interval: float = 2.0
    evidence_dir: Optional[Path] = None
    engine_args: list[str] = field(default_factory=list)
    max_unavailable: int = 1
    cooldown: float = 30.0


@dataclass
class EngineProc:
    """One engine process (the local stand-in for a pod)."""

    key: str
    role: str
    port: int
    cmd: list[str]
    log_path: Path
    bootstrap_port: Optional[int] = None
    popen: Optional[subprocess.Popen] = None
    ever_ready: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def uid(self) -> Optional[str]:
        return str(self.popen.pid) if self.popen else None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.ever_ready = False

    def stop(self, timeout: float = 5.0) -> None:
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


class LocalExecutor:
    """Acts on engine processes and the local router."""

    def __init__(self, up: "LocalDeployment"):
        self.up = up
        self.http = httpx.AsyncClient(timeout=5.0)

    async def run(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        eng = self.up.engines[action.pod]
        if action.kind == REPORT:
            self.up.event("WedgeDetected", action.pod, f"{action.reason} {dict(action.details)}")
            return True, None
        if action.kind == HELD:
            self.up.event("RemediationHeld", action.pod, f"{action.reason} {dict(action.details)}")
            return True, None
        if action.kind == CAPTURE_EVIDENCE:
            path = await self.capture(eng, verdict)
            self.up.event("EvidenceCaptured", action.pod, str(path))
            return True, None
        if action.kind == DRAIN:
            ok = await self.post(self.up.router_url + Paths.ADMIN_WORKERS, "DELETE", {"url": eng.url})
            await self.post(eng.url + Paths.ADMIN_DRAIN, "POST", None)
            self.up.event("Drained", action.pod, "removed from the router")
            return ok, None if ok else "router did not drop the worker"
        if action.kind == ABORT:
            ok = await self.post(eng.url + Paths.ADMIN_ABORT, "POST", {"all": True, "reason": "wedge remediation"})
            self.up.event("Aborted", action.pod, "aborted all requests" if ok else "engine did not answer")
            return True, None if ok else "engine did not answer the abort"
        if action.kind == RESTART:
            await asyncio.to_thread(eng.stop)
            eng.start()
            await self.post(self.up.router_url + Paths.ADMIN_WORKERS, "POST", {"url": eng.url, "role": eng.role})
            self.up.event("Restarted", action.pod, f"new process {eng.uid}")
            return True, None
        return False, f"unknown action {action.kind}"

    async def post(self, url: str, method: str, body: Optional[dict]) -> bool:
        try:
            r = await self.http.request(method, url, json=body)
            return r.status_code < 400
        except httpx.HTTPError:
            return False

    async def capture(self, eng: EngineProc, verdict: Optional[Verdict]) -> Path:
        async def text(path: str) -> Optional[str]:
            try:
                r = await self.http.get(f"{eng.url}{path}")
                return r.text if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        stacks, loads, metrics = await asyncio.gather(text(Paths.DEBUG_STACKS), text(Paths.LOADS), text(Paths.METRICS))
        now = time.time()
        cm = build_evidence_configmap(
            deployment="local", namespace="local", pod=eng.key, role=eng.role, captured_at=now,
            verdict=verdict_to_dict(verdict) if verdict is not None else {}, stacks=stacks,
            loads=json.loads(loads) if loads else None, metrics=metrics, logs=eng.tail(),
            spec_diff="(local deployment: no spec history)",
        )
        folder = self.up.evidence_dir / cm["metadata"]["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for name, content in cm["data"].items():
            (folder / name).write_text(content)
        (folder / "configmap.json").write_text(json.dumps(cm, indent=1))
        return folder


class LocalDeployment:
    def __init__(self, args: UpArgs):
        self.args = args
        self.model = Path(args.model)
        self.state_dir = cache_dir() / "up" / str(args.port)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.evidence_dir = Path(args.evidence_dir) if args.evidence_dir else self.state_dir / "evidence"
        self.evidence_dir.mkdir(parents=True, exist_ok=True)
        self.router_url = f"http://{args.host}:{args.port}"
        self.engines: dict[str, EngineProc] = {}
        port = args.port + 1
        roles = [("mono", 1)] if args.mono else [("prefill", args.prefill), ("decode", args.decode)]
        for role, n in roles:
            for i in range(n):
                key = f"{role}-{i}"
                cmd = [*args.dsv4_command, "serve", F.MODEL, str(self.model), F.ROLE, role,
                       F.HOST, "127.0.0.1", F.PORT, str(port), F.SERVED_MODEL_NAME, self.model.name]
                bport = None
                if role == "prefill":
                    bport = args.port + 100 + i
                    cmd += [F.BOOTSTRAP_PORT, str(bport)]
                if args.enable_fault_injection:
                    cmd.append(F.ENABLE_FAULT_INJECTION)
                if not args.deadlines:
                    cmd.append(F.NO_DEADLINES)
                cmd += list(args.engine_args)
                self.engines[key] = EngineProc(key, role, port, cmd, self.state_dir / f"{key}.log", bport)
                port += 1
        router_cmd = [*args.dsv4_command, "router", "--host", args.host, "--port", str(args.port),
                      "--health-interval", "1"]
        for e in self.engines.values():
            router_cmd += [f"--{e.role}", e.url]
        self.router = EngineProc("router", "router", args.port, router_cmd, self.state_dir / "router.log")
        self.settings = RemediationSettings(
            dry_run=False, max_unavailable={"prefill": args.max_unavailable, "decode": args.max_unavailable,
                                            "mono": args.max_unavailable},
            cooldown_s=args.cooldown, restart_grace_s=1.0, recovery_timeout_s=max(120.0, 4 * args.detection_window))
        self.detector = Detector(window_s=args.detection_window)
        self.events: list[dict] = []

    def event(self, reason: str, pod: str, message: str) -> None:
        self.events.append({"time": time.time(), "reason": reason, "pod": pod, "message": message})
        colour = "red" if reason == "WedgeDetected" else "yellow"
        console.print(f"[{colour}]watchdog[/{colour}] {reason} {pod}: {message}")

    async def _ready(self, client: httpx.AsyncClient, eng: EngineProc) -> bool:
        if eng.popen is None or eng.popen.poll() is not None:
            return False
        try:
            ok = (await client.get(eng.url + Paths.READY, timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        eng.ever_ready = eng.ever_ready or ok
        return ok

    async def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            for eng in [*self.engines.values(), self.router]:
                while not await self._ready(client, eng):
                    if eng.popen.poll() is not None:
                        raise RuntimeError(f"{eng.key} exited with {eng.popen.returncode}; see {eng.log_path}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{eng.key} not ready after {timeout:.0f}s; see {eng.log_path}")
                    await asyncio.sleep(0.3)

    async def watch(self, stop: asyncio.Event) -> None:
        loop = WatchdogLoop(self.settings, self.detector, LocalExecutor(self))
        async with httpx.AsyncClient() as client:
            try:
                while not stop.is_set():
                    started = time.monotonic()
                    ready = dict(zip(self.engines, await asyncio.gather(*(self._ready(client, e) for e in self.engines.values()))))
                    pods = {k: PodInfo(role=e.role, ready=ready[k], uid=e.uid) for k, e in self.engines.items()}
                    targets = [ScrapeTarget(k, e.url, e.role) for k, e in self.engines.items()]
                    result = await loop.round(targets, pods, answered_before={k: e.ever_ready for k, e in self.engines.items()})
                    status = {"time": time.time(), **result.summary(), "policy": loop.state.to_dict(), "events": self.events[-50:]}
                    (self.state_dir / "status.json").write_text(json.dumps(status, indent=1, default=str))
                    elapsed = time.monotonic() - started
                    try:
                        await asyncio.wait_for(stop.wait(), max(0.0, self.args.scrape_interval - elapsed))
                    except asyncio.TimeoutError:
                        pass
            finally:
                await loop.close()

    async def run(self) -> None:
        stop = asyncio.Event()
        aloop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            aloop.add_signal_handler(sig, stop.set)
        for eng in self.engines.values():
            eng.start()
        self.router.start()
        try:
            await self.wait_ready()
            kind = "monolithic" if self.args.mono else f"prefill x{self.args.prefill}, decode x{self.args.decode}"
            console.print(f"dsv4 up: router on {self.router_url} ({kind}, model {self.model})")
            console.print(f"  try: curl {self.router_url}/v1/completions -H 'Content-Type: application/json' "
                          f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'")
            console.print(f"  logs and watchdog status in {self.state_dir}; evidence in {self.evidence_dir}")
            if self.args.watchdog:
                await self.watch(stop)
            else:
                await stop.wait()
        finally:
            for eng in [self.router, *self.engines.values()]:
                eng.stop()
            console.print("dsv4 up: stopped")


def run_up(args: UpArgs) -> None:
    asyncio.run(LocalDeployment(args).run())
