"""What the canary daemon reads off the cluster, pure: which pods are the deployment's routers,
and whether the canary pod runs the wanted template."""

from __future__ import annotations

from dsv4_operator.rollout import pod_on_template, router_urls


def router_pod(ip: str, controller: tuple[str, str], ready: bool = True, port: int = 8000) -> dict:
    kind, name = controller
    return {
        "metadata": {"name": f"{name}-x", "ownerReferences": [{"kind": kind, "name": name, "controller": True}]},
        "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_only_ready_router_pods_of_the_deployment_get_the_admin_token() -> None:
    pods = [
        router_pod("10.0.0.1", ("ReplicaSet", "flash-router-abc")),
        router_pod("10.0.0.2", ("ReplicaSet", "flash-router-abc"), ready=False),
        router_pod("10.0.0.3", ("ReplicaSet", "other-router-abc")),  # labels copied onto a foreign pod
        router_pod("10.0.0.4", ("StatefulSet", "flash-router-abc")),
        router_pod("10.0.0.5", ("ReplicaSet", "flash-router-def"), port=9000),
    ]
    assert router_urls(pods, 8000, "flash") == ["http://10.0.0.1:8000", "http://10.0.0.5:9000"]


def test_the_canary_pod_must_run_the_latest_template_and_that_template_must_be_the_wanted_one() -> None:
    wanted = {"spec": {"containers": [{"name": "engine", "image": "reg/dsv4:2"}]}}
    sts = {
        "metadata": {"generation": 3},
        "spec": {"template": wanted},
        "status": {"observedGeneration": 3, "updateRevision": "flash-decode-new"},
    }
    pod = {"metadata": {"labels": {"controller-revision-hash": "flash-decode-new"}}}
    old_pod = {"metadata": {"labels": {"controller-revision-hash": "flash-decode-old"}}}
    assert pod_on_template(pod, sts, wanted)
    assert not pod_on_template(old_pod, sts, wanted)
    assert not pod_on_template(pod, {**sts, "status": {**sts["status"], "observedGeneration": 2}}, wanted)
    other = {"spec": {"containers": [{"name": "engine", "image": "reg/dsv4:3"}]}}
    assert not pod_on_template(pod, sts, other), "the StatefulSet has not taken the wanted template yet"
    assert not pod_on_template(None, sts, wanted)
