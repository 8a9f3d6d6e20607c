"""The canary step of an engine rollout, with the real operator (kopf, reconciler, canary daemon)
against the emulated API server and engines that a stand-in StatefulSet controller starts from the
live StatefulSets (canary_fleet.py):
- a change whose engine stalls once a conversation's context grows (the incident's shape) is
  caught on ONE decode pod, which goes back to the stable revision; status says
  Degraded=CanaryFailed with the figures and an evidence ConfigMap; the spec is untouched; prefill
  never moved;
- a harmless change passes the probe and rolls to every pod.
The engines and the router stand-ins check their own tokens (the engines' admin token, the
router-admin token): the canary's calls must carry the right one to each."""

from __future__ import annotations

import json
import time
from typing import Optional


from bench.harness.canary_fleet import STALL_AFTER, FakeFleet  # noqa: E402
from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually  # noqa: E402
from test_operator_kmock import API, PLURAL, condition, deployment, get_cr  # noqa: E402

import pytest  # noqa: E402

from dsv4_operator.canary.plan import ANNOTATION_CANARY  # noqa: E402

NS = "ns1"
# Latency ratios loose: these fakes share one loaded process with the emulator and the operator, so
# their TTFT/ITL are noise (the ratios are judged in tests/unit/canary/test_verdict.py).
PROBE = {
    "durationSeconds": 3,
    "requestTimeoutSeconds": 2,
    "concurrency": 2,
    "readyTimeoutSeconds": 30,
    "maxTtftRatio": 20,
    "maxItlRatio": 20,
}


def spec(**extra) -> dict:
    return deployment(
        "flash",
        NS,
        prefill={"replicas": 2},
        decode={"replicas": 3},
        remediation={"enabled": False},
        rollout={"canary": PROBE},
        **extra,
    )


async def baseline_recorded(client: ClusterClient) -> Optional[dict]:
    cr = await get_cr(client, NS, "flash")
    ann = ((cr or {}).get("metadata") or {}).get("annotations") or {}
    return cr if ANNOTATION_CANARY in ann else None


def reasons(cluster: KubeCluster) -> list[str]:
    return [
        e["reason"]
        for e in sorted(
            cluster.objects_of("v1/events", NS), key=lambda e: e.get("firstTimestamp") or e.get("eventTime") or ""
        )
        if e["involvedObject"].get("name") == "flash"
    ]


async def start(cluster: KubeCluster, client: ClusterClient, operator_factory) -> FakeFleet:
    await operator_factory([NS])
    await client.create(spec(), PLURAL)
    fleet = await FakeFleet(client, NS, "flash").start()
    await eventually(lambda: baseline_recorded(client), timeout=20)

    async def all_up() -> bool:
        return len(fleet.roles("decode")) == 3 and len(fleet.roles("prefill")) == 2

    await eventually(all_up, timeout=20)
    return fleet


@pytest.mark.slow  # ~25 s: two probes of a few seconds, pods recreated twice
async def test_a_change_that_stalls_long_contexts_is_caught_and_rolled_back(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    fleet = await start(cluster_with_crd, kube_client, operator_factory)
    try:
        applied = time.monotonic()
        await kube_client.patch(API, PLURAL, NS, "flash", {"spec": {"engine": {"image": "reg/dsv4:stall"}}})

        async def moved() -> bool:
            return fleet.images.get("flash-decode-2") == "reg/dsv4:stall"

        await eventually(moved, timeout=20)
        assert fleet.images_of("decode")[:2] == ["reg/dsv4:1"] * 2, "only the highest ordinal moves"
        assert fleet.images_of("prefill") == ["reg/dsv4:1"] * 2, "prefill is held while decode is probed"

        async def failed() -> Optional[dict]:
            cr = await get_cr(kube_client, NS, "flash")
            ok = (
                condition(cr, "Degraded").get("reason") == "CanaryFailed"
                and fleet.images.get("flash-decode-2") == "reg/dsv4:1"
            )
            return cr if ok else None

        cr = await eventually(failed, timeout=40)
        caught = time.monotonic() - applied
        canary = cr["status"]["canary"]
        assert canary["phase"] == "Failed" and canary["pod"] == "flash-decode-2"
        figures = canary["figures"]
        assert figures["canary"]["stalled"] >= 1, figures
        assert figures["stable"]["stalled"] == 0 and figures["stable"]["max_context"] > STALL_AFTER, figures
        assert "no answer" in condition(cr, "Degraded")["message"]
        assert cr["spec"]["engine"]["image"] == "reg/dsv4:stall", "the spec is untouched"
        assert cr["status"]["pinnedRevision"], "the children run the stable revision"
        evidence = await kube_client.get("v1", "configmaps", NS, canary["evidence"])
        assert json.loads(evidence["data"]["verdict.json"])["passed"] is False
        assert fleet.images_of("prefill") == ["reg/dsv4:1"] * 2 and fleet.images_of("decode") == ["reg/dsv4:1"] * 3
        touched = {pod for when, pod, _ in fleet.timeline if when >= applied}
        assert touched == {"flash-decode-2"}, f"only the canary pod was ever restarted: {touched}"
        assert any(flag for _, flag in fleet.router.flag_calls), "the canary left the router's rotation"
        assert not fleet.router.refused, f"the router refused the operator's admin calls: {fleet.router.refused}"
        seen = reasons(cluster_with_crd)
        for step in ("CanaryStarted", "CanaryProbing", "CanaryFailed"):
            assert step in seen, seen
        assert caught < 40
    finally:
        await fleet.stop()


@pytest.mark.slow  # ~20 s
async def test_a_harmless_change_passes_and_rolls_everywhere(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    fleet = await start(cluster_with_crd, kube_client, operator_factory)
    try:
        # with a share of live traffic for the canary while it is probed (trafficPercent)
        await kube_client.patch(
            API,
            PLURAL,
            NS,
            "flash",
            {"spec": {"engine": {"image": "reg/dsv4:2"}, "rollout": {"canary": {"trafficPercent": 10}}}},
        )

        async def rolled() -> bool:
            return fleet.images_of("decode") == ["reg/dsv4:2"] * 3 and fleet.images_of("prefill") == ["reg/dsv4:2"] * 2

        await eventually(rolled, timeout=40)
        first = [pod for _, pod, image in fleet.timeline if image == "reg/dsv4:2"]
        assert first[0] == "flash-decode-2", f"the canary moves first: {first}"
        cr = await get_cr(kube_client, NS, "flash")
        assert cr["status"]["canary"]["phase"] == "Passed"
        assert condition(cr, "Degraded")["status"] == "False"
        seen = reasons(cluster_with_crd)
        assert "CanaryPassed" in seen and "CanaryFailed" not in seen, seen
        assert fleet.router.canary.get(fleet.engines["flash-decode-2"].url) in (None, False)
        assert (True, 10.0) in fleet.router.shares and fleet.router.shares[-1] == (False, 0.0), fleet.router.shares
        assert not fleet.router.refused, f"the router refused the operator's admin calls: {fleet.router.refused}"
    finally:
        await fleet.stop()


async def test_traffic_percent_is_bounded_by_the_api_server(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    from bench.harness.kmock_cluster import ClusterError

    try:
        await kube_client.create(deployment("flash", NS, rollout={"canary": {"trafficPercent": 51}}), PLURAL)
    except ClusterError as e:
        assert "trafficPercent" in str(e) and "50" in str(e)
    else:
        raise AssertionError("the API server took trafficPercent > 50")
    await kube_client.create(deployment("flash", NS, rollout={"canary": {"trafficPercent": 10}}), PLURAL)


@pytest.mark.slow  # ~20 s
async def test_the_canary_passes_through_the_real_router_holding_its_own_token(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory, tmp_path
) -> None:
    """The real `dsv4 router` (its pin and canary paths, its router-admin token from the Secret)
    in front of the engine stand-ins: the probe's pinned requests and the canary flag pass its
    token check, the canary passes, the change rolls everywhere, the flag is cleared."""
    import httpx

    await operator_factory([NS])
    await kube_client.create(spec(), PLURAL)
    real = {"logs": tmp_path, "replicas": {"prefill": 2, "decode": 3}}
    fleet = await FakeFleet(kube_client, NS, "flash", real_router=real).start()
    try:
        await eventually(lambda: baseline_recorded(kube_client), timeout=20)
        await kube_client.patch(API, PLURAL, NS, "flash", {"spec": {"engine": {"image": "reg/dsv4:2"}}})

        async def rolled() -> bool:
            return fleet.images_of("decode") == ["reg/dsv4:2"] * 3 and fleet.images_of("prefill") == ["reg/dsv4:2"] * 2

        await eventually(rolled, timeout=60)
        cr = await get_cr(kube_client, NS, "flash")
        assert cr["status"]["canary"]["phase"] == "Passed", cr["status"]["canary"]
        figures = cr["status"]["canary"]["figures"]
        assert figures["canary"]["errors"] == 0 and figures["canary"]["requests"] > 0, figures
        headers = {"Authorization": f"Bearer {fleet.router.admin_token}"}
        workers = httpx.get(fleet.router_url + "/admin/workers", headers=headers, timeout=5).json()["workers"]
        assert not any(w["canary"] for w in workers), workers
        seen = reasons(cluster_with_crd)
        assert "CanaryPassed" in seen and "CanaryFailed" not in seen, seen
    finally:
        await fleet.stop()


@pytest.mark.slow  # ~20 s
async def test_an_autoscaled_decode_role_probes_its_highest_live_pod(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """decode's count is not the spec's (`scaling: external`, as with the planner): an autoscaler
    made it 4 where the spec says 3. The canary is the highest live ordinal, flash-decode-3, and
    moves first and alone; the spec's count would have picked flash-decode-2 and moved two pods."""
    await operator_factory([NS])
    await kube_client.create(
        deployment(
            "flash",
            NS,
            prefill={"replicas": 2},
            decode={"replicas": 3, "scaling": "external"},
            remediation={"enabled": False},
            rollout={"canary": PROBE},
        ),
        PLURAL,
    )
    fleet = await FakeFleet(kube_client, NS, "flash").start()
    try:
        await eventually(lambda: baseline_recorded(kube_client), timeout=20)
        await eventually(lambda: len(fleet.roles("decode")) == 3, timeout=20)
        await kube_client.patch("apps/v1", "statefulsets", NS, "flash-decode", {"spec": {"replicas": 4}})
        await eventually(lambda: len(fleet.roles("decode")) == 4 and len(fleet.roles("prefill")) == 2, timeout=20)
        await kube_client.patch(API, PLURAL, NS, "flash", {"spec": {"engine": {"image": "reg/dsv4:2"}}})

        async def rolled() -> bool:
            return fleet.images_of("decode") == ["reg/dsv4:2"] * 4 and fleet.images_of("prefill") == ["reg/dsv4:2"] * 2

        await eventually(rolled, timeout=40)
        first = [pod for _, pod, image in fleet.timeline if image == "reg/dsv4:2"]
        assert first[0] == "flash-decode-3", f"the canary moves first: {first}"
        cr = await get_cr(kube_client, NS, "flash")
        assert cr["status"]["canary"]["pod"] == "flash-decode-3" and cr["status"]["canary"]["phase"] == "Passed"
    finally:
        await fleet.stop()
