"""The chart's ValidatingAdmissionPolicy (issue 27, item 5) says what the operator's reconcile-time
tenant policy says: its CEL, evaluated here with celpy, refuses exactly the specs
dsv4_operator.tenant_policy refuses, for the chart's default values and an image allowlist."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import celpy
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from chart_testutil import helm_template, by_kind, one  # noqa: E402

from dsv4_operator.spec import parse_spec  # noqa: E402
from dsv4_operator.tenant_policy import TenantPolicy, policy_violations  # noqa: E402

VALUES = {
    "tenantPolicy.imageRegistries": ["registry.corp/ml"],
    "tenantPolicy.secretNames": ["team-a-auth"],
    "tenantPolicy.pvcNames": ["c"],
}

SPECS = {
    "plain": {"engine": {"image": "registry.corp/ml/dsv4:1"}},
    "other-registry": {"engine": {"image": "registry.corp/mlx/dsv4:1"}},
    "router-digest": {
        "engine": {"image": "registry.corp/ml/dsv4:1"},
        "router": {"image": "registry.corp/ml@sha256:ab"},
    },
    "host-path": {
        "engine": {"image": "registry.corp/ml/dsv4:1"},
        "model": {"name": "m", "path": "/m", "volume": {"hostPath": {"path": "/"}}},
    },
    "keyless-toleration": {
        "engine": {"image": "registry.corp/ml/dsv4:1"},
        "prefill": {"tolerations": [{"operator": "Exists"}]},
    },
    "control-plane": {
        "engine": {"image": "registry.corp/ml/dsv4:1"},
        "decode": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
    },
    "secret-env": {
        "engine": {
            "image": "registry.corp/ml/dsv4:1",
            "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}}],
        }
    },
    "field-env": {
        "engine": {"image": "registry.corp/ml/dsv4:1"},
        "router": {"env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
    },
    "sglang-root": {"engine": {"image": "registry.corp/ml/sglang:1", "kind": "sglang"}},
    "own-secret": {"engine": {"image": "registry.corp/ml/dsv4:1"}, "security": {"secretName": "team-a-auth"}},
    "other-secret": {"engine": {"image": "registry.corp/ml/dsv4:1"}, "security": {"secretName": "team-b-auth"}},
    "other-pvc": {
        "engine": {"image": "registry.corp/ml/dsv4:1"},
        "model": {"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "team-b"}}},
    },
    "sglang-uid": {"engine": {"image": "registry.corp/ml/sglang:1", "kind": "sglang"}, "security": {"runAsUser": 1000}},
}


def _policy(values: dict) -> tuple[dict, dict]:
    docs = helm_template(values)
    vap = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    return vap, binding


def _admits(vap: dict, spec: dict[str, Any]) -> bool:
    env = celpy.Environment()
    obj = celpy.json_to_cel({"apiVersion": "serving.dsv4.dev/v1alpha1", "kind": "DSV4Deployment", "spec": spec})
    variables = {}
    for v in vap["spec"].get("variables") or []:
        variables[v["name"]] = env.program(env.compile(v["expression"])).evaluate(
            {"object": obj, "variables": celpy.json_to_cel({}) if not variables else celpy.celtypes.MapType(variables)}
        )
    for rule in vap["spec"]["validations"]:
        ok = env.program(env.compile(rule["expression"])).evaluate(
            {
                "object": obj,
                "variables": celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()}),
            }
        )
        if not bool(ok):
            return False
    return True


def _full(raw: dict) -> dict:
    raw = {"model": {"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "c"}}}, **raw}
    return parse_spec(raw).model_dump(by_alias=True, exclude_none=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_admission_and_reconcile_agree(name):
    vap, binding = _policy(VALUES)
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    policy = TenantPolicy.from_mapping(
        {
            "imageRegistries": ["registry.corp/ml"],
            "allowHostPath": False,
            "tolerationKeys": ["nvidia.com/gpu"],
            "allowSecretEnv": False,
            "allowRoot": False,
            "secretNames": ["team-a-auth"],
            "pvcNames": ["c"],
        }
    )
    spec = _full(SPECS[name])  # as the API server holds it: CRD defaults applied
    reconcile_ok = policy_violations(parse_spec(spec), policy) == []
    assert _admits(vap, spec) == reconcile_ok, (name, policy_violations(parse_spec(spec), policy))
    assert reconcile_ok == (name in ("plain", "router-digest", "field-env", "sglang-uid", "own-secret"))


def test_it_can_be_left_out():
    assert not by_kind(helm_template({"tenantPolicy.admissionPolicy": False}), "ValidatingAdmissionPolicy")
