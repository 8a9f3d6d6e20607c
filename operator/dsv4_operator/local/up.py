"""`dsv4 up`: the router, prefill and decode engines as local processes, watched by the same
wedge detector and remediation policy the operator runs on a cluster.

Here a "pod" is an engine process: draining takes it out of the router, a restart stops the
process and starts it again on the same ports (a new PID plays the part of a new pod UID), and
evidence is written to files instead of a ConfigMap. What each remediation action asks of the
engine is the table in `dsv4_operator.remediation.actions`, shared with the Kubernetes executor.

Three things keep out of each other's way:
- the supervisor (`dsv4_operator.local.supervisor`) restarts a process that died, at once, with its
  own crash-loop backoff; the watchdog does not look at a process that is not running;
- the engine's own PD deadlines fail a stalled request cleanly; the detection window is longer
  than the longest of them (`detection_window`), so the watchdog acts only when they did not;
- the watchdog remediates engines that are alive and wedged, with its own backoff.

Security: every process gets an admin token and a PD secret through its environment (never
argv, which `ps` shows); `dsv4 up` keeps them in its state folder (0700, files 0600) and sends
the admin token with every admin call it makes itself.
"""

from __future__ import annotations

from dsv4_wire import switches

import asyncio
import json
import os
import secrets
import shutil
import signal
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import httpx
from rich.console import Console
from rich.markup import escape

from dsv4_wire import ADMIN_TOKEN_ENV, PD_SECRET_ENV, authorization_header
from dsv4_wire import EngineFlags as F
from dsv4_wire.flags import RouterFlags as R
from dsv4_wire.serve_options import OPTIONS_BY_NAME, PD_DEADLINES
from dsv4_wire import Paths

from dsv4_operator.local.groups import make_groups, rebuild
from dsv4_operator.remediation.actions import dispatch, step_for
from dsv4_operator.local.state_files import write_atomic
from dsv4_operator.local.supervisor import CrashBackoff, EngineProc, Supervisor
from dsv4_operator.local.surge import hold_while_restarting
from dsv4_operator.watchdog.detector import Detector, Verdict, verdict_to_dict
from dsv4_operator.watchdog.evidence import build_evidence_configmap
from dsv4_operator.watchdog.groups import unit_info
from dsv4_operator.watchdog.policy import Action, PodInfo, RemediationSettings
from dsv4_operator.remediation.runner import WatchdogLoop
from dsv4_operator.local.router_watch import RouterWatch
from dsv4_operator.watchdog.signals import ScrapeTarget
from dsv4_operator.watchdog.signals import BUILTIN

# soft_wrap: rich never breaks a line itself (it would break paths in the middle at 80 columns);
# a long line stays one line that the terminal folds and a copy-paste gets whole.
console = Console(stderr=True, highlight=False, soft_wrap=True)

ADMIN_TOKEN_FILE = "admin-token"
PD_SECRET_FILE = "pd-secret"


def cache_dir() -> Path:
    base = switches.read("DSV4_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "dsv4"
    )
    return Path(base)


# ---- the detection window against the engine's own deadlines (pure) ----------------------------

# `dsv4 serve`'s PD deadlines in seconds, by flag (their declaration: dsv4_wire.serve_options).
ENGINE_DEADLINES: Mapping[str, float] = {OPTIONS_BY_NAME[n].cli_flag: OPTIONS_BY_NAME[n].default for n in PD_DEADLINES}
WINDOW_MARGIN_S = 15.0  # default window: the longest deadline plus this
NO_DEADLINES_WINDOW_S = 20.0  # default window when the engines run without deadlines


class WindowTooShort(ValueError):
    pass


def engine_deadlines(engine_args: Sequence[str]) -> Optional[dict[str, float]]:
    """The PD deadlines the engines will run with: `dsv4 serve`'s defaults overridden by the
    extra engine arguments (``--flag=S`` or ``--flag S``); None when they run without deadlines."""
    args = list(engine_args)
    if F.NO_DEADLINES in args:
        return None
    out = dict(ENGINE_DEADLINES)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in out:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            out[flag] = float(value)
        except ValueError:
            raise ValueError(f"{flag} needs a number of seconds, not {value!r}") from None
    return out


def detection_window(
    requested: Optional[float], deadlines: Optional[Mapping[str, float]], scrape_interval: float
) -> float:
    """The watchdog's detection window. With deadlines on, it must outlast the longest one by two
    scrapes (the clean failure has to show in a scrape before the window closes), or a stalled
    transfer the engine would fail by itself becomes a restart; left out, it is the longest
    deadline + WINDOW_MARGIN_S (75 s at the engine's defaults)."""
    if deadlines is None:  # nothing in the engine acts first
        return float(requested) if requested is not None else NO_DEADLINES_WINDOW_S
    flag, longest = max(deadlines.items(), key=lambda kv: kv[1])
    if requested is None:
        return longest + WINDOW_MARGIN_S
    minimum = longest + 2 * scrape_interval
    if requested < minimum:
        raise WindowTooShort(
            f"--detection-window {requested:g} s is too short: the engines' {flag} is {longest:g} s, so the "
            f"watchdog would restart an engine for a stalled transfer that the engine fails by itself. Use at "
            f"least {minimum:g} s (the longest deadline + 2 scrape intervals), leave it out for "
            f"{longest + WINDOW_MARGIN_S:g} s, shorten the deadlines with --engine-arg, or pass --no-deadlines."
        )
    return float(requested)


# ---- secrets -------------------------------------------------------------------------------------


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def stored_secret(path: Path) -> str:
    """The secret kept in ``path``, made (32 random bytes, URL-safe) when there is none or when the
    file was readable by others (it may have leaked). Written 0600 through a temporary file."""
    try:
        st = path.stat()
        if stat.S_IMODE(st.st_mode) & 0o077 == 0 and st.st_uid == os.getuid():
            value = path.read_text().strip()
            if value:
                return value
    except FileNotFoundError:
        pass
    value = secrets.token_urlsafe(32)
    write_atomic(path, value + "\n")  # mkstemp makes it 0600
    return value


def _flag_value(argv: Sequence[str], flag: str, as_flag: str) -> list[str]:
    """`flag`'s value in `argv` (either spelling), given again under `as_flag`; [] when absent."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return [as_flag, argv[i + 1]]
        if a.startswith(flag + "="):
            return [as_flag, a[len(flag) + 1 :]]
    return []


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
    deadlines: bool = OPTIONS_BY_NAME["deadlines"].default  # off: every engine gets --no-deadlines
    watchdog: bool = True
    detection_window: Optional[float] = None  # None: derived from the engines' deadlines
    scrape_interval: float = 2.0
    evidence_dir: Optional[Path] = None
    engine_args: list[str] = field(default_factory=list)
    nnodes: int = 1  # each engine a group of this many local "node" processes (dsv4_operator.local.groups)
    max_unavailable: int = 1
    cooldown: float = 30.0
    admin_token: Optional[str] = None  # None: generated and kept in the state folder
    pd_secret: Optional[str] = None  # None: generated and kept in the state folder
    crash_backoff: CrashBackoff = CrashBackoff()
    surge: bool = True  # planned restarts start the new engine first (local/surge.py); the CLI's default: no GPU

    def window(self) -> float:
        deadlines = engine_deadlines(self.engine_args) if self.deadlines else None
        return detection_window(self.detection_window, deadlines, self.scrape_interval)


class LocalExecutor:
    """Acts on engine processes and the local router (the `Steps` of the shared action table)."""

    engine_kind = BUILTIN

    def __init__(self, up: "LocalDeployment"):
        self.up = up
        self.http = httpx.AsyncClient(timeout=5.0, headers=authorization_header(up.admin_token))

    async def run(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        return await dispatch(self, action, verdict)

    def _event(self, action: Action, message: str) -> None:
        self.up.event(step_for(action.kind, self.engine_kind).event, action.pod, message)

    async def report(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        self._event(action, f"{action.reason} {dict(action.details)}")
        return True, None

    held = report

    async def capture(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        paths = [await self._capture(p, action, verdict) for p in self.up.group(action.pod)]
        self._event(action, ", ".join(map(str, paths)))
        return True, None

    async def drain(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        eng = self.up.engines[action.pod]
        ok = await self.call(self.up.router_url + Paths.ADMIN_WORKERS, "DELETE", {"url": eng.url})
        await self._engine_calls(eng, action)
        self._event(action, "removed from the router")
        return ok, None if ok else "router did not drop the worker"

    async def abort(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        ok = await self._engine_calls(self.up.engines[action.pod], action)
        self._event(action, "aborted all requests" if ok else "engine did not answer")
        return True, None if ok else "engine did not answer the abort"

    async def restart(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        eng = self.up.engines[action.pod]
        note = None
        if action.uid is None or eng.uid == action.uid:
            await hold_while_restarting(self.up, self.http, eng)  # the only one of its role: the router holds
            await self.up.restart_engine(eng)
        else:  # the supervisor replaced it already (it crashed): leave the new process alone
            note = f"already replaced (process {eng.uid}, not {action.uid})"
        await self.call(self.up.router_url + Paths.ADMIN_WORKERS, "POST", {"url": eng.url, "role": eng.role})
        self._event(action, f"new process {eng.uid}" + (f"; {note}" if note else ""))
        return True, note

    async def _engine_calls(self, eng: EngineProc, action: Action) -> bool:
        ok = True
        for c in step_for(action.kind, self.engine_kind).calls:
            ok = await self.call(eng.url + c.path, c.method, dict(c.body) if c.body is not None else None) and ok
        return ok

    async def call(self, url: str, method: str, body: Optional[dict]) -> bool:
        try:
            r = await self.http.request(method, url, json=body)
            return r.status_code < 400
        except httpx.HTTPError:
            return False

    async def _capture(self, eng: EngineProc, action: Action, verdict: Optional[Verdict]) -> Path:
        async def text(path: Optional[str]) -> Optional[str]:
            if path is None:
                return None
            try:
                r = await self.http.get(f"{eng.url}{path}")
                return r.text if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        fetch = step_for(action.kind, self.engine_kind).fetch
        got = dict(zip((what for what, _ in fetch), await asyncio.gather(*(text(path) for _, path in fetch))))
        loads = got.get("loads")
        cm = build_evidence_configmap(
            deployment="local",
            namespace="local",
            pod=eng.key,
            role=eng.role,
            captured_at=time.time(),
            verdict=verdict_to_dict(verdict) if verdict is not None else {},
            stacks=got.get("stacks"),
            loads=json.loads(loads) if loads else None,
            metrics=got.get("metrics"),
            logs=eng.tail(),
            spec_diff="(local deployment: no spec history)",
        )
        # Written beside, then renamed into place: whoever sees the folder sees all of it.
        folder = self.up.evidence_dir / cm["metadata"]["name"]
        partial = self.up.evidence_dir / f".{folder.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for name, content in cm["data"].items():
            write_atomic(partial / name, content)
        write_atomic(partial / "configmap.json", json.dumps(cm, indent=1))
        if folder.exists():  # the same pod captured twice within a stamp: the later one wins
            shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        return folder

    async def close(self) -> None:
        await self.http.aclose()


class LocalDeployment:
    def __init__(self, args: UpArgs):
        self.args = args
        self.window = args.window()  # raises WindowTooShort before anything starts
        self.model = Path(args.model)
        self.state_dir = private_dir(cache_dir() / "up" / str(args.port))
        self.evidence_dir = Path(args.evidence_dir) if args.evidence_dir else self.state_dir / "evidence"
        self.evidence_dir.mkdir(parents=True, exist_ok=True)
        self.token_path = self.state_dir / ADMIN_TOKEN_FILE
        if args.admin_token:
            self.admin_token, self.token_source = args.admin_token, f"given ({F.ADMIN_TOKEN} / {ADMIN_TOKEN_ENV})"
            self.token_path.unlink(missing_ok=True)  # a stale generated token would mislead
        else:
            self.admin_token, self.token_source = stored_secret(self.token_path), str(self.token_path)
        self.secret_path = self.state_dir / PD_SECRET_FILE
        if args.pd_secret:
            self.pd_secret, self.secret_source = args.pd_secret, f"given ({F.PD_SECRET} / {PD_SECRET_ENV})"
            self.secret_path.unlink(missing_ok=True)
        else:
            self.pd_secret, self.secret_source = stored_secret(self.secret_path), str(self.secret_path)
        env = {ADMIN_TOKEN_ENV: self.admin_token, PD_SECRET_ENV: self.pd_secret}

        self.router_url = f"http://{args.host}:{args.port}"
        self.engines: dict[str, EngineProc] = {}
        self._base_cmds: dict[str, list[str]] = {}  # each engine's command without the extra engine args
        self.rolling: set[str] = set()  # engines a reconfigure rollout is probing: not the watchdog's
        port = args.port + 1
        roles = [("mono", 1)] if args.mono else [("prefill", args.prefill), ("decode", args.decode)]
        for role, n in roles:
            for i in range(n):
                key = f"{role}-{i}"
                cmd = [
                    *args.dsv4_command,
                    "serve",
                    F.MODEL,
                    str(self.model),
                    F.ROLE,
                    role,
                    F.HOST,
                    "127.0.0.1",
                    F.PORT,
                    str(port),
                    F.SERVED_MODEL_NAME,
                    self.model.name,
                ]
                bport = None
                if role == "prefill":
                    bport = args.port + 100 + i
                    cmd += [F.BOOTSTRAP_PORT, str(bport)]
                if args.enable_fault_injection:
                    cmd.append(F.ENABLE_FAULT_INJECTION)
                if not args.deadlines:
                    cmd.append(F.NO_DEADLINES)
                self._base_cmds[key] = cmd
                self.engines[key] = EngineProc(
                    key, role, port, self.engine_cmd(key, args.engine_args), self.state_dir / f"{key}.log", bport, env
                )
                port += 1
        self.nodes = make_groups(
            self.engines, self._base_cmds, args.engine_args, args.nnodes, args.port, self.state_dir, env
        )
        router_cmd = [*args.dsv4_command, "router", R.HOST, args.host, R.PORT, str(args.port), R.HEALTH_INTERVAL, "1"]
        for e in self.engines.values():
            router_cmd += [getattr(R, e.role.upper()), e.url]
        # the router renders and tokenizes prompts as the engines do, to place them by what each holds
        router_cmd += [R.TOKENIZER, str(self.model), *_flag_value(args.engine_args, F.CHAT_TEMPLATE, R.CHAT_TEMPLATE)]
        self.router = EngineProc("router", "router", args.port, router_cmd, self.state_dir / "router.log", env=env)
        self.supervisor = Supervisor(
            [*self.engines.values(), *self.node_procs(), self.router],
            self.supervised,
            args.crash_backoff,
            on_change=self.write_processes,
        )
        self.settings = RemediationSettings(
            dry_run=False,
            max_unavailable={
                "prefill": args.max_unavailable,
                "decode": args.max_unavailable,
                "mono": args.max_unavailable,
            },
            cooldown_s=args.cooldown,
            restart_grace_s=1.0,
            recovery_timeout_s=max(120.0, 4 * self.window),
        )
        self.detector = Detector(window_s=self.window)
        self.events: list[dict] = []

    def engine_cmd(self, key: str, engine_args: Sequence[str]) -> list[str]:
        """Engine `key`'s command line with these extra engine args (a reconfigure changes them)."""
        return [*self._base_cmds[key], *engine_args]

    def node_procs(self) -> list[EngineProc]:
        return [n for nodes in self.nodes.values() for n in nodes]

    def group(self, key: str) -> list[EngineProc]:
        """Engine `key`'s processes: itself, and its other nodes (--nnodes)."""
        return [self.engines[key], *self.nodes.get(key, [])]

    async def restart_engine(self, eng: EngineProc, engine_args: Optional[Sequence[str]] = None) -> None:
        """Stop an engine (every node of its group) and start it again, with new extra engine args
        when given: a group starts and restarts as one."""
        procs = self.group(eng.key)
        for p in reversed(procs):
            await asyncio.to_thread(p.stop)
        if engine_args is not None:
            eng.cmd = self.engine_cmd(eng.key, engine_args)
            rebuild(self.nodes.get(eng.key, []), self._base_cmds[eng.key], list(engine_args), self.args.nnodes)
        for p in procs:
            p.start()
        self.write_processes()

    def event(self, reason: str, pod: str, message: str) -> None:
        self._record("watchdog", "red" if reason == "WedgeDetected" else "yellow", reason, pod, message)

    def supervised(self, reason: str, key: str, message: str) -> None:
        self._record("supervisor", "magenta", reason, key, message)

    def _record(self, source: str, colour: str, reason: str, pod: str, message: str) -> None:
        self.events.append({"time": time.time(), "source": source, "reason": reason, "pod": pod, "message": message})
        console.print(f"[{colour}]{source}[/{colour}] {reason} {pod}: {escape(message)}")

    def write_processes(self) -> None:
        """processes.json: each process's PID, restarts and log, for people and tests."""
        doc = {p.key: p.to_dict() for p in [*self.engines.values(), *self.node_procs(), self.router]}
        write_atomic(self.state_dir / "processes.json", json.dumps(doc, indent=1))

    async def _ready(self, client: httpx.AsyncClient, eng: EngineProc) -> bool:
        if not eng.running:
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
            for eng in [*self.engines.values(), *self.node_procs(), self.router]:
                while not await self._ready(client, eng):
                    if eng.popen.poll() is not None:
                        raise RuntimeError(f"{eng.key} exited with {eng.popen.returncode}; see {eng.log_path}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{eng.key} not ready after {timeout:.0f}s; see {eng.log_path}")
                    await asyncio.sleep(0.3)

    async def watch(self, stop: asyncio.Event) -> None:
        executor = LocalExecutor(self)
        loop = WatchdogLoop(self.settings, self.detector, executor, headers=authorization_header(self.admin_token))
        router_watch = RouterWatch(self.window)  # the router as the wedge point (router_watch.py)
        incarnation: dict[str, Optional[str]] = {}
        async with httpx.AsyncClient() as client:
            try:
                while not stop.is_set():
                    started = time.monotonic()
                    for k, e in [*self.engines.items(), *((n.key, n) for n in self.node_procs())]:
                        if incarnation.get(k, e.uid) != e.uid:
                            # A new process is a new pod: what the old one did (or its silence
                            # after a crash) says nothing about it.
                            self.detector.forget(k)
                        incarnation[k] = e.uid
                    ready = dict(
                        zip(
                            self.engines, await asyncio.gather(*(self._ready(client, e) for e in self.engines.values()))
                        )
                    )
                    nodes_ready = dict(
                        zip(
                            [n.key for n in self.node_procs()],
                            await asyncio.gather(*(self._ready(client, n) for n in self.node_procs())),
                        )
                    )
                    pods = {
                        k: unit_info(
                            PodInfo(role=e.role, ready=ready[k], uid=e.uid),
                            [PodInfo(role=n.role, ready=nodes_ready[n.key]) for n in self.nodes.get(k, [])],
                            self.args.nnodes if k in self.nodes else 1,
                        )
                        for k, e in self.engines.items()
                    }
                    # A process that is not running is the supervisor's: crash is not a wedge.
                    # A canary under a rollout's probe is the rollout's to judge (and revert).
                    targets = [
                        ScrapeTarget(p.key, p.url, p.role)
                        for k in self.engines
                        for p in self.group(k)
                        if p.running and k not in self.rolling
                    ]
                    groups = {n.key: k for k, nodes in self.nodes.items() for n in nodes}
                    result = await loop.round(
                        targets,
                        pods,
                        answered_before={p.key: p.ever_ready for k in self.engines for p in self.group(k)},
                        groups=groups,
                    )
                    if self.router.running:
                        said = await router_watch.round(client, self.router_url, self.router.uid)
                        if said is not None:
                            self.event("WedgeDetected", "router", f"{said.get('reason')}: {said.get('details')}")
                    status = {
                        "time": time.time(),
                        "detection_window_s": self.window,
                        "router": router_watch.verdict,
                        **result.summary(),
                        "policy": loop.state.to_dict(),
                        "events": self.events[-50:],
                    }
                    write_atomic(self.state_dir / "status.json", json.dumps(status, indent=1, default=str))
                    elapsed = time.monotonic() - started
                    try:
                        await asyncio.wait_for(stop.wait(), max(0.0, self.args.scrape_interval - elapsed))
                    except asyncio.TimeoutError:
                        pass
            finally:
                await loop.close()
                await executor.close()

    def startup_lines(self) -> list[str]:
        """What `dsv4 up` says once serving: one fact a line, each path whole."""
        a = self.args
        kind = "monolithic" if a.mono else f"prefill x{a.prefill}, decode x{a.decode}"
        if a.nnodes > 1:
            kind += f"; each engine {a.nnodes} node processes (--nnodes)"
        deadlines = engine_deadlines(a.engine_args) if a.deadlines else None
        why = (
            "engine deadlines off"
            if deadlines is None
            else "longer than the engine deadlines: "
            + ", ".join(f"{flag.lstrip('-').removesuffix('-timeout')} {s:g} s" for flag, s in deadlines.items())
        )
        watchdog = f"detection window {self.window:g} s ({why})" if a.watchdog else "off"
        return [
            f"dsv4 up: router on {self.router_url} ({kind})",
            f"  model:       {self.model}",
            f"  state:       {self.state_dir}",
            f"  admin token: {self.token_source}",
            f"  PD secret:   {self.secret_source}",
            f"  evidence:    {self.evidence_dir}",
            f"  watchdog:    {watchdog}",
            f"  try: curl {self.router_url}{Paths.COMPLETIONS} -H 'Content-Type: application/json' "
            f'-d \'{{"prompt": "Hello", "max_tokens": 16}}\'',
        ]

    def announce(self) -> None:
        for line in self.startup_lines():
            console.print(line, markup=False)

    async def run(self) -> None:
        stop = asyncio.Event()
        aloop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            aloop.add_signal_handler(sig, stop.set)
        for eng in [*self.engines.values(), *self.node_procs(), self.router]:
            eng.start()
        self.write_processes()
        supervisor = None
        try:
            await self.wait_ready()
            self.announce()
            supervisor = asyncio.create_task(self.supervisor.run(stop))
            from dsv4_operator.local.reconfigure import serve_requests

            reconfigures = asyncio.create_task(serve_requests(self, stop))
            if self.args.watchdog:
                await self.watch(stop)
            else:
                await stop.wait()
        finally:
            stop.set()
            if supervisor is not None:
                await supervisor
                reconfigures.cancel()
                await asyncio.gather(reconfigures, return_exceptions=True)
            for eng in [self.router, *self.node_procs(), *self.engines.values()]:
                eng.stop()
            console.print("dsv4 up: stopped")


def run_up(args: UpArgs) -> None:
    asyncio.run(LocalDeployment(args).run())
