"""PD-aware rollout with the real operator against the emulated API server: an engine change
rolls prefill first and holds decode on its old template (StatefulSet partition) until every
prefill pod runs the new one and is ready; `order: together` rolls both at once; a role's
`partition` makes a canary by hand (the automatic canary step: test_canary_rollout.py)."""

from __future__ import annotations

from typing import Optional

from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually
from test_operator_kmock import API, PLURAL, deployment, mark_ready

from dsv4_operator.manifests import HOLD_PARTITION

STS = ("apps/v1", "statefulsets")
# These tests are about the order and the partition without the canary step (test_canary_rollout.py
# has it): with it on, the change would wait for a canary pod this emulator never runs.
NO_CANARY = {"canary": {"enabled": False}}


async def sts(client: ClusterClient, role: str) -> dict:
    return await client.get(*STS, "ns1", f"flash-{role}")


def partition(obj: dict) -> int:
    return obj["spec"]["updateStrategy"]["rollingUpdate"]["partition"]


def image(obj: dict) -> str:
    return obj["spec"]["template"]["spec"]["containers"][0]["image"]


async def observed(client: ClusterClient, generation: int) -> bool:
    cr = await client.get(API, PLURAL, "ns1", "flash")
    return ((cr or {}).get("status") or {}).get("observedGeneration") == generation


async def prefill_rolled(client: ClusterClient, ready: int) -> None:
    """Stand in for the StatefulSet controller: prefill's pods run the latest template, `ready` of them ready."""
    obj = await sts(client, "prefill")
    n = obj["spec"]["replicas"]
    await client.patch(
        *STS,
        "ns1",
        "flash-prefill",
        {
            "status": {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": ready,
                "updatedReplicas": n,
            }
        },
        subresource="status",
    )


async def test_engine_change_rolls_prefill_first_then_decode(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(
        deployment("flash", "ns1", prefill={"replicas": 2}, decode={"replicas": 2}, rollout=NO_CANARY), PLURAL
    )
    await eventually(lambda: observed(kube_client, 1), timeout=20)
    await mark_ready(kube_client, "ns1", "flash")
    assert partition(await sts(kube_client, "decode")) == 0, "a new deployment holds nothing"

    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"engine": {"image": "reg/dsv4:2"}}})
    await eventually(lambda: observed(kube_client, 2), timeout=20)
    prefill, decode = await sts(kube_client, "prefill"), await sts(kube_client, "decode")
    assert image(prefill) == "reg/dsv4:2" and partition(prefill) == 0
    assert image(decode) == "reg/dsv4:2" and partition(decode) == HOLD_PARTITION, "decode waits for prefill"

    await prefill_rolled(kube_client, ready=1)  # updated, one not ready yet: still waiting
    await eventually(lambda: _prefill_status(kube_client, ready=1), timeout=20)
    assert partition(await sts(kube_client, "decode")) == HOLD_PARTITION
    await prefill_rolled(kube_client, ready=2)

    async def released() -> bool:
        return partition(await sts(kube_client, "decode")) == 0

    await eventually(released, timeout=20)


async def test_together_and_canary_partition(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(
        deployment("flash", "ns1", rollout={"order": "together", **NO_CANARY}, decode={"replicas": 4, "partition": 3}),
        PLURAL,
    )
    await eventually(lambda: observed(kube_client, 1), timeout=20)
    await mark_ready(kube_client, "ns1", "flash")
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"engine": {"image": "reg/dsv4:2"}}})
    await eventually(lambda: observed(kube_client, 2), timeout=20)
    decode = await sts(kube_client, "decode")
    assert image(decode) == "reg/dsv4:2" and partition(decode) == 3, "the canary: only ordinal 3 takes it"


async def _prefill_status(client: ClusterClient, ready: int) -> Optional[bool]:
    obj = await sts(client, "prefill")
    return (obj.get("status") or {}).get("readyReplicas") == ready or None


async def test_a_pinned_revision_rolls_back_without_touching_the_spec(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """`rollback: auto` without a merge patch of the user's spec: the watchdog pins a stored
    revision (annotation "<hash>@<generation>"), the children follow it, the spec stays as the
    user (or GitOps) wrote it, and the user's next edit ends the pin."""
    from dsv4_operator.watchdog.revisions import RevisionTracker, serving_spec, spec_hash
    from dsv4_wire import ANNOTATION_PINNED_REVISION, ANNOTATION_REVISIONS

    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1", rollout={"order": "together", **NO_CANARY}), PLURAL)
    await eventually(lambda: observed(kube_client, 1), timeout=20)
    good = (await kube_client.get(API, PLURAL, "ns1", "flash"))["spec"]
    tracker = RevisionTracker()
    tracker.observe(1, serving_spec(good), now=1.0)
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"engine": {"image": "reg/dsv4:bad"}}})
    await eventually(lambda: observed(kube_client, 2), timeout=20)
    assert image(await sts(kube_client, "decode")) == "reg/dsv4:bad"

    import json

    await kube_client.patch(
        API,
        PLURAL,
        "ns1",
        "flash",
        {
            "metadata": {
                "annotations": {
                    ANNOTATION_REVISIONS: json.dumps(tracker.to_dict()),
                    ANNOTATION_PINNED_REVISION: f"{spec_hash(good)}@2",
                }
            }
        },
    )

    async def pinned() -> Optional[dict]:
        cr = await kube_client.get(API, PLURAL, "ns1", "flash")
        ok = image(await sts(kube_client, "decode")) == image(await sts(kube_client, "prefill")) == "reg/dsv4:1" and (
            cr.get("status") or {}
        ).get("pinnedRevision") == spec_hash(good)
        return cr if ok else None

    cr = await eventually(pinned, timeout=20)
    assert cr["spec"]["engine"]["image"] == "reg/dsv4:bad" and cr["metadata"]["generation"] == 2, "spec untouched"

    # The user's next edit (a fixed image) ends the pin.
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"engine": {"image": "reg/dsv4:3"}}})

    async def unpinned() -> bool:
        cr = await kube_client.get(API, PLURAL, "ns1", "flash")
        return image(await sts(kube_client, "decode")) == "reg/dsv4:3" and "pinnedRevision" not in (
            cr.get("status") or {}
        )

    await eventually(unpinned, timeout=20)


async def test_an_unchanged_gpu_decode_is_not_held_while_prefill_is_not_ready(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """The API server serves `nvidia.com/gpu: 4` back as "4": the live-versus-wanted comparison
    must see the same template, or every reconcile while prefill is not ready (first start, an
    operator restart, a prefill pod under remediation) holds an unchanged decode."""
    await operator_factory(["ns1"])
    await kube_client.create(
        deployment("flash", "ns1", prefill={"replicas": 2, "gpusPerPod": 4}, decode={"replicas": 2, "gpusPerPod": 4}),
        PLURAL,
    )
    await eventually(lambda: observed(kube_client, 1), timeout=20)
    decode = await sts(kube_client, "decode")
    assert decode["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # A change for prefill only, while prefill is not ready: decode has nothing to take.
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"prefill": {"replicas": 3}}})
    await eventually(lambda: observed(kube_client, 2), timeout=20)
    assert partition(await sts(kube_client, "decode")) == 0, "an unchanged decode is never held"
