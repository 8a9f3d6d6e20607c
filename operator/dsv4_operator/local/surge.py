"""`dsv4 up`'s planned restarts without a gap (issue 45): surge, then drain.

A reconfigure, its canary and a revert restart engines on purpose. Stopping the only engine of a
role and starting it again leaves the router no pair for as long as a start takes; a surge
starts the replacement first, on new ports, and the old one leaves only once the router routes
to the new one:
1. the new process starts (same key, same log, new HTTP and bootstrap ports) and gets ready;
2. the router adds it (as a canary, out of the rotation, when the rollout asks) and checks it;
3. the old one leaves the router, drains (SIGTERM: running requests finish within the engine's
   grace; the rest end with an error the router migrates) and stops;
4. the new one takes the old one's place everywhere `dsv4 up` keeps it: the engines, the
   supervisor, the router's command line (a router restarted later must know it), processes.json.

Where resources do not allow it (`surge_by_default`: a GPU, whose memory the running engine sized
its KV pool against; an engine of several node processes; no free port; a replacement that does
not start), the engine restarts in place and the router holds new requests (hold.py, a lease)
until it is back.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import httpx

from dsv4_wire import EngineFlags as F
from dsv4_wire import Paths
from dsv4_wire.serve_options import OPTIONS_BY_NAME

if TYPE_CHECKING:
    from dsv4_operator.local.supervisor import EngineProc

HTTP_PORTS = (1, 100)  # engines' HTTP ports: --port + 1 .. + 99
BOOTSTRAP_PORTS = (100, 200)  # prefill bootstrap ports: --port + 100 .. + 199
SHUTDOWN_GRACE_S = OPTIONS_BY_NAME["shutdown_grace"].default  # the old engine's drain on SIGTERM


def surge_by_default(gpu_present: bool) -> bool:
    """Surge unless the engines run on a GPU: there a second engine would take memory the running
    one counted as its own (`--surge` forces it)."""
    return not gpu_present


def gpu_present() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()


def with_value(cmd: list[str], flag: str, value: str) -> list[str]:
    """`cmd` with `flag`'s value replaced (pure); `flag` must be there as `flag VALUE`."""
    i = cmd.index(flag)
    return [*cmd[: i + 1], value, *cmd[i + 2 :]]


def replaced_url(cmd: list[str], old: str, new: str) -> list[str]:
    """The router's command line with an engine's URL swapped (pure)."""
    return [new if a == old else a for a in cmd]


def pick_port(base: int, span: tuple[int, int], taken: Iterable[int], bindable=None) -> Optional[int]:
    """The first port in base+span that no process of this deployment holds and that binds."""
    bindable = bindable or _bindable
    busy = set(taken)
    for p in range(base + span[0], base + span[1]):
        if p not in busy and bindable(p):
            return p
    return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


async def surge_restart(
    up: Any, eng: "EngineProc", engine_args: list[str], http: httpx.AsyncClient, *, canary: bool, timeout: float = 180.0
) -> Optional["EngineProc"]:
    """Replace `eng` by a new process with `engine_args` (module docstring); the new EngineProc,
    or None when it could not surge (then `eng` is untouched and still serving)."""
    if up.nodes.get(eng.key):
        return None
    procs = [*up.engines.values(), *up.node_procs(), up.router]
    port = pick_port(up.args.port, HTTP_PORTS, [p.port for p in procs])
    bport = None
    if eng.role == "prefill":
        bport = pick_port(up.args.port, BOOTSTRAP_PORTS, [p.bootstrap_port for p in procs if p.bootstrap_port])
    if port is None or (eng.role == "prefill" and bport is None):
        return None
    base = with_value(up._base_cmds[eng.key], F.PORT, str(port))
    if bport is not None:
        base = with_value(base, F.BOOTSTRAP_PORT, str(bport))
    new = replace(eng, port=port, bootstrap_port=bport, cmd=[*base, *engine_args], popen=None, restarts=0, crashes=0)
    up._record("rollout", "cyan", "SurgeStarted", eng.key, f"new process on port {port} before {eng.url} stops")
    new.start()
    if not await _ready(new, http, timeout):
        await asyncio.to_thread(new.stop)
        up._record("rollout", "cyan", "SurgeFailed", eng.key, f"the new process did not get ready; see {new.log_path}")
        return None
    worker = {"url": new.url, "role": new.role, **({"canary": canary} if new.role != "prefill" else {})}
    (await http.post(up.router_url + Paths.ADMIN_WORKERS, json=worker)).raise_for_status()
    deadline = time.monotonic() + timeout
    while not await _router_has(up, http, new.url):  # it checks a worker as it adds it: at most a round
        if time.monotonic() > deadline:
            await asyncio.to_thread(new.stop)
            return None
        await asyncio.sleep(0.2)
    # the swap: from here on `dsv4 up` knows the new process only
    up.engines[eng.key] = new
    up._base_cmds[eng.key] = base
    up.supervisor.procs = [new if p is eng else p for p in up.supervisor.procs]
    up.router.cmd = replaced_url(up.router.cmd, eng.url, new.url)
    up.write_processes()
    await http.request("DELETE", up.router_url + Paths.ADMIN_WORKERS, json={"url": eng.url})
    await asyncio.to_thread(eng.stop, SHUTDOWN_GRACE_S + 5.0)  # the engine's own drain, then a kill
    up._record("rollout", "cyan", "SurgeDone", eng.key, f"{new.url} serves; {eng.url} drained and stopped")
    return new


async def _ready(eng: "EngineProc", http: httpx.AsyncClient, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not eng.running:
            return False
        try:
            if (await http.get(eng.url + Paths.READY, timeout=2.0)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)
    return False


async def _router_has(up: Any, http: httpx.AsyncClient, url: str) -> bool:
    try:
        workers = (await http.get(up.router_url + Paths.ADMIN_WORKERS)).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return any(w["url"] == url and w["healthy"] for w in workers)


HOLD_S = 210.0  # an engine's start (the rollout's ready timeout) and a margin


async def set_hold(up: Any, http: httpx.AsyncClient, reason: Optional[str]) -> None:
    """The router's planned hold (router hold.py) on for as long as a start may take, or off."""
    try:
        if reason is None:
            await http.delete(up.router_url + Paths.ADMIN_HOLD)
        else:
            await http.post(up.router_url + Paths.ADMIN_HOLD, json={"seconds": HOLD_S, "reason": reason})
    except httpx.HTTPError:  # a router that is restarting holds for --engine-wait-timeout by itself
        pass


async def hold_while_restarting(up: Any, http: httpx.AsyncClient, eng: "EngineProc") -> None:
    """A remediation restarts `eng` in place: when it is the only engine of its role, the router
    holds new requests until it is ready again (a task lifts the hold then; the lease bounds it)."""
    if sum(e.role == eng.role for e in up.engines.values()) > 1:
        return
    await set_hold(up, http, f"restart of {eng.key}, the only {eng.role} engine")

    async def lift() -> None:
        await asyncio.sleep(1.0)  # the old process is gone by then
        await _ready(eng, http, HOLD_S)
        await set_hold(up, http, None)

    task = asyncio.create_task(lift())
    _LIFTS.add(task)
    task.add_done_callback(_LIFTS.discard)


_LIFTS: set = set()  # running lift tasks (kept referenced until done)
