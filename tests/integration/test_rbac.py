"""RBAC proof: the Helm chart grants the operator every API call it makes, and nothing broader
than a list justified here.

The real operator (kopf, handlers, the wedge watchdog daemon, health server, `serve_operator` as
`dsv4 operator` runs it) works through a scenario against the kmock-based API server
(bench/harness/kmock_cluster.py, with the watchdog harness's pods/log and DELETE
preconditions), which records every call as RBAC sees it: (verb, apiGroup, resource[/subresource]).
Two parts run side by side in one operator: the reconciler's (create, update, a deleted child put
back, a spec it cannot act on, status as the children become ready, deletion) and the watchdog's
(a wedged prefill pod captured, drained, aborted and restarted end to end, with evidence past its
retention pruned). Then, for each watch scope of the chart, `helm template` renders the
(Cluster)Role and this test checks:
- every recorded call is granted, and (namespaced scope) every call stays inside the watched
  namespaces, so a Role in each of them is enough;
- every grant was either recorded or is in JUSTIFIED below, with its reason; no wildcards.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import kmock
import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: chart_testutil
sys.path.insert(0, str(Path(__file__).resolve().parent / "watchdog"))  # watchdog_harness

from chart_testutil import grants, helm_template, rbac_rules  # noqa: E402
from bench.harness.kmock_cluster import *  # noqa: E402,F401,F403  (fixtures: kube_client, kubeconfig, api_calls)
from bench.harness.kmock_cluster import ApiCallRecorder, ClusterClient, eventually  # noqa: E402
from watchdog_harness import (  # noqa: E402
    NS,
    PodFarm,
    ScriptedEngine,
    WatchdogCluster,
    deployment,
    events,
    evidence_maps,
)

from dsv4_operator.crd import build_crd  # noqa: E402
from dsv4_operator.leader import LeaderElection  # noqa: E402
from dsv4_operator.main import make_settings, serve_operator  # noqa: E402
from dsv4_operator.remediation.executor import EVIDENCE_KEPT  # noqa: E402
from dsv4_operator.watchdog.evidence import build_evidence_configmap  # noqa: E402
from bench.harness.commands import free_port

API = "serving.dsv4.dev/v1alpha1"
PLURAL = "dsv4deployments"
NAMESPACES = ["ns1", "ns2", NS]  # NS: the watchdog part's namespace

# Granted although the scenario does not call them, each for a reason. An entry here that the
# chart stops granting fails the test, so the list cannot outlive the grants it explains.
ROUTER_ROLE = (
    "the operator creates the router's Role, which grants it; the API server refuses a Role granting "
    "what its creator does not hold (an escalation check the emulator does not make)"
)
GROUPS = (
    "multi-node roles (nodesPerReplica > 1), which this scenario does not run: "
    "tests/integration/watchdog/test_groups_operator.py records these calls and checks the chart grants them"
)
JUSTIFIED: dict[tuple[str, str, str], str] = {
    ("", "pods", "get"): ROUTER_ROLE,
    ("", "pods", "watch"): ROUTER_ROLE,
    ("", "pods", "delete"): GROUPS,
    ("apps", "statefulsets", "delete"): GROUPS,
    **{("leaderworkerset.x-k8s.io", "leaderworkersets", verb): GROUPS for verb in ("get", "create", "patch", "delete")},
}
# What the scenario must have seen, or it did not exercise the operator and proves nothing.
MUST_RECORD = {
    ("serving.dsv4.dev", "dsv4deployments", "list"),
    ("serving.dsv4.dev", "dsv4deployments", "watch"),
    ("serving.dsv4.dev", "dsv4deployments/status", "patch"),
    ("apps", "statefulsets", "create"),
    ("", "events", "list"),
    ("", "events", "watch"),  # the StatefulSet controllers' FailedCreate
    ("apps", "statefulsets", "patch"),
    ("apps", "statefulsets", "watch"),
    ("apps", "deployments", "create"),
    ("rbac.authorization.k8s.io", "roles", "create"),
    ("rbac.authorization.k8s.io", "rolebindings", "create"),
    ("", "services", "create"),
    ("", "serviceaccounts", "create"),
    ("", "events", "create"),
    # The watchdog: finds the engine pods, labels the wedged one draining, restarts it, keeps its
    # log and the rest as an evidence ConfigMap, prunes evidence past retention, reads and writes
    # the resource (state annotations, status).
    ("", "pods", "list"),
    ("", "pods", "watch"),
    ("", "pods", "patch"),
    ("", "pods/eviction", "create"),
    ("", "pods/log", "get"),
    ("", "configmaps", "create"),
    ("", "configmaps", "list"),
    ("", "configmaps", "delete"),
    ("serving.dsv4.dev", "dsv4deployments", "get"),
    ("serving.dsv4.dev", "dsv4deployments", "patch"),
    # The auth Secret (created; an existing one read, never patched: issue 27), PDBs and the NetworkPolicies
    # (applied, then deleted when the spec turns them off).
    ("", "secrets", "get"),
    ("", "secrets", "create"),
    ("policy", "poddisruptionbudgets", "create"),
    ("policy", "poddisruptionbudgets", "patch"),
    ("policy", "poddisruptionbudgets", "get"),
    ("policy", "poddisruptionbudgets", "delete"),
    ("networking.k8s.io", "networkpolicies", "create"),
    ("networking.k8s.io", "networkpolicies", "patch"),
    ("networking.k8s.io", "networkpolicies", "get"),
    ("networking.k8s.io", "networkpolicies", "delete"),
    # OwnerReferencesPermissionEnforcement: every child's blockOwnerDeletion reference.
    ("serving.dsv4.dev", "dsv4deployments/finalizers", "update"),
    # PD-aware rollout: the prefill and decode StatefulSets are read.
    ("apps", "statefulsets", "get"),
    # Drift: every kind of child is watched.
    ("", "services", "watch"),
    ("", "serviceaccounts", "watch"),
    ("rbac.authorization.k8s.io", "roles", "watch"),
    ("rbac.authorization.k8s.io", "rolebindings", "watch"),
    ("policy", "poddisruptionbudgets", "watch"),
    ("networking.k8s.io", "networkpolicies", "watch"),
    # Leader election on a Lease (the chart's leader-election Role in the release namespace).
    ("coordination.k8s.io", "leases", "get"),
    ("coordination.k8s.io", "leases", "create"),
    ("coordination.k8s.io", "leases", "patch"),
}


@pytest_asyncio.fixture
async def kube_cluster() -> AsyncIterator[WatchdogCluster]:
    """The shared emulator plus what the watchdog needs of an API server: pods/log text and
    DELETE preconditions (replaces kmock_cluster's fixture of the same name)."""
    async with WatchdogCluster() as cluster, kmock.Server(cluster):
        yield cluster


class Operator:
    """`serve_operator` in its own thread and event loop, talking HTTP to the emulator."""

    def __init__(self, kubeconfig: Path, namespaces: list[str]) -> None:
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(str(kubeconfig), namespaces), daemon=True)

    def _run(self, kubeconfig: str, namespaces: list[str]) -> None:
        settings = make_settings(standalone=True)
        settings.watching.reconnect_backoff = 0.05
        try:
            asyncio.run(
                serve_operator(
                    namespaces=namespaces,
                    standalone=True,
                    health_host="127.0.0.1",
                    health_port=free_port(),
                    kubeconfig=kubeconfig,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    settings=settings,
                    leader_election=LeaderElection(namespace=NS, lease_s=10, renew_deadline_s=8, retry_s=0.5),
                )
            )
        except BaseException as e:  # reported by the test
            self.error = e

    async def __aenter__(self) -> "Operator":
        self.thread.start()
        ok = await asyncio.get_running_loop().run_in_executor(None, self.ready_flag.wait, 20)
        assert ok, f"the operator did not start: {self.error!r}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.stop_flag.set()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 20)
        assert not self.thread.is_alive(), "the operator did not stop"


def resource(name: str, namespace: str, **spec: Any) -> dict:
    body = {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "reg/dsv4:1"}, **spec}
    return {
        "apiVersion": API,
        "kind": "DSV4Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


async def observed(client: ClusterClient, ns: str, name: str, generation: int) -> bool:
    cr = await client.get(API, PLURAL, ns, name)
    return bool(cr) and (cr.get("status") or {}).get("observedGeneration") == generation


async def children(client: ClusterClient, ns: str, name: str) -> list[dict]:
    sel = f"app.kubernetes.io/instance={name}"
    return [
        *await client.list("apps/v1", "statefulsets", ns, sel),
        *await client.list("apps/v1", "deployments", ns, sel),
    ]


async def run_scenario(
    cluster: WatchdogCluster, client: ClusterClient, kubeconfig: Path, namespaces: list[str]
) -> None:
    # A CRD without the replicas minimum, so that a spec the operator refuses can reach it.
    crd = copy.deepcopy(build_crd())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["prefill"][
        "properties"
    ]["replicas"].pop("minimum")
    cluster.register_crd(crd)
    async with Operator(kubeconfig, namespaces):
        await asyncio.gather(reconcile_scenario(client), watchdog_scenario(cluster, client))
        await asyncio.sleep(0.3)


async def reconcile_scenario(client: ClusterClient) -> None:
    # The user brought an auth Secret: used as it is (the operator never patches a Secret). It
    # carries the operator's label and names its deployment: the operator uses no Secret of the
    # namespace it was not given (issue 39).
    await client.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "flash-auth",
                "namespace": "ns1",
                "labels": {"app.kubernetes.io/managed-by": "dsv4-operator"},
                "annotations": {"serving.dsv4.dev/deployment": "flash"},
            },
            "data": {"admin-token": "dXNlcg==", "pd-secret": "cGQ=", "router-admin-token": "cm91dGVy"},
        },
        "secrets",
    )
    await client.create(resource("flash", "ns1"), PLURAL)
    await eventually(lambda: observed(client, "ns1", "flash", 1), timeout=60)
    # The controllers report ready workloads (the emulator has none): status follows.
    for obj in await children(client, "ns1", "flash"):
        plural = "statefulsets" if obj["kind"] == "StatefulSet" else "deployments"
        n = obj["spec"].get("replicas", 1)
        await client.patch(
            "apps/v1",
            plural,
            "ns1",
            obj["metadata"]["name"],
            {
                "status": {
                    "observedGeneration": obj["metadata"]["generation"],
                    "replicas": n,
                    "readyReplicas": n,
                    "updatedReplicas": n,
                    "availableReplicas": n,
                }
            },
            subresource="status",
        )
    # An update rolls through; a deleted child is put back.
    await client.patch(API, PLURAL, "ns1", "flash", {"spec": {"decode": {"replicas": 2}}})
    await eventually(lambda: observed(client, "ns1", "flash", 2), timeout=60)
    secret = await client.get("v1", "secrets", "ns1", "flash-auth")
    assert secret["data"]["admin-token"] == "dXNlcg==" and secret["data"]["pd-secret"] == "cGQ=", "user's values kept"
    # Optional children: a NetworkPolicy on, the PDBs off (deleted); then the policy off again.
    await client.patch(
        API,
        PLURAL,
        "ns1",
        "flash",
        {"spec": {"security": {"networkPolicy": {"enabled": True}}, "remediation": {"podDisruptionBudget": False}}},
    )
    await eventually(lambda: observed(client, "ns1", "flash", 3), timeout=60)
    assert await client.get("networking.k8s.io/v1", "networkpolicies", "ns1", "flash-engines")
    assert await client.get("networking.k8s.io/v1", "networkpolicies", "ns1", "flash-router")
    assert await client.get("policy/v1", "poddisruptionbudgets", "ns1", "flash-prefill") is None
    await client.patch(API, PLURAL, "ns1", "flash", {"spec": {"security": {"networkPolicy": {"enabled": False}}}})
    await eventually(lambda: observed(client, "ns1", "flash", 4), timeout=60)
    assert await client.get("networking.k8s.io/v1", "networkpolicies", "ns1", "flash-engines") is None
    assert await client.get("networking.k8s.io/v1", "networkpolicies", "ns1", "flash-router") is None
    old = await client.get("apps/v1", "statefulsets", "ns1", "flash-decode")
    await client.delete("apps/v1", "statefulsets", "ns1", "flash-decode")

    async def restored() -> bool:
        sts = await client.get("apps/v1", "statefulsets", "ns1", "flash-decode")
        return sts is not None and sts["metadata"]["uid"] != old["metadata"]["uid"]

    await eventually(restored, timeout=60)
    # A spec it cannot act on: a condition and a Warning Event, no children.
    await client.create(resource("broken", "ns2", prefill={"replicas": -1}), PLURAL)
    await eventually(lambda: observed(client, "ns2", "broken", 1), timeout=60)
    # Deletion: the garbage collector takes the children; the operator must not fight it.
    await client.delete(API, PLURAL, "ns1", "flash")
    await eventually(lambda: _none_left(client), timeout=60)


async def watchdog_scenario(cluster: WatchdogCluster, client: ClusterClient) -> None:
    """A wedged prefill pod remediated end to end, with as much old evidence as is kept already,
    so that the new record pushes the oldest out."""
    name, pod = "healer", "healer-prefill-0"
    for i in range(EVIDENCE_KEPT):
        await client.create(
            build_evidence_configmap(
                deployment=name,
                namespace=NS,
                pod=pod,
                role="prefill",
                captured_at=1_000_000_000 + 60 * i,
                verdict={"reason": "stuck_inflight"},
            ),
            "configmaps",
        )
    oldest = min(evidence_maps(cluster), key=lambda cm: cm["metadata"]["name"])["metadata"]["name"]
    await client.create(
        deployment(name, remediation={"scrapeIntervalSeconds": 0.25, "detectionWindowSeconds": 1}), "dsv4deployments"
    )
    engine = await ScriptedEngine("prefill").start()
    farm = PodFarm(client, cluster, name)
    try:
        engine.reset("wedged")
        cluster.pod_logs[(NS, pod)] = lambda: "engine log line\n"
        await farm.add(pod, "prefill", engine.port)
        await eventually(lambda: events(cluster, name, "Restarted"), timeout=60)
    finally:
        await engine.stop()
    assert engine.admin_calls() == ["/debug/stacks", "/admin/drain", "/admin/abort"]
    kept = {cm["metadata"]["name"] for cm in evidence_maps(cluster)}
    assert len(kept) == EVIDENCE_KEPT and oldest not in kept, "the watchdog pruned the oldest evidence"


async def _none_left(client: ClusterClient) -> bool:
    return not await children(client, "ns1", "flash")


def recorded_grants(recorder: ApiCallRecorder) -> set[tuple[str, str, str]]:
    return {(group, res, verb) for (group, res), verbs in recorder.rules().items() for verb in verbs}


@pytest.mark.parametrize("scope", ["cluster", "namespaces"])
async def test_the_chart_grants_exactly_what_the_operator_calls(
    scope: str, kube_cluster: WatchdogCluster, kube_client: ClusterClient, kubeconfig: Path, api_calls: ApiCallRecorder
) -> None:
    namespaces = [] if scope == "cluster" else NAMESPACES
    values: dict[str, Any] = {"watch.scope": scope}
    if namespaces:
        values["watch.namespaces"] = namespaces
    docs = helm_template(values)
    # As on OpenShift and hardened clusters: owner references are checked against what the chart grants.
    kube_cluster.enforce_owner_references(grants(rbac_rules(docs)))
    await run_scenario(kube_cluster, kube_client, kubeconfig, namespaces)
    recorded = recorded_grants(api_calls)
    assert MUST_RECORD <= recorded, f"the scenario did not exercise: {sorted(MUST_RECORD - recorded)}"

    roles = [
        d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole") and not d["metadata"]["name"].endswith("-leader-election")
    ]  # the Lease's Role, in the release namespace
    assert {d["kind"] for d in roles} == {"ClusterRole" if scope == "cluster" else "Role"}
    granted = grants(rbac_rules(docs))

    missing = recorded - granted
    assert not missing, f"the operator calls what the chart does not grant: {sorted(missing)}"
    unexplained = granted - recorded - set(JUSTIFIED)
    assert not unexplained, (
        f"the chart grants what the operator never calls and nobody justified: {sorted(unexplained)}"
    )
    stale = set(JUSTIFIED) - granted
    assert not stale, f"JUSTIFIED explains grants the chart no longer makes: {sorted(stale)}"
    assert not any("*" in part for g in granted for part in g), "no wildcards"
    # The router-Role reason holds: the operator did write a Role that grants each of those.
    router_roles = kube_cluster.objects_of("rbac.authorization.k8s.io/v1/roles")
    assert router_roles, "the scenario created no router Role"
    written = grants(rule for role in router_roles for rule in role["rules"])
    for grant, why in JUSTIFIED.items():
        assert why != ROUTER_ROLE or grant in written, f"no Role the operator wrote grants {grant}"

    operator_calls = [c for c in api_calls.calls if not c.agent.startswith(("dsv4-tests", "kmock/"))]
    assert operator_calls
    if scope == "namespaces":
        # A Role grants only inside its namespace: every call must name a watched one.
        outside = {(c.verb, c.resource, c.namespace) for c in operator_calls if c.namespace not in namespaces}
        assert not outside, f"calls a namespaced Role cannot authorize: {sorted(outside, key=str)}"
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces)
