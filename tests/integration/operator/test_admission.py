"""The emulated API server refuses, at admission, the bad specs the review listed (and the other
bad field syntax): the CRD's schema and its CEL rules, as `kubectl apply` would meet them. A
refused create stores nothing; a refused update leaves the stored spec as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "operator"))  # the shared cases

from bench.harness.kmock_cluster import ClusterClient, ClusterError, KubeCluster  # noqa: E402
from test_operator_cel import ACCEPTED, REFUSED, minimal  # noqa: E402

API = "serving.dsv4.dev/v1alpha1"
PLURAL = "dsv4deployments"
REVIEW = [
    "name_too_long",
    "two_volume_sources",
    "no_volume_source",
    "engine_port_is_bootstrap_port",
    "quantity_words",
    "env_name_with_space",
    "node_selector_key_bad",
    "toleration_exists_with_value",
]


@pytest.mark.parametrize("case", REVIEW)
async def test_bad_specs_are_refused_at_create(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, case: str
) -> None:
    cr, fragment = REFUSED[case]
    with pytest.raises(ClusterError) as err:
        await kube_client.create(cr, PLURAL)
    assert err.value.status == 422 and err.value.body["reason"] == "Invalid"
    message = err.value.body["message"]
    assert fragment in message or (fragment == "pattern" and "does not match" in message), message
    assert await kube_client.list(API, PLURAL, "ns") == []


async def test_good_specs_are_admitted_and_a_bad_update_is_refused(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient
) -> None:
    for i, case in enumerate(["minimal", "pvc_only", "quantity_forms", "selector_prefixed"]):
        cr = ACCEPTED[case]
        cr = {**cr, "metadata": {**cr["metadata"], "name": f"ok{i}"}}
        await kube_client.create(cr, PLURAL)
    await kube_client.create({**minimal(), "metadata": {"name": "flash", "namespace": "ns"}}, PLURAL)
    with pytest.raises(ClusterError) as err:
        await kube_client.patch(API, PLURAL, "ns", "flash", {"spec": {"transfer": {"bootstrapPort": 8100}}})
    assert err.value.status == 422 and "bootstrapPort" in err.value.body["message"]
    stored = await kube_client.get(API, PLURAL, "ns", "flash")
    assert stored["spec"]["transfer"]["bootstrapPort"] == 8998
