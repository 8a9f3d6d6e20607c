"""The emulator's strictness where a lenient one hid defects of the operator (issue 32): each
behaviour here is what a real kube-apiserver (1.29-1.33) does."""

from __future__ import annotations

import pytest

from bench.harness.kmock_cluster import ClusterClient, ClusterError, KubeCluster, canonical_quantity

APPLY = "application/apply-patch+yaml"


@pytest.mark.parametrize(
    "written,served",
    [
        (4, "4"),
        ("4", "4"),
        ("1000m", "1"),
        ("1500m", "1500m"),
        ("0.5", "500m"),
        ("2000", "2k"),
        ("1024Mi", "1Gi"),
        ("1.5Gi", "1536Mi"),
        ("0.5Ki", "512"),
        ("64Gi", "64Gi"),
        ("1e3", "1e3"),
        ("1000e0", "1e3"),
        ("0.0000000001", "1n"),
        ("0", "0"),
    ],
)
def test_quantities_are_served_canonical(written, served) -> None:
    assert canonical_quantity(written) == served


def statefulset(name: str, limits: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {
                    "containers": [{"name": "c", "image": "i", "resources": {"limits": limits, "requests": limits}}],
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16384Mi"}}],
                },
            },
        },
    }


async def test_built_in_quantities_come_back_canonical_and_a_same_value_apply_writes_nothing(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    path = "/apis/apps/v1/namespaces/ns/statefulsets/s"
    body = statefulset("s", {"nvidia.com/gpu": 4, "cpu": "1000m", "memory": "1024Mi"})
    made = await kube_client.call("PATCH", path, body, APPLY, {"fieldManager": "me", "force": "true"})
    pod = made["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4", "cpu": "1", "memory": "1Gi"}
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "16Gi"
    again = await kube_client.call("PATCH", path, body, APPLY, {"fieldManager": "me", "force": "true"})
    assert again["metadata"]["resourceVersion"] == made["metadata"]["resourceVersion"], "a no-op apply writes nothing"
    with pytest.raises(ClusterError) as err:
        await kube_client.create(statefulset("bad", {"cpu": "lots"}), "statefulsets")
    assert err.value.status == 422


async def test_owner_references_permission_enforcement(kube_cluster: KubeCluster, kube_client: ClusterClient) -> None:
    """blockOwnerDeletion needs `update` on the owner's finalizers subresource; without it the
    write is a 403, and the check is recorded for the RBAC proof."""
    owner = await kube_client.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner", "namespace": "ns"}}, "configmaps"
    )
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    child = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "child", "namespace": "ns", "ownerReferences": [ref]},
    }
    held = {("", "secrets", "create"), ("", "secrets", "patch")}
    kube_cluster.enforce_owner_references(held)
    async with ClusterClient(str(kube_cluster.url)) as operator:
        operator._session.headers["User-Agent"] = "dsv4-operator/test"  # not the tests' own agent
        with pytest.raises(ClusterError) as err:
            await operator.create(child, "secrets")
        assert err.value.status == 403 and "blockOwnerDeletion" in err.value.body["message"]
        unblocked = {
            **child,
            "metadata": {**child["metadata"], "ownerReferences": [dict(ref, blockOwnerDeletion=False)]},
        }
        await operator.create(unblocked, "secrets")  # no blocking reference: nothing to check
        with pytest.raises(ClusterError) as err:  # changing the references of a live object needs delete on it
            await operator.patch("v1", "secrets", "ns", "child", {"metadata": {"ownerReferences": [ref]}})
        assert err.value.status == 403 and "can't delete" in err.value.body["message"]
        kube_cluster.enforce_owner_references(
            held | {("", "configmaps/finalizers", "update"), ("", "secrets", "delete")}
        )
        await operator.patch("v1", "secrets", "ns", "child", {"metadata": {"ownerReferences": [ref]}})
    assert ("update", "", "configmaps/finalizers") in kube_cluster.recorder.observed()
    await kube_client.create(dict(child, metadata=dict(child["metadata"], name="by-test")), "secrets")  # tests exempt


async def test_apply_merges_list_maps_by_key_and_validates_the_result(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    path = "/api/v1/namespaces/ns/services/svc"

    def svc(*ports: dict) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "svc", "namespace": "ns"},
            "spec": {"ports": list(ports)},
        }

    mine = {"fieldManager": "me", "force": "true"}
    await kube_client.call("PATCH", path, svc({"name": "http", "port": 80}, {"name": "b", "port": 81}), APPLY, mine)
    # Another manager's entry stays through my forced apply; my dropped entry goes.
    await kube_client.call(
        "PATCH", path, svc({"name": "m", "port": 90}), APPLY, {"fieldManager": "other", "force": "true"}
    )
    out = await kube_client.call("PATCH", path, svc({"name": "http", "port": 80}), APPLY, mine)
    assert sorted(p["name"] for p in out["spec"]["ports"]) == ["http", "m"]
    # A merge that leaves two ports named http is refused, as the API server's validation does.
    await kube_client.patch("v1", "services", "ns", "svc", {"spec": {"ports": [{"name": "http", "port": 8080}]}})
    with pytest.raises(ClusterError) as err:
        await kube_client.call("PATCH", path, svc({"name": "http", "port": 80}), APPLY, mine)
    assert err.value.status == 422 and "Duplicate value: 'http'" in err.value.body["message"]


async def test_toleration_seconds_only_with_no_execute(kube_cluster: KubeCluster, kube_client: ClusterClient) -> None:
    sts = statefulset("t", {"cpu": "1"})
    sts["spec"]["template"]["spec"]["tolerations"] = [
        {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}
    ]
    with pytest.raises(ClusterError) as err:
        await kube_client.create(sts, "statefulsets")
    assert err.value.status == 422 and "NoExecute" in err.value.body["message"]


async def test_image_volumes_dropped_with_the_gate_off_and_dry_run_stores_nothing(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    sts = statefulset("iv", {"cpu": "1"})
    pod = sts["spec"]["template"]["spec"]
    pod["volumes"].append({"name": "model", "image": {"reference": "reg/m:1"}})
    pod["containers"][0]["volumeMounts"] = [{"name": "model", "mountPath": "/m"}]
    path = "/apis/apps/v1/namespaces/ns/statefulsets/iv"
    dry = await kube_client.call("PATCH", path, sts, APPLY, {"fieldManager": "me", "dryRun": "All"})
    assert [v["name"] for v in dry["spec"]["template"]["spec"]["volumes"]] == ["shm"]  # dropped, silently
    assert dry["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] == []
    assert await kube_client.get("apps/v1", "statefulsets", "ns", "iv") is None  # a dry run stores nothing
    kube_cluster.feature_gates["ImageVolume"] = True
    kept = await kube_client.call("PATCH", path, sts, APPLY, {"fieldManager": "me"})
    assert [v["name"] for v in kept["spec"]["template"]["spec"]["volumes"]] == ["shm", "model"]
