"""`dsv4 up --reconfigure`: change the engines' flags of a running `dsv4 up`, proven by a canary.

The running `dsv4 up` (LocalDeployment) polls its state folder for a request file; `dsv4 up
--reconfigure --engine-arg ...` writes one and waits for the answer. Keeping it to two files in
the 0700 state folder needs no new listener, port or token.

The rollout (`LocalRollout.run`), one engine at a time:
1. the stable revision's figures: the probe against the canary engine (decode-0, or mono-0) as it is;
2. the canary leaves the normal rotation (the router's canary flag; when it is the only engine
   of its role it keeps its traffic, nothing else could serve it), its running requests finish
   or migrate (router migration, docs/migration.md) while it restarts with the new flags;
3. the probe again, pinned to it, with the wedge detector watching: `canary.verdict.judge`;
4. pass: the canary rejoins the rotation and the rest restart with the new flags, prefills first;
   fail: the canary restarts with the old flags and rejoins; evidence (verdict, figures, the
   canary's log) is written under the evidence folder. The engines' flags change only on a pass.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import httpx

from dsv4_wire import Paths, authorization_header

from dsv4_operator.canary.conversation import ConversationShape
from dsv4_operator.canary.probe import ProbeSettings, run_probe
from dsv4_operator.canary.verdict import CanaryThresholds, judge
from dsv4_operator.local.state_files import write_atomic
from dsv4_operator.local.surge import set_hold, surge_restart


if TYPE_CHECKING:
    from dsv4_operator.local.supervisor import EngineProc


READY_TIMEOUT_S = 180.0  # an engine's start, restarted with new flags
REQUEST_FILE = "reconfigure-request.json"
RESULT_FILE = "reconfigure-result.json"


@dataclass
class ReconfigureRequest:
    engine_args: list[str]
    probe: dict = field(default_factory=dict)  # ProbeSettings fields, shape ones under "shape"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def settings(self) -> ProbeSettings:
        p = dict(self.probe)
        shape = ConversationShape(**p.pop("shape", {}))
        return ProbeSettings(shape=shape, **p)


def submit(state_dir: Path, request: ReconfigureRequest, timeout: float) -> dict:
    """The client side: hand the request to the running `dsv4 up` and wait for its result."""
    if not (state_dir / "processes.json").exists():
        raise RuntimeError(f"no running `dsv4 up` found in {state_dir} (start it, or give its --port)")
    write_atomic(state_dir / REQUEST_FILE, json.dumps(asdict(request)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = json.loads((state_dir / RESULT_FILE).read_text())
            if result.get("id") == request.id:
                return result
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"`dsv4 up` did not answer the reconfigure request within {timeout:.0f} s")


def take_request(state_dir: Path) -> Optional[ReconfigureRequest]:
    path = state_dir / REQUEST_FILE
    try:
        doc = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        return None
    return ReconfigureRequest(**doc)


def canary_key(engines: dict) -> str:
    """The engine that goes first: a decode (the incident was in decode), else the monolith."""
    for role in ("decode", "mono"):
        keys = sorted(k for k, e in engines.items() if e.role == role)
        if keys:
            return keys[0]
    raise ValueError("no decode or mono engine to use as the canary")


class LocalRollout:
    """`up`: the running dsv4_operator.local.up.LocalDeployment (not imported: local imports this module)."""

    def __init__(self, up: Any, request: ReconfigureRequest, thresholds: CanaryThresholds = CanaryThresholds()):
        self.up = up
        self.request = request
        self.settings = request.settings()
        self.thresholds = thresholds
        self.http = httpx.AsyncClient(timeout=10.0, headers=authorization_header(up.admin_token))

    def event(self, reason: str, pod: str, message: str) -> None:
        self.up._record("rollout", "cyan", reason, pod, message)

    async def _router(self, method: str, body: dict) -> None:
        r = await self.http.request(method, self.up.router_url + Paths.ADMIN_WORKERS, json=body)
        r.raise_for_status()

    async def _wait_ready(self, eng: "EngineProc", timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (await self.http.get(eng.url + Paths.READY, timeout=2.0)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if eng.popen is not None and eng.popen.poll() is not None:
                raise RuntimeError(
                    f"{eng.key} exited with {eng.popen.returncode} under the new flags; see {eng.log_path}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{eng.key} not ready after {timeout:.0f} s; see {eng.log_path}")
            await asyncio.sleep(0.3)
        # the router must see it ready too before a pinned request can reach it
        while time.monotonic() < deadline:
            r = await self.http.get(self.up.router_url + Paths.ADMIN_WORKERS)
            if any(w["url"] == eng.url and w["healthy"] for w in r.json()["workers"]):
                return
            await asyncio.sleep(0.3)

    async def _idle(self, eng: "EngineProc", timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                loads = (await self.http.get(eng.url + Paths.LOADS)).json()
                if sum(v for v in loads.get("queues", {}).values() if isinstance(v, (int, float))) == 0:
                    return
            except (httpx.HTTPError, ValueError):
                return
            await asyncio.sleep(0.2)

    async def _restart(
        self, eng: "EngineProc", engine_args: list[str], *, out_of_rotation: bool, drain_s: float = 10.0
    ) -> "EngineProc":
        """Restart one engine with `engine_args`; the engine that serves afterwards. A surge where
        it can (surge.py: the new process is ready and routed to before the old one drains), else
        in place: out of the rotation first when another engine of its role can serve (its running
        requests finish within a bound, the rest migrate when it stops), or, when it is the only
        one, behind the router's hold (new requests wait for it, not a 503). Back in the rotation
        once ready unless `out_of_rotation` (a canary stays out until its verdict)."""
        role = eng.role
        alone = sum(e.role == role for e in self.up.engines.values()) == 1
        if self.up.args.surge:
            new = await surge_restart(
                self.up, eng, engine_args, self.http, canary=out_of_rotation and role != "prefill" and not alone
            )
            if new is not None:
                return new
        if role != "prefill" and not alone:
            await self._router("POST", {"url": eng.url, "role": role, "canary": True})
            await self._idle(eng, timeout=drain_s)
        hold = alone
        if hold:
            await set_hold(self.up, self.http, f"restart of {eng.key}, the only {role} engine")
        try:
            await self.up.restart_engine(eng, engine_args)  # every node of its group, with --nnodes
            await self._wait_ready(eng)
        finally:
            if hold:
                await set_hold(self.up, self.http, None)
        if role != "prefill" and not alone and not out_of_rotation:
            await self._router("POST", {"url": eng.url, "role": role, "canary": False})
        return eng

    async def _probe(self, eng: "EngineProc"):
        return await run_probe(
            self.up.router_url,
            eng.url,
            eng.role,
            self.settings,
            pin=eng.url,
            admin_token=self.up.admin_token,
            router_token=self.up.admin_token,  # `dsv4 up` gives its router the engines' token
        )

    async def run(self) -> dict:
        started = time.monotonic()
        old, new = list(self.up.args.engine_args), list(self.request.engine_args)
        key = canary_key(self.up.engines)
        eng = self.up.engines[key]
        self.up.rolling.add(key)  # the fleet's watchdog leaves the canary to the probe
        result: dict = {"id": self.request.id, "canary": key, "old_engine_args": old, "new_engine_args": new}
        phases: dict = result.setdefault("phases_s", {})  # where the time went: probes are bounded, restarts not

        def lap(name: str, since: float) -> float:
            now = time.monotonic()
            phases[name] = round(now - since, 3)
            return now

        try:
            self.event("CanaryBaseline", key, "probing the stable revision")
            t = time.monotonic()
            stable, _ = await self._probe(eng)
            t = lap("stable_probe", t)
            self.event("CanaryStarted", key, f"restarting with {new}")
            try:
                eng = await self._restart(eng, new, out_of_rotation=True)
                t = lap("canary_restart", t)
                figures, signals = await self._probe(eng)
                t = lap("canary_probe", t)
                verdict = judge(figures, stable, signals, self.thresholds)
            except (RuntimeError, TimeoutError) as e:  # it would not even start under the new flags
                from dsv4_operator.canary.verdict import CanaryVerdict

                verdict = CanaryVerdict(False, (f"the canary did not start: {e}",), {}, stable.to_dict())
            result["verdict"] = verdict.to_dict()
            if verdict.passed:
                self.event("CanaryPassed", key, verdict.summary())
                await self._router("POST", {"url": eng.url, "role": eng.role, "canary": False})
                rest = sorted(
                    (k for k in self.up.engines if k != key), key=lambda k: (self.up.engines[k].role != "prefill", k)
                )
                for k in rest:
                    self.event("RolloutStep", k, f"restarting with {new}")
                    await self._restart(self.up.engines[k], new, out_of_rotation=False)
                t = lap("roll_rest", t)
                self.up.args.engine_args = new
                self.event("RolloutComplete", "all", f"engines run with {new}")
                result["kept"] = True
            else:
                self.event("CanaryFailed", key, verdict.summary())
                result["evidence"] = str(self._evidence(eng, verdict.to_dict()))
                eng = await self._restart(eng, old, out_of_rotation=False, drain_s=0.0)
                t = lap("revert", t)
                self.event("CanaryReverted", key, f"back on {old}")
                result["kept"] = False
        finally:
            self.up.rolling.discard(key)
            await self.http.aclose()
        result["duration_s"] = round(time.monotonic() - started, 3)
        return result

    def _evidence(self, eng: "EngineProc", verdict: dict) -> Path:
        folder = self.up.evidence_dir / f"canary-{eng.key}-{int(time.time())}"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(
            folder / "verdict.json", json.dumps({**verdict, "engine_args": self.request.engine_args}, indent=1)
        )
        write_atomic(folder / "log.txt", "".join(eng.tail()))
        return folder


async def serve_requests(up: Any, stop: asyncio.Event, poll_s: float = 0.5) -> None:
    """The running `dsv4 up`'s side: take each request from the state folder, roll, answer."""
    while not stop.is_set():
        request = take_request(up.state_dir)
        if request is not None:
            try:
                result = await LocalRollout(up, request).run()
            except Exception as e:  # answer the client whatever happened
                result = {"id": request.id, "kept": False, "error": f"{type(e).__name__}: {e}"}
            write_atomic(up.state_dir / RESULT_FILE, json.dumps(result, indent=1, default=str))
        try:
            await asyncio.wait_for(stop.wait(), poll_s)
        except asyncio.TimeoutError:
            pass
