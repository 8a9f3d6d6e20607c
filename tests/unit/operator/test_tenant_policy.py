"""What a DSV4Deployment may ask for (issue 27, item 5): the cluster's allowlists, checked at
reconcile like any spec the operator cannot build, with one reason per thing refused."""

from __future__ import annotations

import json

import pytest

from dsv4_operator.handlers.apply import check_spec
from dsv4_operator.spec import parse_spec
from dsv4_operator.tenant_policy import POLICY_ENV, TenantPolicy, policy_violations

STRICT = TenantPolicy.from_mapping(
    {
        "imageRegistries": ["registry.corp/ml"],
        "allowHostPath": False,
        "tolerationKeys": ["nvidia.com/gpu"],
        "allowSecretEnv": False,
        "allowRoot": False,
    }
)


def spec_of(**overrides):
    raw = {
        "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "engine": {"image": "registry.corp/ml/dsv4:1"},
    }
    raw.update(overrides)
    return parse_spec(raw)


def test_a_plain_spec_passes_the_strict_policy_and_no_policy_restricts_nothing():
    assert policy_violations(spec_of(), STRICT) == []
    hostile = spec_of(
        engine={
            "image": "evil.io/x:1",
            "kind": "sglang",
            "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "other-team", "key": "token"}}}],
        },
        model={"name": "m", "path": "/m", "volume": {"hostPath": {"path": "/"}}},
        prefill={"tolerations": [{"operator": "Exists"}]},
    )
    assert policy_violations(hostile, TenantPolicy()) == []
    assert policy_violations(hostile, TenantPolicy.from_env({})) == []


def test_each_thing_refused_is_named():
    hostile = spec_of(
        engine={
            "image": "registry.corp/mlx/dsv4:1",
            "kind": "sglang",
            "env": [
                {"name": "T", "valueFrom": {"secretKeyRef": {"name": "other-team", "key": "token"}}},
                {"name": "P", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
        },
        router={"image": "registry.corp/ml@sha256:abc"},
        model={"name": "m", "path": "/m", "volume": {"hostPath": {"path": "/"}}},
        prefill={"tolerations": [{"operator": "Exists"}]},
        decode={
            "tolerations": [
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
                {"key": "nvidia.com/gpu", "operator": "Exists"},
            ]
        },
    )
    found = policy_violations(hostile, STRICT)
    assert found == [
        "spec.engine.image 'registry.corp/mlx/dsv4:1' is not from an allowed registry (registry.corp/ml)",
        "spec.model.volume.hostPath is not allowed on this cluster (use a PVC or an image volume)",
        "spec.prefill.tolerations: a toleration without a key tolerates every taint; not allowed",
        "spec.decode.tolerations: taint key 'node-role.kubernetes.io/control-plane' is not allowed (nvidia.com/gpu)",
        "spec.engine.env T: valueFrom.secretKeyRef is not allowed on this cluster",
        "engine.kind sglang runs as root unless spec.security.runAsUser is set; root is not allowed on this cluster",
    ]
    assert (
        policy_violations(
            spec_of(engine={"image": "registry.corp/ml/s:1", "kind": "sglang"}, security={"runAsUser": 1000}), STRICT
        )
        == []
    )


def test_the_operator_refuses_at_reconcile_with_the_reasons(monkeypatch):
    import dsv4_operator.handlers.apply as H

    monkeypatch.setattr(H, "TENANT_POLICY", STRICT)
    spec, why = check_spec(
        "flash",
        {
            "model": {"name": "m", "path": "/m", "volume": {"hostPath": {"path": "/"}}},
            "engine": {"image": "registry.corp/ml/dsv4:1"},
        },
    )
    assert spec is None and "hostPath is not allowed" in why


def test_the_policy_comes_from_the_environment_as_json():
    p = TenantPolicy.from_env({POLICY_ENV: json.dumps({"allowHostPath": False, "imageRegistries": []})})
    assert p.allow_host_path is False and p.image_registries == () and p.allow_root is True
    with pytest.raises(ValueError, match="not JSON"):
        TenantPolicy.from_env({POLICY_ENV: "{"})


def test_another_teams_secret_or_pvc_is_refused_by_name():
    """Issue 39 items 1 and 6: a CR names any Secret or PVC of the namespace unless the cluster
    lists those its tenants may name."""
    policy = TenantPolicy.from_mapping({"secretNames": ["a-auth"], "pvcNames": ["a-models"]})
    own = spec_of(
        model={"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "a-models"}}},
        security={"secretName": "a-auth"},
    )
    assert policy_violations(own, policy) == []
    assert policy_violations(spec_of(model={"name": "m", "path": "/m"}), policy) == []
    foreign = spec_of(
        model={"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "b-models"}}},
        security={"secretName": "b-auth"},
    )
    found = policy_violations(foreign, policy)
    assert len(found) == 2 and "'b-auth' is not allowed" in found[0] and "'b-models' is not allowed" in found[1]
    assert policy_violations(foreign, TenantPolicy()) == []
