"""Every manifest the operator writes, with every option that changes a manifest, validates
(kubernetes-validate --strict: unknown fields refused) on each release docs/operations.md supports:
the children, the auth Secret, the evidence ConfigMap (issue 32). test_operator_manifests checks
the shipped examples on each release; this covers the options they leave out."""

from __future__ import annotations

import kubernetes_validate
import pytest

from dsv4_operator import manifests as M
from dsv4_operator.spec import parse_spec
from dsv4_operator.watchdog.evidence import build_evidence_configmap

# The newest in the default run; the older releases slow-marked (every validation walks the
# release's whole schema: about half a second a manifest on the CI machine).
SUPPORTED_K8S = (*(pytest.param(v, marks=pytest.mark.slow) for v in ("1.29.0", "1.30.0", "1.31.0", "1.32.0")), "1.33.0")
OWNER = M.Owner(name="flash", namespace="serving", uid="2f1e3b4c-0000-4000-8000-000000000001")
BASE = {
    "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
    "engine": {"image": "reg/dsv4:1"},
}
OPTIONS = {
    "ipc-lock-and-uid": {"security": {"ipcLock": True, "runAsUser": 1000, "secretName": "mine"}},
    "host-path": {"model": {"name": "m", "path": "/models/m", "volume": {"hostPath": {"path": "/data/m"}}}},
    "sglang": {"engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5"}},
    "external-scaling-tolerations": {
        "decode": {
            "scaling": "external",
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
            ],
        },
        "prefill": {"scaling": "external"},
    },
    "planner-scaling": {
        "prefill": {"scaling": "planner"},
        "decode": {"scaling": "planner", "replicas": 3},
        "planner": {"decode": {"minReplicas": 2, "maxReplicas": 6}, "burstFactor": 2},
    },
    "network-policy": {
        "security": {
            "networkPolicy": {
                "enabled": True,
                "allowFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            }
        }
    },
    "no-pdb-no-router": {"remediation": {"podDisruptionBudget": False}, "router": {"replicas": 0}},
}


def spec_with(option: str):
    return parse_spec({**BASE, **OPTIONS[option]})


@pytest.mark.parametrize("k8s_version", SUPPORTED_K8S)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_children_with_each_option_validate(option: str, k8s_version: str) -> None:
    spec = spec_with(option)
    for child in M.build_children(spec, OWNER, operator_namespace="dsv4-system"):
        kubernetes_validate.validate(child, k8s_version, strict=True)


@pytest.mark.parametrize("k8s_version", SUPPORTED_K8S)
def test_secret_and_evidence_validate(k8s_version: str) -> None:
    kubernetes_validate.validate(
        M.auth_secret(spec_with("sglang"), OWNER, {k: "v" for k in M.AUTH_SECRET_KEYS}), k8s_version, strict=True
    )
    evidence = build_evidence_configmap(
        deployment="flash",
        namespace="serving",
        pod="flash-prefill-0",
        role="prefill",
        captured_at=1.0,
        verdict={"wedged": True},
        stacks="...",
        loads={"inflight": 1},
        metrics="m 1",
        logs=["a", "b"],
        spec_diff=["engine.image"],
        revision="abc",
        owner_references=[
            {"apiVersion": "serving.dsv4.dev/v1alpha1", "kind": "DSV4Deployment", "name": "flash", "uid": OWNER.uid}
        ],
    )
    kubernetes_validate.validate(evidence, k8s_version, strict=True)
