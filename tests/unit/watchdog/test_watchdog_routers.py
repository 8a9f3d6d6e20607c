"""The watchdog's decision on wedged router pods (watchdog/routers.py): restart one only while
another replica is ready and answering, one at a time, not within the cooldown, never in a dry
run; otherwise report. And which pods are the deployment's routers."""

from __future__ import annotations

from dsv4_operator.watchdog.routers import REPORT, RESTART, RouterPod, decide_routers, router_pods


def _pods(*ready: bool) -> list[RouterPod]:
    return [RouterPod(f"r{i}", f"u{i}", f"http://10.0.0.{i}:8000", ok) for i, ok in enumerate(ready)]


def _decide(pods, wedged, answering, last=None, now=1000.0, dry=False):
    return decide_routers(pods, wedged, answering, now=now, last_restart_at=last, cooldown_s=300.0, dry_run=dry)


def test_a_wedged_router_is_restarted_only_beside_a_ready_answering_one():
    pods = _pods(True, True)
    [step] = _decide(pods, {"r0": "unresponsive"}, {"r1"})
    assert (step.pod, step.uid, step.action) == ("r0", "u0", RESTART) and "r1" in step.why
    # the other replica is not answering (the operator may be the one cut off), or not ready: report
    assert _decide(pods, {"r0": "unresponsive"}, set())[0].action == REPORT
    assert _decide(_pods(True, False), {"r0": "unresponsive"}, {"r1"})[0].action == REPORT
    # the only router: report
    assert _decide(_pods(True), {"r0": "router_stalled"}, set())[0].action == REPORT


def test_one_at_a_time_within_the_cooldown_and_never_in_a_dry_run():
    pods = _pods(True, True, True)
    steps = _decide(pods, {"r0": "unresponsive", "r1": "unresponsive"}, {"r2"})
    assert [s.action for s in steps] == [RESTART, REPORT]
    assert _decide(pods, {"r0": "unresponsive"}, {"r1", "r2"}, last=900.0)[0].action == REPORT
    assert _decide(pods, {"r0": "unresponsive"}, {"r1", "r2"}, last=600.0)[0].action == RESTART
    assert _decide(pods, {"r0": "unresponsive"}, {"r1", "r2"}, dry=True)[0].action == REPORT


def _pod(name, owner_kind, owner, ip="10.0.0.1", ready=True, deleting=False):
    meta = {
        "name": name,
        "uid": name + "-uid",
        "ownerReferences": [{"kind": owner_kind, "name": owner, "controller": True}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_router_pods_are_those_of_the_deployments_router_replicaset():
    objs = [
        _pod("flash-router-abc-1", "ReplicaSet", "flash-router-abc"),
        _pod("flash-router-abc-2", "ReplicaSet", "flash-router-abc", ip=None, ready=False),
        _pod("impostor", "ReplicaSet", "other-router-abc"),
        _pod("flash-router-abc-3", "ReplicaSet", "flash-router-abc", deleting=True),
        _pod("flash-decode-0", "StatefulSet", "flash-decode"),
    ]
    got = router_pods(objs, "flash", 8000)
    assert [(p.name, p.url, p.ready) for p in got] == [
        ("flash-router-abc-1", "http://10.0.0.1:8080", True),
        ("flash-router-abc-2", None, False),
    ]


def test_one_pod_watch_indexes_engines_and_routers_apart():
    """The operator's one pod watch feeds both rounds: engine pods under (namespace, instance),
    router pods under (namespace, instance, "router"); a round never LISTs pods itself."""
    from dsv4_operator.watchdog.pods import ROUTER_PODS, engine_pod_index_key, engine_pod_watch_selector

    def labels(role: str) -> dict:
        return {"app.kubernetes.io/name": "dsv4", "app.kubernetes.io/instance": "flash", "serving.dsv4.dev/role": role}

    assert engine_pod_index_key("serving", labels("prefill")) == ("serving", "flash")
    assert engine_pod_index_key("serving", labels("decode")) == ("serving", "flash")
    assert engine_pod_index_key("serving", labels("router")) == ("serving", "flash", ROUTER_PODS)
    assert engine_pod_index_key("serving", labels("something-else")) is None
    assert engine_pod_index_key("serving", {"serving.dsv4.dev/role": "router"}) is None  # no instance
    assert "router" in engine_pod_watch_selector() and "prefill" in engine_pod_watch_selector()
