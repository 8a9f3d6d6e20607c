"""The planner on a real system: the real operator against the strict emulated API server
(bench/harness/kmock_cluster.py), real `dsv4 serve` engines as the deployment's pods and the real
router discovering them (bench/harness/planner_fleet.py). A load step up makes the planner add a decode replica, a
step down makes it drain one and remove it, the StatefulSet's replicas follow the Events'
decisions, and no client request fails across the scale-down.

The ITL target is set from the decode engine's own step time at one stream (four times it):
one replica then serves a light load within the target and not a heavy one, whatever the speed of
the machine. The short form runs in the default suite; the heavy form (both roles planned, several
steps up and down) is behind `slow`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually
from bench.harness.planner_fleet import Fleet, Load, start_router

from dsv4_wire import ANNOTATION_PLANNER_DRAIN, LABEL_DRAINING, Paths

NS = "serving"
NAME = "flash"
API = "serving.dsv4.dev/v1alpha1"


def resource(planner: dict) -> dict:
    """Both roles at one replica, scaled by the operator: the planner takes them over once the ITL
    target is measured (calibrate_and_plan)."""
    return {
        "apiVersion": API,
        "kind": "DSV4Deployment",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"name": "m", "path": "/models/m"},
            "engine": {"image": "reg/dsv4:1"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "router": {"replicas": 0},
            "planner": planner,
        },
    }


@pytest.fixture(autouse=True)
def watch_true(monkeypatch):
    """kubernetes_asyncio (the router's discovery) sends watch=True; the API server parses booleans
    as Go does ("True" is true), kmock only knows "true": fill that gap on the emulator's side (as
    tests/integration/router/test_router_discovery.py does)."""
    from kmock._internal import parsing

    guess = parsing.guess_k8s
    monkeypatch.setattr(
        parsing,
        "guess_k8s",
        lambda k8s, method, query: guess(
            k8s, method, {**query, **({"watch": "true"} if str(query.get("watch", "")).lower() == "true" else {})}
        ),
    )


def planner_events(cluster: KubeCluster) -> list[dict]:
    found = [e for e in cluster.objects_of("v1/events", NS) if e["involvedObject"].get("name") == NAME]
    return [e for e in found if e["reason"].startswith("Planner")]


async def replicas(client: ClusterClient, role: str) -> int:
    sts = await client.get("apps/v1", "statefulsets", NS, f"{NAME}-{role}")
    return int((sts or {}).get("spec", {}).get("replicas", -1))


async def step_seconds(url: str, headers: dict) -> float:
    """The engine's mean decode step so far (its /v1/loads step totals)."""
    async with httpx.AsyncClient(timeout=5, headers=headers) as http:
        steps = (await http.get(url + Paths.LOADS)).json()["steps"]["decode"]
    return steps["seconds"] / steps["steps"]


async def bring_up(cluster, client, kubeconfig, operator_factory, model, tmp, planner, spares=None):
    await operator_factory([NS])
    await client.create(resource(planner), "dsv4deployments")
    fleet = await Fleet(client, NS, NAME, Path(model), tmp, spares=spares or {}).start()
    router, r_url = start_router(kubeconfig, NS, NAME, tmp, fleet.env)  # starts while the engines load
    try:
        await eventually(lambda: fleet.ready_count("prefill") == 1 and fleet.ready_count("decode") == 1, timeout=180)
        await asyncio.to_thread(router.wait_ready, r_url, 60)
        await asyncio.to_thread(router.wait_workers_healthy, r_url, 2, 60)
    except BaseException:  # no engine or router left behind
        router.stop()
        await fleet.stop()
        raise
    return fleet, router, r_url


async def calibrate_and_plan(
    client: ClusterClient, fleet: Fleet, r_url: str, roles: tuple = ("decode",), factor: float = 4.0
) -> float:
    """Four times one engine's decode step at a single stream, set in the resource: a few streams
    fit one replica with room for a busy machine's noise, two dozen do not. Then `roles` switch to
    `scaling: planner` (their running count handed over to it)."""
    one = Load(r_url, max_tokens=32)
    await one.set_clients(1)
    await eventually(lambda: one.ok >= 1, timeout=60)
    await one.stop()
    assert not one.failures, one.failures
    target = factor * await step_seconds(fleet.url(f"{NAME}-decode-0"), fleet.admin_headers)
    patch = {"planner": {"itlTargetSeconds": round(target, 4)}, **{r: {"scaling": "planner"} for r in roles}}
    await client.patch(API, "dsv4deployments", NS, NAME, {"spec": patch})
    return target


async def test_a_load_step_up_and_down_changes_decode_replicas_and_no_request_fails(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, kubeconfig, operator_factory, tiny_model, tmp_path
) -> None:
    planner = {
        "intervalSeconds": 1,
        "decode": {"minReplicas": 1, "maxReplicas": 2},
        "scaleDownCooldownSeconds": 5,
        "startupSeconds": 5,
        "drainTimeoutSeconds": 30,
    }
    # a decode engine loads beside the first two (a node with the engine warm): the scale-up's pod
    # serves once the planner asks for it, which keeps this form short; the slow form starts cold
    fleet, router, r_url = await bring_up(
        cluster_with_crd, kube_client, kubeconfig, operator_factory, tiny_model, tmp_path, planner, {"decode": 1}
    )
    load = Load(r_url, max_tokens=32)
    try:
        target = await calibrate_and_plan(kube_client, fleet, r_url)
        # Step up: many streams on the one decode engine -> the planner asks for a second.
        await load.set_clients(24)
        await eventually(lambda: _is(replicas(kube_client, "decode"), 2), timeout=90)
        await eventually(lambda: fleet.ready_count("decode") == 2, timeout=120)
        await asyncio.to_thread(router.wait_workers_healthy, r_url, 3, 60)
        await eventually(lambda: _running(fleet.url(f"{NAME}-decode-1"), fleet.admin_headers), timeout=30)  # serves
        # Step down: two streams -> after the cool-down, decode-1 is drained, then removed.
        await load.set_clients(2)
        drained = await eventually(lambda: _drained_pod(kube_client), timeout=90)
        assert drained["metadata"]["name"] == f"{NAME}-decode-1"
        await eventually(lambda: _is(replicas(kube_client, "decode"), 1), timeout=90)
        await eventually(lambda: f"{NAME}-decode-1" not in fleet.pods, timeout=60)
        ok_before = load.ok
        await eventually(lambda: load.ok >= ok_before + 2, timeout=60)  # traffic goes on after the scale-down
    finally:
        for e in planner_events(cluster_with_crd):
            print(e["reason"], e["message"])
        await load.stop()
        router.stop()
        await fleet.stop()
    assert not load.failures, f"{len(load.failures)} failed requests: {load.failures[:5]}\n{fleet.logs()}"
    events = planner_events(cluster_with_crd)
    reasons = [e["reason"] for e in events]
    assert "PlannerScaleUp" in reasons and "PlannerDrain" in reasons and "PlannerScaleDown" in reasons, reasons
    up = next(e for e in events if e["reason"] == "PlannerScaleUp")
    assert up["message"].startswith("decode 1 -> 2") and "gen tok/s" in up["message"] and "ITL" in up["message"], up
    assert f"{target:.3f}" in up["message"] or "target" in up["message"]
    drain = next(e for e in events if e["reason"] == "PlannerDrain")
    assert f"draining {NAME}-decode-1" in drain["message"], drain
    down = next(e for e in events if e["reason"] == "PlannerScaleDown")
    assert "-> 1" in down["message"], down
    # the StatefulSet's replicas changed as the decisions said, in that order (a busy machine may make
    # the light load look heavy again afterwards: only the first round is checked)
    order = [ev for _, ev, pod in fleet.timeline if pod.endswith("decode-1")]
    assert order[:2] == ["created", "ready"] and "stopped" in order, order
    assert order.index("deleted") < order.index("stopped"), order
    assert load.ok > 0


async def _is(value, want) -> bool:
    return (await value) == want


async def _at_least(value, want) -> bool:
    return (await value) >= want


async def _running(url: str, headers: dict) -> bool:
    async with httpx.AsyncClient(timeout=2, headers=headers) as http:
        loads = (await http.get(url + Paths.LOADS)).json()
    return loads["counters"].get("generation_tokens", 0) > 0


async def _drained_pod(client: ClusterClient):
    for pod in await client.list("v1", "pods", NS):
        meta = pod["metadata"]
        if (meta.get("labels") or {}).get(LABEL_DRAINING) == "true" and (meta.get("annotations") or {}).get(
            ANNOTATION_PLANNER_DRAIN
        ):
            return pod
    return None


@pytest.mark.slow
async def test_heavy_both_roles_planned_two_steps_up_and_down_no_request_fails(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, kubeconfig, operator_factory, tiny_model, tmp_path
) -> None:
    """Both roles planned (up to 2 prefill, 3 decode), two rounds of heavy then light load: decode
    scales up and back to one each round, every scale-down under traffic, no request fails."""
    planner = {
        "intervalSeconds": 2,
        "ttftTargetSeconds": 0.5,
        "prefill": {"minReplicas": 1, "maxReplicas": 2},
        "decode": {"minReplicas": 1, "maxReplicas": 3},
        "scaleDownCooldownSeconds": 10,
        "startupSeconds": 5,
        "drainTimeoutSeconds": 30,
    }
    fleet, router, r_url = await bring_up(
        cluster_with_crd, kube_client, kubeconfig, operator_factory, tiny_model, tmp_path, planner
    )
    load = Load(r_url, max_tokens=64)
    seen: list[tuple[float, int, int]] = []
    try:
        await calibrate_and_plan(kube_client, fleet, r_url, ("prefill", "decode"))
        for _ in range(2):
            await load.set_clients(40)
            await eventually(lambda: _at_least(replicas(kube_client, "decode"), 2), timeout=150)
            up = await replicas(kube_client, "decode")
            await eventually(lambda: fleet.ready_count("decode") >= up, timeout=150)
            seen.append(
                (time.monotonic(), await replicas(kube_client, "prefill"), await replicas(kube_client, "decode"))
            )
            await load.set_clients(2)
            await eventually(lambda: _is(replicas(kube_client, "decode"), 1), timeout=240)
            await eventually(
                lambda: (
                    fleet.ready_count("decode") == 1
                    and len([p for p in fleet.pods.values() if p.role == "decode"]) == 1
                ),
                timeout=120,
            )
            seen.append(
                (time.monotonic(), await replicas(kube_client, "prefill"), await replicas(kube_client, "decode"))
            )
    finally:
        for e in planner_events(cluster_with_crd):
            print(e["reason"], e["message"])
        await load.stop()
        router.stop()
        await fleet.stop()
    assert not load.failures, f"{len(load.failures)} failed requests: {load.failures[:5]}\n{fleet.logs()}"
    events = planner_events(cluster_with_crd)
    downs = [e for e in events if e["reason"] == "PlannerScaleDown" and e["message"].startswith("decode")]
    assert len(downs) >= 2, [e["message"] for e in events]
    decode = [d for _, _, d in seen]
    assert decode[0] >= 2 and decode[1] == 1 and decode[2] >= 2 and decode[3] == 1, seen
