"""Children of a DSV4Deployment, built without a cluster: valid Kubernetes (kubernetes-validate
--strict, which rejects unknown fields) and carrying what the engines, the router and the
watchdog rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dsv4_operator import manifests as M
from dsv4_operator.spec import DEFAULT_NODE_SELECTOR, DEFAULT_TOLERATIONS, parse_spec, spec_revision

EXAMPLES = Path(__file__).resolve().parents[3] / "crds" / "examples"
OWNER = M.Owner(name="flash", namespace="serving", uid="2f1e3b4c-0000-4000-8000-000000000001")
K8S_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())


def spec_of(**overrides: Any):
    raw: dict[str, Any] = {"model": {"name": "deepseek-v4-flash", "path": "/models/dsv4-flash",
                                     "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
                           "engine": {"image": "reg/dsv4:1"}}
    raw.update(overrides)
    return parse_spec(raw)


def by_key(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def engine_container(sts: dict) -> dict:
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("example", ["flash-builtin.yaml", "flash-sglang.yaml"])
@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_children_are_valid_kubernetes_strict(example: str, k8s_version: str) -> None:
    spec = parse_spec(yaml.safe_load((EXAMPLES / example).read_text())["spec"])
    children = M.build_children(spec, OWNER)
    for child in children:
        kubernetes_validate.validate(child, k8s_version, strict=True)


def test_strict_validation_does_reject_unknown_fields() -> None:
    sts = M.engine_statefulset(spec_of(), OWNER, "prefill")
    sts["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)


def test_every_volume_source_validates() -> None:
    for volume in ({"persistentVolumeClaim": {"claimName": "m", "readOnly": False}},
                   {"hostPath": {"path": "/data/models", "type": "Directory"}},
                   {"image": {"reference": "reg/ckpt:1", "pullPolicy": "IfNotPresent"}}):
        spec = spec_of(model={"name": "m", "path": "/models/m", "volume": volume})
        sts = M.engine_statefulset(spec, OWNER, "decode")
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)
        (vol,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
        assert set(vol) == {"name", *volume}


def test_the_children_and_their_names() -> None:
    children = by_key(M.build_children(spec_of(), OWNER))
    assert set(children) == {
        ("StatefulSet", "flash-prefill"), ("StatefulSet", "flash-decode"), ("Deployment", "flash-router"),
        ("Service", "flash-prefill"), ("Service", "flash-decode"), ("Service", "flash-router"),
        ("ServiceAccount", "flash-router"), ("Role", "flash-router"), ("RoleBinding", "flash-router"),
    }
    for (kind, name), child in children.items():
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [{"apiVersion": "serving.dsv4.dev/v1alpha1", "kind": "DSV4Deployment",
                                            "name": "flash", "uid": OWNER.uid, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"][M.LABEL_NAME] == "dsv4"
        assert meta["labels"][M.LABEL_INSTANCE] == "flash"
        assert meta["labels"][M.LABEL_ROLE] == name.rsplit("-", 1)[1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_statefulset_pod(role: str) -> None:
    spec = spec_of()
    sts = M.engine_statefulset(spec, OWNER, role, "rev1")
    assert sts["spec"]["serviceName"] == f"flash-{role}"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["metadata"]["annotations"] == {M.ANNOTATION_REVISION: "rev1"}
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "dsv4", "app.kubernetes.io/instance": "flash",
                        "serving.dsv4.dev/role": role}
    pod = sts["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"][M.LABEL_ENGINE_KIND] == "builtin"
    container = engine_container(sts)
    assert container["name"] == "engine"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8100
    assert ("bootstrap" in ports) == (role == "prefill")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 1200
    pod_spec = pod["spec"]
    assert pod_spec["nodeSelector"] == DEFAULT_NODE_SELECTOR
    assert pod_spec["tolerations"] == DEFAULT_TOLERATIONS
    shm = next(v for v in pod_spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_builtin_commands() -> None:
    spec = spec_of(engine={"image": "i", "args": ["--max-num-seqs", "128"]},
                   prefill={"args": ["--kv-pages", "9000"]}, transfer={"bootstrapPort": 9000})
    prefill = engine_container(M.engine_statefulset(spec, OWNER, "prefill"))["command"]
    assert prefill[:12] == ["dsv4", "serve", "--model", "/models/dsv4-flash", "--role", "prefill",
                            "--host", "0.0.0.0", "--port", "8100", "--bootstrap-port", "9000"]
    assert prefill[-4:] == ["--max-num-seqs", "128", "--kv-pages", "9000"]  # user args last: they win
    assert prefill[prefill.index("--served-model-name") + 1] == "deepseek-v4-flash"
    assert prefill[prefill.index("--bootstrap-timeout") + 1] == "300"
    decode = engine_container(M.engine_statefulset(spec, OWNER, "decode"))["command"]
    assert decode[:6] == ["dsv4", "serve", "--model", "/models/dsv4-flash", "--role", "decode"]
    assert "--kv-pages" not in decode
    router = M.router_deployment(spec, OWNER)["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "flash-router"
    (container,) = router["containers"]
    assert container["command"] == ["dsv4", "router", "--host", "0.0.0.0", "--port", "8000",
                                    "--discover-namespace", "serving",
                                    "--selector", "app.kubernetes.io/instance=flash"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000}


def test_sglang_commands() -> None:
    spec = spec_of(engine={"kind": "sglang", "image": "lmsysorg/sglang:v1", "port": 30000},
                   decode={"gpusPerPod": 8})
    prefill = engine_container(M.engine_statefulset(spec, OWNER, "prefill"))
    cmd = prefill["command"]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]

    def flag(c: list[str], name: str) -> str:
        return c[c.index(name) + 1]

    assert flag(cmd, "--model-path") == "/models/dsv4-flash"
    assert flag(cmd, "--disaggregation-mode") == "prefill"
    assert flag(cmd, "--disaggregation-transfer-backend") == "nixl"
    assert flag(cmd, "--disaggregation-bootstrap-port") == "8998"
    assert flag(cmd, "--port") == "30000" and flag(cmd, "--tp-size") == "4"
    assert "--enable-metrics" in cmd
    assert env_of(prefill)["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] == "300"
    pod = M.engine_statefulset(spec, OWNER, "prefill")["spec"]["template"]
    assert pod["metadata"]["annotations"][M.SGLANG_BOOTSTRAP_ANNOTATION] == "8998"
    assert pod["metadata"]["labels"][M.LABEL_ENGINE_KIND] == "sglang"
    assert prefill["readinessProbe"]["httpGet"]["path"] == "/health"
    decode = engine_container(M.engine_statefulset(spec, OWNER, "decode"))["command"]
    assert flag(decode, "--disaggregation-mode") == "decode" and flag(decode, "--tp-size") == "8"
    assert "--disaggregation-bootstrap-port" not in decode
    (router,) = M.router_deployment(spec, OWNER)["spec"]["template"]["spec"]["containers"]
    rc = router["command"]
    assert rc[:4] == ["python3", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    assert "--service-discovery" in rc and flag(rc, "--service-discovery-namespace") == "serving"
    assert flag(rc, "--service-discovery-port") == "30000"
    i = rc.index("--prefill-selector")
    assert rc[i + 1:i + 3] == ["app.kubernetes.io/instance=flash", "serving.dsv4.dev/role=prefill"]
    i = rc.index("--decode-selector")
    assert rc[i + 1:i + 3] == ["app.kubernetes.io/instance=flash", "serving.dsv4.dev/role=decode"]
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert router["image"] == "lmsysorg/sglang:v1"


def test_transfer_environment() -> None:
    spec = spec_of(transfer={"ucxNetDevices": "mlx5_0:1,mlx5_1:1", "env": [{"name": "UCX_TLS", "value": "rc,cuda"}]},
                   decode={"env": [{"name": "UCX_TLS", "value": "rc"}]})
    prefill = env_of(engine_container(M.engine_statefulset(spec, OWNER, "prefill")))
    decode = env_of(engine_container(M.engine_statefulset(spec, OWNER, "decode")))
    assert prefill["UCX_NET_DEVICES"] == decode["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert decode["UCX_CUDA_IPC_CACHE"] == "n" and "UCX_CUDA_IPC_CACHE" not in prefill
    assert prefill["UCX_TLS"] == "rc,cuda" and decode["UCX_TLS"] == "rc"  # role env wins
    assert prefill["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    unset = env_of(engine_container(M.engine_statefulset(spec_of(), OWNER, "prefill")))
    assert "UCX_NET_DEVICES" not in unset


def test_placement_and_resources_overrides() -> None:
    spec = spec_of(prefill={"nodeSelector": {"pool": "b200"}, "tolerations": [],
                            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
                            "resources": {"limits": {"memory": "900Gi"}, "requests": {"cpu": 16}},
                            "gpusPerPod": 8, "shmSize": "64Gi"},
                   decode={"gpusPerPod": 0})
    pod = M.engine_statefulset(spec, OWNER, "prefill")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "b200"} and pod["tolerations"] == []
    assert "podAntiAffinity" in pod["affinity"]
    res = pod["containers"][0]["resources"]
    assert res == {"limits": {"memory": "900Gi", "nvidia.com/gpu": 8}, "requests": {"cpu": 16, "nvidia.com/gpu": 8}}
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "64Gi"
    decode = M.engine_statefulset(spec, OWNER, "decode")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(decode["containers"][0]["resources"])
    assert "--dtype" not in decode["containers"][0]["command"]
    assert "affinity" not in decode


def test_services() -> None:
    spec = spec_of(router={"port": 9000})
    children = by_key(M.build_children(spec, OWNER))
    prefill = children[("Service", "flash-prefill")]["spec"]
    assert prefill["clusterIP"] == "None" and prefill["publishNotReadyAddresses"] is True
    assert {p["name"] for p in prefill["ports"]} == {"http", "bootstrap"}
    assert prefill["selector"] == M.selector_labels("flash", "prefill")
    router = children[("Service", "flash-router")]["spec"]
    assert router["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    role = children[("Role", "flash-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = children[("RoleBinding", "flash-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flash-router", "namespace": "serving"}]


def test_merge_env_later_wins_first_position_kept() -> None:
    merged = M.merge_env([{"name": "A", "value": "1"}, {"name": "B", "value": "2"}], [{"name": "A", "value": "3"}])
    assert merged == [{"name": "A", "value": "3"}, {"name": "B", "value": "2"}]


def test_revision_annotation_follows_the_spec() -> None:
    a, b = spec_of(), spec_of(prefill={"replicas": 3})
    rev = lambda s: M.build_children(s, OWNER)[-1]["metadata"]["annotations"][M.ANNOTATION_REVISION]  # noqa: E731
    assert rev(a) == spec_revision(a) != rev(b)


@pytest.mark.parametrize("name,spec_overrides,fragment", [
    ("a" * (M.MAX_NAME_LENGTH + 1), {}, "too long"),
    ("9lives", {}, "DNS-1035"),
    ("flash", {"model": {"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "x"},
                                                                  "hostPath": {"path": "/y"}}}}, "exactly one"),
    ("flash", {"model": {"name": "m", "path": "/m", "volume": {}}}, "exactly one"),
    ("flash", {"engine": {"image": "i", "port": 8998}}, "bootstrapPort"),
])
def test_unbuildable_specs_are_reported(name: str, spec_overrides: dict, fragment: str) -> None:
    reasons = M.unbuildable_reasons(name, spec_of(**spec_overrides))
    assert len(reasons) == 1 and fragment in reasons[0]


def test_longest_allowed_name_builds_valid_children() -> None:
    name = "a" * M.MAX_NAME_LENGTH
    assert M.unbuildable_reasons(name, spec_of()) == []
    for child in M.build_children(spec_of(), M.Owner(name, "ns", "u")):
        kubernetes_validate.validate(child, K8S_VERSIONS[0], strict=True)
        assert len(child["metadata"]["name"]) + len("-") + 10 <= 63 or child["kind"] != "StatefulSet"
