"""nodesPerReplica: a replica as a gang of pods, rendered in both forms and checked against the
API fields each kind defines — the StatefulSet pair with kubernetes-validate --strict, the
LeaderWorkerSet against LWS's own released CRD (tests/fixtures/lws, trimmed from v0.10.0) with its
pod templates as strict PodTemplateSpecs — plus the pure decisions that keep a group whole."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dsv4_operator import groups as G
from dsv4_operator import manifests as M
from dsv4_operator.crd import apply_defaults, prune_unknown, to_jsonschema
from dsv4_operator.spec import parse_spec
from dsv4_wire.groups import group_member, whole_groups
from dsv4_wire.k8s import ANNOTATION_WORKER_TEMPLATE, LABEL_GROUP, LABEL_GROUP_SIZE, LABEL_NODE

LWS_CRD = Path(__file__).resolve().parents[2] / "fixtures" / "lws" / "leaderworkersets-v0.10.0.yaml"
OWNER = M.Owner(name="flash", namespace="serving", uid="2f1e3b4c-0000-4000-8000-000000000001")
K8S = "1.33.0"
BASE = {
    "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
    "engine": {"image": "reg/dsv4:1"},
}


def spec(**roles):
    return parse_spec({**BASE, **roles})


def multi(required=False, kind="builtin", replicas=2):
    raw = {
        **BASE,
        "engine": {"image": "reg/dsv4:1", "kind": kind},
        "decode": {
            "replicas": replicas,
            "gpusPerPod": 8,
            "nodesPerReplica": 2,
            "groupTopology": {"required": required},
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        },
    }
    return parse_spec(raw)


def lws_schema() -> dict:
    crd = yaml.safe_load(LWS_CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def pod_template(template: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "t", "namespace": "serving"},
        "template": template,
    }


def one(children, kind, name):
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def engine(template: dict) -> dict:
    return template["spec"]["containers"][0]


def flag(cmd: list[str], name: str) -> str:
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]


def test_single_node_roles_render_exactly_as_before():
    """nodesPerReplica is additive: absent or 1, every child is what it was, in either form."""
    plain = M.build_children(spec(), OWNER)
    assert M.build_children(spec(decode={"nodesPerReplica": 1}, prefill={"nodesPerReplica": 1}), OWNER) == plain
    assert M.build_children(spec(), OWNER, lws=True) == plain
    assert M.replaced_workloads(spec(), OWNER, lws=False) == []


def test_the_statefulset_pair_validates_strictly_and_wires_the_group():
    s = multi()
    children = M.build_children(s, OWNER)
    for child in children:
        kubernetes_validate.validate(child, K8S, strict=True)
    sts = one(children, "StatefulSet", "flash-decode")
    leader = sts["spec"]["template"]
    cmd = engine(leader)["command"]
    assert flag(cmd, "--tp-size") == "16" and flag(cmd, "--nnodes") == "2" and flag(cmd, "--node-rank") == "0"
    assert flag(cmd, "--dist-init-addr") == f"$(POD_IP):{G.GROUP_PORT}"
    assert (
        leader["metadata"]["labels"][LABEL_GROUP_SIZE] == "2" and leader["metadata"]["labels"][LABEL_NODE] == "leader"
    )
    # The role's one budget counts whole groups: 1 group x 2 nodes.
    assert one(children, "PodDisruptionBudget", "flash-decode")["spec"]["maxUnavailable"] == 2
    assert one(children, "PodDisruptionBudget", "flash-prefill")["spec"]["maxUnavailable"] == 1
    # The prefill role keeps its single-node shape.
    assert "--nnodes" not in engine(one(children, "StatefulSet", "flash-prefill")["spec"]["template"])["command"]

    # A leader pod as the StatefulSet controller makes it: its worker StatefulSet follows.
    pod = leader_pod(sts, 1)
    workers = G.worker_statefulset(pod, "nvidia.com/gpu.clique", required=False)
    kubernetes_validate.validate(workers, K8S, strict=True)
    assert workers["metadata"]["name"] == "flash-decode-1" and workers["spec"]["replicas"] == 1
    assert workers["spec"]["ordinals"] == {"start": 1} and workers["spec"]["serviceName"] == "flash-decode"
    assert workers["metadata"]["ownerReferences"][0] | {"uid": "x"} == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "flash-decode-1",
        "uid": "x",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    wt = workers["spec"]["template"]
    wcmd = engine(wt)["command"]
    assert flag(wcmd, "--node-rank") == "$(DSV4_NODE_RANK)" and flag(wcmd, "--tp-size") == "16"
    assert flag(wcmd, "--dist-init-addr") == "$(DSV4_LEADER_ADDRESS):29500"
    env = {e["name"]: e for e in engine(wt)["env"]}
    assert (
        env["DSV4_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert env["DSV4_LEADER_ADDRESS"]["value"] == "flash-decode-1.flash-decode.serving.svc"
    assert (
        wt["metadata"]["labels"][LABEL_NODE] == "worker" and wt["metadata"]["labels"][LABEL_GROUP] == "flash-decode-1"
    )
    # No API, no drain on a worker: probes on its node agent.
    assert [p["name"] for p in engine(wt)["ports"]] == ["http"] and "lifecycle" not in engine(wt)
    assert engine(wt)["readinessProbe"]["httpGet"]["path"] == "/ready"
    # In the leader's domain, by preference (the user's own affinity kept beside it).
    affinity = wt["spec"]["affinity"]
    assert "nodeAffinity" in affinity
    term = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term == {
        "labelSelector": {"matchLabels": {"statefulset.kubernetes.io/pod-name": "flash-decode-1"}},
        "topologyKey": "nvidia.com/gpu.clique",
    }
    required = G.worker_statefulset(pod, "rack", required=True)["spec"]["template"]["spec"]["affinity"]["podAffinity"]
    assert required["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "rack"


def leader_pod(sts: dict, ordinal: int, uid: str = "leader-uid-1") -> dict:
    template = copy.deepcopy(sts["spec"]["template"])
    name = f"{sts['metadata']['name']}-{ordinal}"
    labels = {**template["metadata"]["labels"], "statefulset.kubernetes.io/pod-name": name}
    labels["apps.kubernetes.io/pod-index"] = str(ordinal)
    labels["controller-revision-hash"] = "flash-decode-abc"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "serving",
            "uid": uid,
            "labels": labels,
            "annotations": template["metadata"]["annotations"],
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": sts["metadata"]["name"],
                    "uid": "sts",
                    "controller": True,
                }
            ],
        },
        "spec": template["spec"],
    }


@pytest.mark.parametrize("required", [False, True])
def test_the_leaderworkerset_is_what_lws_defines(required):
    s = multi(required=required)
    children = M.build_children(s, OWNER, lws=True)
    assert [c["kind"] for c in children if c["metadata"]["name"] == "flash-decode"] == [
        "Service",
        "PodDisruptionBudget",
        "LeaderWorkerSet",
    ]
    lws = one(children, "LeaderWorkerSet", "flash-decode")
    schema = lws_schema()
    # Every field we send is one LWS defines (pruning takes nothing away), and it validates.
    assert prune_unknown(copy.deepcopy(lws), schema) == lws
    jsonschema.validate(apply_defaults(copy.deepcopy(lws), schema), to_jsonschema(schema))
    t = lws["spec"]["leaderWorkerTemplate"]
    for template in (t["leaderTemplate"], t["workerTemplate"]):
        kubernetes_validate.validate(pod_template(template), K8S, strict=True)
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart" and lws["spec"]["replicas"] == 2
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 0
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "Shared"}
    assert lws["metadata"]["ownerReferences"] == [M.owner_reference(OWNER)]
    # The leader template is the StatefulSet pair's, so the canary compares one template in both.
    assert t["leaderTemplate"] == M.engine_statefulset(s, OWNER, "decode")["spec"]["template"]
    env = {e["name"]: e for e in engine(t["workerTemplate"])["env"]}
    assert env["DSV4_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
    )
    assert env["DSV4_LEADER_ADDRESS"]["value"] == "$(LWS_LEADER_ADDRESS)"
    exclusive = lws["metadata"].get("annotations", {}).get(G.LWS_EXCLUSIVE_TOPOLOGY)
    affinity = t["workerTemplate"]["spec"]["affinity"]
    if required:
        assert exclusive == "nvidia.com/gpu.clique" and "podAffinity" not in affinity
    else:
        assert exclusive is None
        term = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
        assert term["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
    # The operator's StatefulSet of that name is replaced, never left beside LWS's own.
    assert M.replaced_workloads(s, OWNER, lws=True) == [
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "flash-prefill"),
        ("apps/v1", "StatefulSet", "flash-decode"),
    ]


def test_an_lws_the_crd_does_not_allow_is_caught():
    """The schema check can fail: a field LWS does not define is pruned, a bad enum is refused."""
    lws = one(M.build_children(multi(), OWNER, lws=True), "LeaderWorkerSet", "flash-decode")
    schema = lws_schema()
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, to_jsonschema(schema))
    extra = copy.deepcopy(lws)
    extra["spec"]["gangSize"] = 2
    assert prune_unknown(copy.deepcopy(extra), schema) != extra


def test_sglang_groups_take_its_own_flags_and_its_workers_no_probe():
    s = multi(kind="sglang")
    sts = M.engine_statefulset(s, OWNER, "decode")
    cmd = engine(sts["spec"]["template"])["command"]
    assert flag(cmd, "--nnodes") == "2" and flag(cmd, "--tp-size") == "16" and flag(cmd, "--node-rank") == "0"
    worker = json.loads(sts["spec"]["template"]["metadata"]["annotations"][ANNOTATION_WORKER_TEMPLATE])
    assert engine(worker)["ports"] == [] and "readinessProbe" not in engine(worker)


def test_group_membership_by_controller():
    leader = {"metadata": {"name": "flash-decode-0", "ownerReferences": [ref("StatefulSet", "flash-decode")]}}
    worker = {"metadata": {"name": "flash-decode-0-1", "ownerReferences": [ref("StatefulSet", "flash-decode-0")]}}
    stranger = {"metadata": {"name": "flash-decode-x-1", "ownerReferences": [ref("StatefulSet", "flash-decode-x")]}}
    assert group_member(leader, "flash", "decode") == ("flash-decode-0", 0)
    assert group_member(worker, "flash", "decode") == ("flash-decode-0", 1)
    assert group_member(stranger, "flash", "decode") is None
    assert group_member(worker, "flash", "prefill") is None


def ref(kind, name, uid="u"):
    return {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid, "controller": True}


def gpod(name, owner, size=2, ready=True, phase="Running", deleting=False, uid=None, restarts=0, owner_uid="u"):
    meta = {
        "name": name,
        "uid": uid or f"uid-{name}",
        "labels": {LABEL_GROUP_SIZE: str(size)},
        "ownerReferences": [ref("StatefulSet", owner, owner_uid)],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "engine", "restartCount": restarts}],
        },
    }


def test_a_group_is_whole_only_with_every_worker_running_ready_and_staying():
    leader = gpod("flash-decode-0", "flash-decode")
    assert whole_groups([leader, gpod("flash-decode-0-1", "flash-decode-0")], "flash", "decode") == {"flash-decode-0"}
    assert whole_groups([leader], "flash", "decode") == set()
    for half in (
        gpod("flash-decode-0-1", "flash-decode-0", ready=False),
        gpod("flash-decode-0-1", "flash-decode-0", phase="Pending"),
        gpod("flash-decode-0-1", "flash-decode-0", deleting=True),
    ):
        assert whole_groups([leader, half], "flash", "decode") == set()
    three = gpod("flash-decode-0", "flash-decode", size=3)
    assert whole_groups([three, gpod("flash-decode-0-2", "flash-decode-0", size=3)], "flash", "decode") == set()


def test_recreating_a_group_follows_lws_once_per_incarnation_with_backoff():
    leader = gpod("flash-decode-0", "flash-decode", uid="L1")
    worker = gpod("flash-decode-0-1", "flash-decode-0", owner_uid="W1")
    decide = G.recreate_decision
    assert decide(worker, False, leader, "W1", None, 0.0, "flash", "decode") is None  # all well
    got = decide(worker, True, leader, "W1", None, 0.0, "flash", "decode")
    assert got == G.Recreate("flash-decode-0", "L1", "worker flash-decode-0-1 (node 1) was deleted", 0.0)
    restarted = gpod("flash-decode-0-1", "flash-decode-0", owner_uid="W1", restarts=1)
    assert "a container restarted" in decide(restarted, False, leader, "W1", None, 0.0, "flash", "decode").why
    assert decide(
        gpod("flash-decode-0", "flash-decode", uid="L1", restarts=2), False, leader, None, None, 0, "flash", "decode"
    )
    # An older incarnation's worker (its StatefulSet is not the current one), a leader going, a
    # leader's own deletion: nothing.
    assert decide(worker, True, leader, "W2", None, 0.0, "flash", "decode") is None
    going = gpod("flash-decode-0", "flash-decode", uid="L1", deleting=True)
    assert decide(worker, True, going, "W1", None, 0.0, "flash", "decode") is None
    assert decide(leader, True, leader, None, None, 0.0, "flash", "decode") is None
    # Never twice for one incarnation; the next in a row waits 30 s, then 60, ... 600 at most.
    rec = G.GroupRecord(count=1, last_at=100.0, leader_uids={"L1"})
    assert decide(worker, True, leader, "W1", rec, 101.0, "flash", "decode") is None
    leader2 = gpod("flash-decode-0", "flash-decode", uid="L2")
    assert decide(worker, True, leader2, "W1", rec, 110.0, "flash", "decode").wait_s == pytest.approx(20.0)
    assert G.backoff_s(2) == 60 and G.backoff_s(10) == 600
    assert decide(worker, True, leader2, "W1", rec, 100.0 + G.RESET_AFTER_S, "flash", "decode").wait_s == 0.0


def test_the_pd_aware_order_holds_a_leaderworkerset_like_a_statefulset():
    """prefillFirst: decode's LeaderWorkerSet takes a new template only once prefill rolled out."""
    s = multi()
    wanted = M.engine_workload(s, OWNER, "decode", lws=True)
    live = copy.deepcopy(wanted)
    live["status"] = {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    assert not M.decode_held(s, False, live, wanted)  # nothing to take
    changed = copy.deepcopy(live)
    engine(changed["spec"]["leaderWorkerTemplate"]["workerTemplate"])["image"] = "reg/dsv4:0"
    assert M.decode_held(s, False, changed, wanted) and not M.decode_held(s, True, changed, wanted)
    behind = dict(live, status={"replicas": 2, "updatedReplicas": 1})
    assert M.decode_held(s, False, behind, wanted)
    held = M.engine_workload(s, OWNER, "decode", hold=True, lws=True)
    assert M.partition_of(held) == M.HOLD_PARTITION and M.partition_of(live) == 0
    assert M.partition_of(M.engine_statefulset(s, OWNER, "decode", hold=True)) == M.HOLD_PARTITION


def test_a_groups_worker_statefulset_is_not_the_roles_workload_in_status():
    """The role's status comes from its leaders' StatefulSet; a worker StatefulSet (owned by its
    leader pod, in both forms) must not stand in for it."""
    from dsv4_operator.status import observe

    sts = M.engine_statefulset(multi(), OWNER, "decode")
    leaders = {**sts, "status": {"readyReplicas": 2, "replicas": 2}}
    workers = G.worker_statefulset(leader_pod(sts, 0), "k", False)
    assert observe(leaders).name == "flash-decode" and observe(leaders).ready == 2
    assert observe(workers) is None
