"""Children of a DSV4Deployment, built without a cluster: valid Kubernetes (kubernetes-validate
--strict, which rejects unknown fields) and carrying what the engines, the router and the
watchdog rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import copy
import kubernetes_validate
import pytest
import yaml

from dsv4_operator import manifests as M
from dsv4_operator.spec import DEFAULT_NODE_SELECTOR, DEFAULT_TOLERATIONS, parse_spec, spec_revision

EXAMPLES = Path(__file__).resolve().parents[3] / "crds" / "examples"
OWNER = M.Owner(name="flash", namespace="serving", uid="2f1e3b4c-0000-4000-8000-000000000001")
K8S_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
# The releases docs/operations.md supports (Supported clusters): every child validates on each.
SUPPORTED_K8S = ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0")


def spec_of(**overrides: Any):
    raw: dict[str, Any] = {
        "model": {
            "name": "deepseek-v4-flash",
            "path": "/models/dsv4-flash",
            "volume": {"persistentVolumeClaim": {"claimName": "models"}},
        },
        "engine": {"image": "reg/dsv4:1"},
    }
    raw.update(overrides)
    return parse_spec(raw)


def by_key(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def engine_container(sts: dict) -> dict:
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("example", ["flash-builtin.yaml", "flash-sglang.yaml", "flash-production.yaml"])
@pytest.mark.parametrize("k8s_version", sorted(set(SUPPORTED_K8S + K8S_VERSIONS)))
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


@pytest.mark.parametrize("k8s_version", SUPPORTED_K8S)
def test_held_and_scaled_children_validate_on_every_supported_release(k8s_version: str) -> None:
    spec = spec_of(
        decode={"scaling": "external"},
        prefill={
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
            ]
        },
    )
    for child in [*M.build_children(spec, OWNER), M.engine_statefulset(spec, OWNER, "decode", hold=True)]:
        kubernetes_validate.validate(child, k8s_version, strict=True)


def test_image_volumes_do_not_exist_before_1_31() -> None:
    """Why the operator asks the cluster before it uses an image volume (handlers.apply.image_volume_refusal)."""
    spec = spec_of(model={"name": "m", "path": "/models/m", "volume": {"image": {"reference": "reg/ckpt:1"}}})
    sts = M.engine_statefulset(spec, OWNER, "decode")
    for old in ("1.29.0", "1.30.0"):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(sts, old, strict=True)
    kubernetes_validate.validate(sts, "1.31.0", strict=True)


def test_the_router_tokenizes_with_the_checkpoint_where_every_router_pod_can_mount_it() -> None:
    """An image volume: the router mounts it read-only and gets --tokenizer (chat and text prompts
    placed by what each engine holds); a claim (maybe ReadWriteOnce), a hostPath (one node), a
    router image of its own or an engine chat template the router cannot see: no checkpoint."""
    image = {"image": {"reference": "reg/ckpt:1"}}
    spec = spec_of(model={"name": "m", "path": "/models/m", "volume": image})
    dep = M.router_deployment(spec, OWNER)
    kubernetes_validate.validate(dep, "1.31.0", strict=True)
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    cmd = container["command"]
    assert cmd[cmd.index("--tokenizer") + 1] == "/models/m"
    assert any(m["name"] == "model" and m["readOnly"] for m in container["volumeMounts"])
    assert any(v["name"] == "model" and "image" in v for v in pod["volumes"])
    for other in (
        spec_of(),  # a claim
        spec_of(model={"name": "m", "path": "/models/m", "volume": {"hostPath": {"path": "/data/m"}}}),
        spec_of(model={"name": "m", "path": "/models/m", "volume": image}, router={"image": "reg/router:1"}),
        spec_of(
            model={"name": "m", "path": "/models/m", "volume": image},
            engine={"image": "reg/dsv4:1", "args": ["--chat-template", "/etc/t.jinja"]},
        ),
    ):
        dep = M.router_deployment(other, OWNER)
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert "--tokenizer" not in container["command"]
        assert all(m["name"] != "model" for m in container["volumeMounts"])


def test_every_volume_source_validates() -> None:
    for volume in (
        {"persistentVolumeClaim": {"claimName": "m", "readOnly": False}},
        {"hostPath": {"path": "/data/models", "type": "Directory"}},
        {"image": {"reference": "reg/ckpt:1", "pullPolicy": "IfNotPresent"}},
    ):
        spec = spec_of(model={"name": "m", "path": "/models/m", "volume": volume})
        sts = M.engine_statefulset(spec, OWNER, "decode")
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)
        (vol,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
        assert set(vol) == {"name", *volume}


def test_the_children_and_their_names() -> None:
    children = by_key(M.build_children(spec_of(), OWNER))
    assert set(children) == {
        ("StatefulSet", "flash-prefill"),
        ("StatefulSet", "flash-decode"),
        ("Deployment", "flash-router"),
        ("Service", "flash-prefill"),
        ("Service", "flash-decode"),
        ("Service", "flash-router"),
        ("ServiceAccount", "flash-router"),
        ("Role", "flash-router"),
        ("RoleBinding", "flash-router"),
        ("PodDisruptionBudget", "flash-prefill"),
        ("PodDisruptionBudget", "flash-decode"),
        ("NetworkPolicy", "flash-engines"),
        ("NetworkPolicy", "flash-router"),  # on by default (issue 27)
    }
    for (kind, name), child in children.items():
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "serving.dsv4.dev/v1alpha1",
                "kind": "DSV4Deployment",
                "name": "flash",
                "uid": OWNER.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
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
    assert selector == {
        "app.kubernetes.io/name": "dsv4",
        "app.kubernetes.io/instance": "flash",
        "serving.dsv4.dev/role": role,
    }
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
    spec = spec_of(
        engine={"image": "i", "args": ["--max-num-seqs", "128"]},
        prefill={"args": ["--kv-pages", "9000"]},
        transfer={"bootstrapPort": 9000},
    )
    prefill = engine_container(M.engine_statefulset(spec, OWNER, "prefill"))["command"]
    assert prefill[:14] == [
        "dsv4",
        "serve",
        "--model",
        "/models/dsv4-flash",
        "--role",
        "prefill",
        "--host",
        "0.0.0.0",
        "--advertise-host",
        "$(POD_IP)",
        "--port",
        "8100",
        "--bootstrap-port",
        "9000",
    ]
    assert prefill[-4:] == ["--max-num-seqs", "128", "--kv-pages", "9000"]  # user args last: they win
    assert prefill[prefill.index("--served-model-name") + 1] == "deepseek-v4-flash"
    assert prefill[prefill.index("--bootstrap-timeout") + 1] == "300"
    decode = engine_container(M.engine_statefulset(spec, OWNER, "decode"))["command"]
    assert decode[:6] == ["dsv4", "serve", "--model", "/models/dsv4-flash", "--role", "decode"]
    assert "--kv-pages" not in decode
    router = M.router_deployment(spec, OWNER)["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "flash-router"
    (container,) = router["containers"]
    assert container["command"] == [
        "dsv4",
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--discover-namespace",
        "serving",
        "--selector",
        "app.kubernetes.io/instance=flash",
        # only pods our StatefulSets control (issue 27)
        "--owner",
        "flash-prefill",
        "--owner",
        "flash-decode",
    ]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000}


def test_kv_memory_fraction_and_cuda_graphs_reach_every_builtin_engine() -> None:
    """The CRD's engine.kvMemoryFraction / cudaGraphMaxBs become the engine's flags (before the
    user's args, which win); unset, the engine's own defaults apply (nothing passed)."""
    spec = spec_of(engine={"image": "i", "kvMemoryFraction": 0.85, "cudaGraphMaxBs": 0})
    for role in ("prefill", "decode"):
        cmd = engine_container(M.engine_statefulset(spec, OWNER, role))["command"]
        assert cmd[cmd.index("--kv-memory-fraction") + 1] == "0.85"
        assert cmd[cmd.index("--cuda-graph-max-bs") + 1] == "0"
    plain = engine_container(M.engine_statefulset(spec_of(engine={"image": "i"}), OWNER, "decode"))["command"]
    assert "--kv-memory-fraction" not in plain and "--cuda-graph-max-bs" not in plain
    with pytest.raises(ValueError, match="kvMemoryFraction|kv_memory_fraction"):
        spec_of(engine={"image": "i", "kvMemoryFraction": 1.5})


def test_sglang_commands() -> None:
    spec = spec_of(engine={"kind": "sglang", "image": "lmsysorg/sglang:v1", "port": 30000}, decode={"gpusPerPod": 8})
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
    # sgl-router matches labels by equality: a pod the watchdog labels draining=true drops out.
    i = rc.index("--prefill-selector")
    assert rc[i + 1 : i + 4] == [
        "app.kubernetes.io/instance=flash",
        "serving.dsv4.dev/role=prefill",
        "serving.dsv4.dev/draining=false",
    ]
    i = rc.index("--decode-selector")
    assert rc[i + 1 : i + 4] == [
        "app.kubernetes.io/instance=flash",
        "serving.dsv4.dev/role=decode",
        "serving.dsv4.dev/draining=false",
    ]
    assert rc[i + 4].startswith("--")
    for role in ("prefill", "decode"):
        labels = M.engine_statefulset(spec, OWNER, role)["spec"]["template"]["metadata"]["labels"]
        assert labels[M.LABEL_DRAINING] == "false"
        assert M.LABEL_DRAINING not in M.engine_statefulset(spec, OWNER, role)["spec"]["selector"]["matchLabels"]
    builtin = M.engine_statefulset(spec_of(), OWNER, "decode")["spec"]["template"]["metadata"]["labels"]
    assert M.LABEL_DRAINING not in builtin  # dsv4 router reads the label itself; no template change
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert router["image"] == "lmsysorg/sglang:v1"


def test_transfer_environment() -> None:
    spec = spec_of(
        transfer={"ucxNetDevices": "mlx5_0:1,mlx5_1:1", "env": [{"name": "UCX_TLS", "value": "rc,cuda"}]},
        decode={"env": [{"name": "UCX_TLS", "value": "rc"}]},
    )
    prefill = env_of(engine_container(M.engine_statefulset(spec, OWNER, "prefill")))
    decode = env_of(engine_container(M.engine_statefulset(spec, OWNER, "decode")))
    assert prefill["UCX_NET_DEVICES"] == decode["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert decode["UCX_CUDA_IPC_CACHE"] == "n" and "UCX_CUDA_IPC_CACHE" not in prefill
    assert prefill["UCX_TLS"] == "rc,cuda" and decode["UCX_TLS"] == "rc"  # role env wins
    assert prefill["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    unset = env_of(engine_container(M.engine_statefulset(spec_of(), OWNER, "prefill")))
    assert "UCX_NET_DEVICES" not in unset


def test_placement_and_resources_overrides() -> None:
    spec = spec_of(
        prefill={
            "nodeSelector": {"pool": "b200"},
            "tolerations": [],
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            "resources": {"limits": {"memory": "900Gi"}, "requests": {"cpu": 16}},
            "gpusPerPod": 8,
            "shmSize": "64Gi",
        },
        decode={"gpusPerPod": 0},
    )
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


@pytest.mark.parametrize(
    "name,spec_overrides,fragment",
    [
        ("a" * (M.MAX_NAME_LENGTH + 1), {}, "too long"),
        ("9lives", {}, "DNS-1035"),
        (
            "flash",
            {
                "model": {
                    "name": "m",
                    "path": "/m",
                    "volume": {"persistentVolumeClaim": {"claimName": "x"}, "hostPath": {"path": "/y"}},
                }
            },
            "exactly one",
        ),
        ("flash", {"model": {"name": "m", "path": "/m", "volume": {}}}, "exactly one"),
        ("flash", {"engine": {"image": "i", "port": 8998}}, "bootstrapPort"),
    ],
)
def test_unbuildable_specs_are_reported(name: str, spec_overrides: dict, fragment: str) -> None:
    reasons = M.unbuildable_reasons(name, spec_of(**spec_overrides))
    assert len(reasons) == 1 and fragment in reasons[0]


def test_longest_allowed_name_builds_valid_children() -> None:
    name = "a" * M.MAX_NAME_LENGTH
    assert M.unbuildable_reasons(name, spec_of()) == []
    for child in M.build_children(spec_of(), M.Owner(name, "ns", "u")):
        kubernetes_validate.validate(child, K8S_VERSIONS[0], strict=True)
        assert len(child["metadata"]["name"]) + len("-") + 10 <= 63 or child["kind"] != "StatefulSet"


# ---- Disruption: PDBs, the preStop drain, grace and startup budgets ------------------------------


def test_disruption_budget_per_engine_role_follows_max_unavailable() -> None:
    spec = spec_of(remediation={"maxUnavailable": {"prefill": 2, "decode": 0}})
    children = by_key(M.build_children(spec, OWNER))
    for role, limit in (("prefill", 2), ("decode", 0)):
        pdb = children[("PodDisruptionBudget", f"flash-{role}")]
        kubernetes_validate.validate(pdb, K8S_VERSIONS[0], strict=True)
        assert pdb["spec"]["maxUnavailable"] == limit
        assert pdb["spec"]["selector"]["matchLabels"] == M.selector_labels("flash", role)
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert ("policy/v1", "PodDisruptionBudget", "flash-prefill") not in M.absent_children(spec, OWNER)


def test_disruption_budget_off_is_not_built_and_is_deleted() -> None:
    spec = spec_of(remediation={"podDisruptionBudget": False})
    assert not [c for c in M.build_children(spec, OWNER) if c["kind"] == "PodDisruptionBudget"]
    assert M.absent_children(spec, OWNER)[:2] == [
        ("policy/v1", "PodDisruptionBudget", "flash-prefill"),
        ("policy/v1", "PodDisruptionBudget", "flash-decode"),
    ]


def test_grace_and_startup_budget_come_from_the_role() -> None:
    spec = spec_of(prefill={"terminationGracePeriodSeconds": 300, "startupTimeoutSeconds": 3605})
    pod = M.engine_statefulset(spec, OWNER, "prefill")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    startup = pod["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3605
    assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < 3605
    decode = M.engine_statefulset(spec, OWNER, "decode")["spec"]["template"]["spec"]
    assert decode["terminationGracePeriodSeconds"] == 120  # the default, per role


def test_sglang_prestop_only_waits() -> None:
    spec = spec_of(engine={"kind": "sglang", "image": "i"})
    hook = engine_container(M.engine_statefulset(spec, OWNER, "decode"))["lifecycle"]["preStop"]
    assert hook == {"exec": {"command": ["sleep", "15"]}}


def test_prestop_drains_the_engine_then_waits_for_its_queues(tmp_path: Path) -> None:
    """Run the hook's script against a real HTTP server standing in for the engine's admin and
    loads endpoints: it POSTs the drain with the admin token, then polls until the queues empty."""
    import http.server
    import json
    import os
    import subprocess
    import sys
    import threading

    seen: list[tuple[str, str, str]] = []
    polls = {"n": 0}

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            seen.append(("POST", self.path, self.headers.get("Authorization", "")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"draining": true}')

        def do_GET(self) -> None:  # noqa: N802
            polls["n"] += 1
            seen.append(("GET", self.path, ""))
            body = json.dumps({"queues": {"waiting": 0, "running": 1 if polls["n"] < 3 else 0}}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = spec_of(
            engine={"image": "i", "port": server.server_address[1]}, decode={"terminationGracePeriodSeconds": 40}
        )
        command = engine_container(M.engine_statefulset(spec, OWNER, "decode"))["lifecycle"]["preStop"]["exec"][
            "command"
        ]
        assert command[0] == "python3"
        subprocess.run(
            [sys.executable, *command[1:]], check=True, timeout=30, env={**os.environ, M.ADMIN_TOKEN_ENV: "s3cret"}
        )
    finally:
        server.shutdown()
    assert seen[0] == ("POST", M.Paths.ADMIN_DRAIN, "Bearer s3cret")
    assert [s[1] for s in seen[1:]] == [M.Paths.LOADS] * 3  # stopped polling once the queues were empty


# ---- Security: contexts, the auth Secret, the NetworkPolicy --------------------------------------

PSA_RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pods_of(spec) -> dict[str, dict]:
    children = by_key(M.build_children(spec, OWNER))
    return {
        role: children[(kind, f"flash-{role}")]["spec"]["template"]["spec"]
        for role, kind in (("prefill", "StatefulSet"), ("decode", "StatefulSet"), ("router", "Deployment"))
    }


def test_builtin_pods_meet_the_restricted_profile() -> None:
    for role, pod in pods_of(spec_of()).items():
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True}, role
        (container,) = pod["containers"]
        # Builtin engines' and router's root file systems are read-only, scratch on emptyDirs (issue 27).
        assert container["securityContext"] == {**PSA_RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True}, role
        # restricted allows these volume types only (hostPath is not among them)
        assert all(
            set(v) - {"name"} <= {"emptyDir", "persistentVolumeClaim", "image", "secret", "configMap"}
            for v in pod.get("volumes", [])
        ), role


def test_the_router_has_default_limits_unless_resources_are_given() -> None:
    router = pods_of(spec_of())["router"]["containers"][0]
    assert router["resources"] == M.ROUTER_DEFAULT_RESOURCES
    assert router["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    given = pods_of(spec_of(router={"resources": {"limits": {"memory": "1Gi"}}}))["router"]["containers"][0]
    assert given["resources"] == {"limits": {"memory": "1Gi"}}


def test_builtin_engines_write_only_to_emptydirs_and_have_default_limits() -> None:
    for role in ("prefill", "decode"):
        pod = pods_of(spec_of())[role]
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/tmp"] == "tmp" and mounts[M.ENGINE_HOME] == "home"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tmp"]["emptyDir"]["sizeLimit"] and volumes["home"]["emptyDir"]["sizeLimit"]
        assert {"name": "HOME", "value": M.ENGINE_HOME} in c["env"]
        assert c["resources"]["limits"]["memory"] == M.ENGINE_DEFAULT_RESOURCES["limits"]["memory"]
        assert c["resources"]["requests"]["cpu"] == M.ENGINE_DEFAULT_RESOURCES["requests"]["cpu"]
    gpus = M.engine_statefulset(spec_of(prefill={"gpusPerPod": 4}), OWNER, "prefill")
    res = engine_container(gpus)["resources"]
    assert res["limits"] == {**M.ENGINE_DEFAULT_RESOURCES["limits"], "nvidia.com/gpu": 4}
    given = engine_container(
        M.engine_statefulset(spec_of(prefill={"resources": {"limits": {"memory": "1Ti"}}}), OWNER, "prefill")
    )
    assert given["resources"] == {"limits": {"memory": "1Ti", "nvidia.com/gpu": 4}, "requests": {"nvidia.com/gpu": 4}}
    # SGLang's image writes all over its root: left writable, said in docs/operations.md.
    sglang = pods_of(spec_of(engine={"kind": "sglang", "image": "lmsysorg/sglang:v0"}))["prefill"]["containers"][0]
    assert "readOnlyRootFilesystem" not in sglang["securityContext"]
    assert sglang["resources"]["limits"]["memory"]  # limits all the same


def test_sglang_runs_as_root_unless_a_uid_is_given_and_ipc_lock_is_opt_in() -> None:
    sglang = pods_of(spec_of(engine={"kind": "sglang", "image": "lmsysorg/sglang:v0"}))
    assert "runAsNonRoot" not in sglang["decode"]["securityContext"]
    assert sglang["decode"]["containers"][0]["securityContext"] == PSA_RESTRICTED_CONTAINER
    pinned = pods_of(spec_of(engine={"kind": "sglang", "image": "i"}, security={"runAsUser": 1000, "ipcLock": True}))
    assert pinned["prefill"]["securityContext"]["runAsUser"] == 1000
    assert pinned["prefill"]["securityContext"]["runAsNonRoot"] is True
    assert pinned["prefill"]["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["IPC_LOCK"],
    }
    assert pinned["router"]["containers"][0]["securityContext"] == PSA_RESTRICTED_CONTAINER


def test_engines_and_router_read_the_admin_token_and_pd_secret_from_the_deployment_secret() -> None:
    for spec, secret in ((spec_of(), "flash-auth"), (spec_of(security={"secretName": "mine"}), "mine")):
        for role, pod in pods_of(spec).items():
            env = env_of(pod["containers"][0])
            # The router has an admin token of its own (issue 27): engine admin is not router admin.
            admin = "router-admin-token" if role == "router" else "admin-token"
            assert env[M.ADMIN_TOKEN_ENV] == {"secretKeyRef": {"name": secret, "key": admin}}, role
            assert env[M.PD_SECRET_ENV] == {"secretKeyRef": {"name": secret, "key": "pd-secret"}}, role
    made = M.auth_secret(spec_of(), OWNER, {"admin-token": "a", "pd-secret": "p"})
    kubernetes_validate.validate(made, K8S_VERSIONS[0], strict=True)
    assert made["metadata"]["name"] == "flash-auth" and made["stringData"] == {"admin-token": "a", "pd-secret": "p"}
    assert made["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_network_policy_admits_router_operator_and_peers_only() -> None:
    # On by default (issue 27); off on request.
    assert [c for c in M.build_children(spec_of(), OWNER) if c["kind"] == "NetworkPolicy"]
    off = spec_of(security={"networkPolicy": {"enabled": False}})
    assert not [c for c in M.build_children(off, OWNER) if c["kind"] == "NetworkPolicy"]
    assert ("networking.k8s.io/v1", "NetworkPolicy", "flash-engines") in M.absent_children(off, OWNER)
    assert ("networking.k8s.io/v1", "NetworkPolicy", "flash-router") in M.absent_children(off, OWNER)
    spec = spec_of(
        security={
            "networkPolicy": {
                "enabled": True,
                "allowFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            }
        }
    )
    policy = by_key(M.build_children(spec, OWNER, operator_namespace="dsv4-system"))[("NetworkPolicy", "flash-engines")]
    kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)
    assert M.absent_children(spec, OWNER) == []
    sel = policy["spec"]["podSelector"]
    assert sel["matchLabels"] == {M.LABEL_NAME: "dsv4", M.LABEL_INSTANCE: "flash"}
    assert sel["matchExpressions"] == [{"key": M.LABEL_ROLE, "operator": "In", "values": ["prefill", "decode"]}]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    front, peers, extra = policy["spec"]["ingress"]
    assert front["ports"] == [{"port": 8100, "protocol": "TCP"}]
    router, operator = front["from"]
    assert router == {"podSelector": {"matchLabels": M.selector_labels("flash", "router")}}
    assert operator == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "dsv4-operator"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dsv4-system"}},
    }
    assert peers == {"from": [{"podSelector": sel}]}  # every port: NIXL over TCP picks its own
    assert extra["ports"] == front["ports"] and extra["from"][0]["namespaceSelector"]
    # the router pods match the router peer, engine pods the peer rule, neither matches the other
    labels_of = {
        role: pod_labels
        for role, pod_labels in (
            (r, p["metadata"]["labels"])
            for r, p in (
                (r, by_key(M.build_children(spec, OWNER))[(k, f"flash-{r}")]["spec"]["template"])
                for r, k in (("prefill", "StatefulSet"), ("decode", "StatefulSet"), ("router", "Deployment"))
            )
        )
    }
    for role, pod_labels in labels_of.items():
        is_engine = pod_labels.get(M.LABEL_ROLE) in sel["matchExpressions"][0]["values"]
        assert is_engine == (role != "router")
        assert all(pod_labels.get(k) == v for k, v in router["podSelector"]["matchLabels"].items()) == (
            role == "router"
        )


def test_engine_egress_reaches_only_peers_dns_and_what_is_added() -> None:
    spec = spec_of(
        security={
            "networkPolicy": {
                "extraEgress": [
                    {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"port": 4317, "protocol": "TCP"}]}
                ]
            }
        }
    )
    policy = by_key(M.build_children(spec, OWNER))[("NetworkPolicy", "flash-engines")]
    peers, dns, otlp = policy["spec"]["egress"]
    assert peers == {"to": [{"podSelector": policy["spec"]["podSelector"]}]}  # every port: NIXL
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    assert otlp["to"] == [{"ipBlock": {"cidr": "10.9.0.0/16"}}]


def test_router_network_policy_on_by_default_clients_in_egress_to_engines_dns_api() -> None:
    default = by_key(M.build_children(spec_of(), OWNER, operator_namespace="dsv4-system"))
    policy = default[("NetworkPolicy", "flash-router")]
    kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)
    assert policy["spec"]["podSelector"] == {"matchLabels": M.selector_labels("flash", "router")}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    clients, operator = rule["from"]
    assert clients == {"podSelector": {}}  # default: the deployment's own namespace
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "dsv4-system"}}
    engines, dns, api = policy["spec"]["egress"]
    engine_policy = default[("NetworkPolicy", "flash-engines")]
    assert engines == {
        "to": [{"podSelector": engine_policy["spec"]["podSelector"]}],
        "ports": [{"port": 8100, "protocol": "TCP"}],
    }
    assert dns["ports"][0]["port"] == 53 and "to" not in dns
    assert {p["port"] for p in api["ports"]} == {443, 6443}
    assert [t["ipBlock"]["cidr"] for t in api["to"]] == ["0.0.0.0/0", "::/0"]
    # The router pods are the ones selected; engine pods are not.
    router_labels = default[("Deployment", "flash-router")]["spec"]["template"]["metadata"]["labels"]
    engine_labels = default[("StatefulSet", "flash-prefill")]["spec"]["template"]["metadata"]["labels"]
    sel = policy["spec"]["podSelector"]["matchLabels"]
    assert all(router_labels.get(k) == v for k, v in sel.items())
    assert not all(engine_labels.get(k) == v for k, v in sel.items())
    # Clients named: only they (and the operator) reach the router; the API narrowed.
    named = spec_of(
        security={
            "networkPolicy": {
                "clients": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}],
                "apiServerCidrs": ["10.0.0.1/32"],
            }
        }
    )
    policy = by_key(M.build_children(named, OWNER))[("NetworkPolicy", "flash-router")]
    assert policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ingress"
    }
    assert policy["spec"]["egress"][2]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)


# ---- Scaling: who owns replicas -------------------------------------------------------------------


def test_external_scaling_leaves_replicas_out_of_the_applied_config() -> None:
    spec = spec_of(decode={"replicas": 3, "scaling": "external"}, router={"scaling": "external"})
    children = by_key(M.build_children(spec, OWNER))
    assert "replicas" not in children[("StatefulSet", "flash-decode")]["spec"]
    assert "replicas" not in children[("Deployment", "flash-router")]["spec"]
    assert children[("StatefulSet", "flash-prefill")]["spec"]["replicas"] == 1
    assert M.initial_replicas(spec, "decode") == 3
    handover = M.scale_handover(OWNER, "decode", 3)
    assert handover == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "flash-decode", "namespace": "serving"},
        "spec": {"replicas": 3},
    }
    assert M.scale_handover(OWNER, "router", 2)["kind"] == "Deployment"
    assert M.SCALE_MANAGER != M.MANAGER


# ---- Rollout: PD-aware order, partitions ----------------------------------------------------------


def test_partition_and_hold() -> None:
    spec = spec_of(decode={"replicas": 4, "partition": 3})
    assert M.engine_statefulset(spec, OWNER, "decode")["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"partition": 3},
    }
    held = M.engine_statefulset(spec, OWNER, "decode", hold=True)
    assert held["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == M.HOLD_PARTITION
    kubernetes_validate.validate(held, K8S_VERSIONS[0], strict=True)


def test_prefill_rolled_out() -> None:
    def sts(gen: int, observed: int, replicas: int, updated: int, ready: int) -> dict:
        return {
            "metadata": {"generation": gen},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "updatedReplicas": updated, "readyReplicas": ready},
        }

    assert M.prefill_rolled_out(sts(2, 2, 3, 3, 3)) and M.prefill_rolled_out(None)
    assert not M.prefill_rolled_out(sts(3, 2, 3, 3, 3))  # the controller has not seen the new template
    assert not M.prefill_rolled_out(sts(2, 2, 3, 2, 3))  # a pod still on the old template
    assert not M.prefill_rolled_out(sts(2, 2, 3, 3, 2))  # a new pod not ready yet
    assert M.prefill_rolled_out(sts(2, 2, 0, 0, 0))


def test_decode_is_held_only_with_a_change_to_take_and_prefill_not_rolled_out() -> None:
    old, new = spec_of(), spec_of(engine={"image": "reg/dsv4:2"})
    wanted = M.engine_statefulset(new, OWNER, "decode")
    live_old = M.engine_statefulset(old, OWNER, "decode")
    live_old["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = (
        "/dev/termination-log"  # a default
    )
    assert M.decode_held(new, False, live_old, wanted)  # its template is to change, prefill still rolling
    assert not M.decode_held(new, True, live_old, wanted)  # prefill done
    assert not M.decode_held(new, False, None, wanted)  # a new deployment: nothing to hold
    live_new = M.engine_statefulset(new, OWNER, "decode")
    live_new["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    assert not M.decode_held(new, False, live_new, wanted)  # template as wanted (defaults added): nothing to take
    live_new["status"] = {"currentRevision": "d-1", "updateRevision": "d-2"}
    assert M.decode_held(new, False, live_new, wanted)  # held with the new template, pods still on the old one
    together = spec_of(engine={"image": "reg/dsv4:2"}, rollout={"order": "together"})
    assert not M.decode_held(together, False, live_old, wanted)
    assert M.contains({"a": [{"b": 1, "c": 2}], "d": 3}, {"a": [{"b": 1}]})
    assert not M.contains({"a": [{"b": 1}, {"b": 2}]}, {"a": [{"b": 1}]})


def test_contains_compares_quantities_by_value_as_the_server_serves_them() -> None:
    wanted = {
        "resources": {"limits": {"nvidia.com/gpu": 4, "cpu": "1000m", "memory": "1024Mi"}},
        "emptyDir": {"sizeLimit": "16384Mi"},
        "replicas": 4,
    }
    served = {
        "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "1", "memory": "1Gi"}},
        "emptyDir": {"sizeLimit": "16Gi"},
        "replicas": 4,
    }
    assert M.contains(served, wanted)
    assert not M.contains(
        dict(served, resources={"limits": {"nvidia.com/gpu": "8", "cpu": "1", "memory": "1Gi"}}), wanted
    )
    assert not M.contains(dict(served, replicas="4"), wanted), "only quantity fields compare by value"
    # A decode StatefulSet read back from the server (quantities canonical) is the one wanted.
    spec = spec_of()
    wanted_sts = M.engine_statefulset(spec, OWNER, "decode")
    live = copy.deepcopy(wanted_sts)
    for c in live["spec"]["template"]["spec"]["containers"]:
        for part in ("limits", "requests"):
            c["resources"][part] = {k: str(v) for k, v in c["resources"].get(part, {}).items()}
    assert not M.decode_held(spec, False, live, wanted_sts)
