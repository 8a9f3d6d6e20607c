"""The router pods under the watchdog (issue 45), pure: which pods are the deployment's routers,
and what to do about a wedged one.

A router can be the wedge point while every engine idles (requests held inside it, none sent on:
hangs.router_stalled), or be frozen with its sockets open (its /metrics unanswered: unresponsive).
The same detector as the engines' judges each router pod (signals kind ROUTER). Router replicas
are a Deployment's pods: one is restarted (evicted; its ReplicaSet makes a new one) only while
another replica is ready and answering, one at a time and not again within the cooldown; else
the wedge is reported only (an Event and the status), never acted on -- the operator never
restarts pods it merely cannot reach, nor takes away the last router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from dsv4_wire import controller_of

from dsv4_operator.manifests import HTTP_PORT_NAME, child_name

RESTART = "restart"
REPORT = "report"


@dataclass(frozen=True)
class RouterPod:
    name: str
    uid: str
    url: Optional[str]  # http://ip:port, None while it has no address
    ready: bool  # its Ready condition


def router_pods(objs: Iterable[Mapping[str, Any]], deployment: str, default_port: int) -> list[RouterPod]:
    """The deployment's router pods: controlled by a ReplicaSet of its router Deployment (labels
    alone can be put on any pod), not being deleted."""
    out = []
    prefix = child_name(deployment, "router") + "-"
    for pod in objs:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        kind, name = controller_of(meta) or ("", "")
        if kind != "ReplicaSet" or not name.startswith(prefix) or meta.get("deletionTimestamp"):
            continue
        port = default_port
        for c in (pod.get("spec") or {}).get("containers") or []:
            for cp in c.get("ports") or []:
                if cp.get("name") == HTTP_PORT_NAME:
                    port = int(cp["containerPort"])
        ip = status.get("podIP")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        out.append(RouterPod(meta["name"], meta.get("uid", ""), f"http://{ip}:{port}" if ip else None, ready))
    return sorted(out, key=lambda p: p.name)


@dataclass(frozen=True)
class RouterStep:
    pod: str
    uid: str
    action: str  # RESTART | REPORT
    why: str


def decide_routers(
    pods: list[RouterPod],
    wedged: Mapping[str, str],
    answering: set[str],
    *,
    now: float,
    last_restart_at: Optional[float],
    cooldown_s: float,
    dry_run: bool,
) -> list[RouterStep]:
    """One step per wedged router pod. `wedged`: pod -> the wedge reason; `answering`: pods whose
    scrape this round was answered and judged not wedged."""
    steps = []
    restarted = False
    by_name = {p.name: p for p in pods}
    for name in sorted(wedged):
        pod = by_name.get(name)
        if pod is None:
            continue
        others = sorted(p.name for p in pods if p.name != name and p.ready and p.name in answering)
        since = None if last_restart_at is None else now - last_restart_at
        if dry_run:
            steps.append(RouterStep(name, pod.uid, REPORT, "dry run: reported only"))
        elif not others:
            steps.append(
                RouterStep(name, pod.uid, REPORT, "no other router replica is ready and answering: reported only")
            )
        elif restarted or (since is not None and since < cooldown_s):
            steps.append(
                RouterStep(name, pod.uid, REPORT, f"a router was restarted {since or 0:.0f} s ago: one at a time")
            )
        else:
            restarted = True
            steps.append(RouterStep(name, pod.uid, RESTART, f"{', '.join(others)} ready and answering"))
    return steps
