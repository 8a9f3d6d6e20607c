"""The CRD's CEL rules (`x-kubernetes-validations`), evaluated offline with cel-python against
the checked-in CRD: every rule the operator enforces at reconcile time that CEL can express is
also refused at admission, and nothing the operator accepts is refused.

The verdicts compared: the API server's (schema + CEL after defaulting and pruning, as
`crd_accepts` computes it) and the operator's (`handlers.check_spec`: pydantic plus
`manifests.unbuildable_reasons`, which also covers the CR name)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dsv4_operator.crd import apply_defaults, build_crd, cel_violations, prune_unknown
from dsv4_operator.handlers.apply import check_spec
from dsv4_operator.manifests import MAX_NAME_LENGTH

from test_operator_crd import GOOD, checked_in_crd, minimal, schema_of, with_spec


def named(name: str, cr: dict | None = None) -> dict:
    cr = copy.deepcopy(cr or minimal())
    cr["metadata"]["name"] = name
    return cr


def tol(**fields: Any) -> dict:
    return with_spec(decode={"tolerations": [fields]})


# The bad specs from the review, and the other field syntax nobody refused before the StatefulSet
# apply: each -> the fragment of the message the API server answers with.
REFUSED: dict[str, tuple[dict, str]] = {
    "name_too_long": (named("a" * (MAX_NAME_LENGTH + 1)), "at most 44"),
    "name_not_dns1035": (named("9lives"), "DNS-1035"),
    "name_upper_case": (named("Flash"), "DNS-1035"),
    "two_volume_sources": (
        with_spec(
            model={
                "name": "m",
                "path": "/m",
                "volume": {"persistentVolumeClaim": {"claimName": "c"}, "hostPath": {"path": "/h"}},
            }
        ),
        "exactly one",
    ),
    "no_volume_source": (with_spec(model={"name": "m", "path": "/m", "volume": {}}), "exactly one"),
    "engine_port_is_bootstrap_port": (with_spec(engine={"image": "i", "port": 8998}), "bootstrapPort"),
    "bootstrap_port_is_engine_port": (with_spec(transfer={"bootstrapPort": 8100}), "bootstrapPort"),
    "group_leader_port_is_engine_port": (
        with_spec(engine={"image": "i", "port": 29500}, decode={"nodesPerReplica": 2}),
        "29500",
    ),
    "sglang_router_on_metrics_port": (
        with_spec(engine={"kind": "sglang", "image": "i"}, router={"port": 29000}),
        "29000",
    ),
    "env_value_and_value_from": (
        with_spec(
            engine={
                "image": "i",
                "env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            }
        ),
        "not both",
    ),
    "env_name_with_space": (with_spec(decode={"env": [{"name": "MY VAR", "value": "1"}]}), "pattern"),
    "env_name_with_equals": (with_spec(router={"env": [{"name": "A=B", "value": "1"}]}), "pattern"),
    "quantity_words": (with_spec(prefill={"resources": {"limits": {"memory": "lots"}}}), "pattern"),
    "quantity_bad_suffix": (with_spec(router={"resources": {"requests": {"cpu": "2 cores"}}}), "pattern"),
    "shm_size_not_quantity": (with_spec(prefill={"shmSize": "32 GB"}), "pattern"),
    "resource_key_bad": (with_spec(decode={"resources": {"limits": {"nvidia.com/gpu!": 1}}}), "qualified name"),
    "node_selector_key_bad": (with_spec(prefill={"nodeSelector": {"gpu family": "x"}}), "qualified name"),
    "node_selector_key_long_name": (with_spec(prefill={"nodeSelector": {"a" * 64: "x"}}), "qualified name"),
    "node_selector_key_too_long": (with_spec(prefill={"nodeSelector": {"a" * 320 + "/x": "x"}}), "at most 317"),
    "node_selector_value_bad": (with_spec(decode={"nodeSelector": {"gpu": "black well"}}), "pattern"),
    "node_selector_value_too_long": (with_spec(decode={"nodeSelector": {"gpu": "b" * 64}}), "long"),
    "toleration_exists_with_value": (tol(key="k", operator="Exists", value="v"), "Exists"),
    "toleration_no_key_equal": (tol(operator="Equal", value="v"), "without a key"),
    "toleration_key_bad": (tol(key="bad key", operator="Exists"), "pattern"),
    "toleration_seconds_no_schedule": (
        tol(key="k", operator="Exists", effect="NoSchedule", tolerationSeconds=30),
        "NoExecute",
    ),
    "toleration_seconds_no_effect": (tol(key="k", operator="Exists", tolerationSeconds=30), "NoExecute"),
    "canary_traffic_percent": (with_spec(rollout={"canary": {"trafficPercent": 51}}), "50"),
    "planner_min_above_max": (
        with_spec(decode={"scaling": "planner"}, planner={"decode": {"minReplicas": 5, "maxReplicas": 2}}),
        "minReplicas must not exceed maxReplicas",
    ),
    "planner_default_max_below_min": (with_spec(planner={"prefill": {"minReplicas": 9}}), "minReplicas"),
    "planner_scaling_unknown": (with_spec(prefill={"scaling": "hpa"}), "planner"),
    "planner_utilization_zero": (with_spec(planner={"targetUtilization": 0}), "minimum"),
    "dp_attention_one_gpu": (with_spec(decode={"dpAttention": True, "gpusPerPod": 1}), "dpAttention needs 2 GPUs"),
    "dp_attention_no_gpu": (with_spec(prefill={"dpAttention": True, "gpusPerPod": 0}), "dpAttention needs 2 GPUs"),
    "redundant_experts_past_the_gpus": (with_spec(decode={"redundantExperts": 5}), "at most one per GPU"),
    "redundant_experts_past_a_group": (
        with_spec(prefill={"redundantExperts": 3, "gpusPerPod": 1, "nodesPerReplica": 2}),
        "at most one per GPU",
    ),
    "sglang_redundant_experts": (
        with_spec(engine={"kind": "sglang", "image": "i"}, decode={"redundantExperts": 1}),
        "builtin's flag",
    ),
}

ACCEPTED: dict[str, dict] = {
    **GOOD,
    "longest_name": named("a" * MAX_NAME_LENGTH),
    "pvc_only": with_spec(model={"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "c"}}}),
    "sglang_router_elsewhere": with_spec(engine={"kind": "sglang", "image": "i"}, router={"port": 8000}),
    "builtin_router_on_29000": with_spec(router={"port": 29000}),
    "quantity_forms": with_spec(
        prefill={"resources": {"limits": {"cpu": "500m", "memory": "1.5Gi", "x.io/y": "1e3", "ephemeral-storage": 10}}}
    ),
    "env_names": with_spec(engine={"image": "i", "env": [{"name": "_A.b-1", "value": ""}]}),
    "toleration_match_all": tol(operator="Exists"),
    "toleration_seconds_no_execute": tol(key="k", operator="Exists", effect="NoExecute", tolerationSeconds=30),
    "selector_prefixed": with_spec(
        decode={"nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge", "empty": ""}}
    ),
    "dp_attention_and_eplb": with_spec(decode={"dpAttention": True, "redundantExperts": 4}),
    "dp_attention_off_on_one_gpu": with_spec(prefill={"dpAttention": False, "gpusPerPod": 1}),
    "dp_attention_over_a_group_of_one_gpu_pods": with_spec(
        prefill={"dpAttention": True, "gpusPerPod": 1, "nodesPerReplica": 2, "redundantExperts": 2}
    ),
    "sglang_dp_attention": with_spec(engine={"kind": "sglang", "image": "i"}, decode={"dpAttention": True}),
    "planner_defaults": with_spec(prefill={"scaling": "planner"}, decode={"scaling": "planner"}),
    "planner_settings": with_spec(
        decode={"scaling": "planner", "replicas": 2},
        planner={
            "ttftTargetSeconds": 1.5,
            "itlTargetSeconds": 0.04,
            "decode": {"minReplicas": 2, "maxReplicas": 2},
            "burstFactor": 3,
        },
    ),
}


def admission_errors(cr: dict) -> list[str]:
    """The API server's answer, as messages (schema errors first, then the CEL rules)."""
    import jsonschema

    from dsv4_operator.crd import to_jsonschema

    schema = schema_of(checked_in_crd())
    obj = prune_unknown(apply_defaults(cr, schema), schema)
    errors = [e.message for e in jsonschema.Draft202012Validator(to_jsonschema(schema)).iter_errors(obj)]
    return errors + cel_violations(obj, schema)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_admission_refuses_what_the_operator_refuses(case: str) -> None:
    cr, fragment = REFUSED[case]
    errors = admission_errors(cr)
    assert errors and any(
        fragment in e or (fragment == "pattern" and "does not match" in e) or (fragment == "long" and "too long" in e)
        for e in errors
    ), errors
    parsed, problem = check_spec(cr["metadata"]["name"], cr["spec"])
    assert parsed is None and problem, f"the operator would act on {case}"


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_admission_accepts_what_the_operator_accepts(case: str) -> None:
    cr = ACCEPTED[case]
    assert admission_errors(cr) == []
    parsed, problem = check_spec(cr["metadata"]["name"], cr["spec"])
    assert parsed is not None, problem


def test_every_rule_compiles_names_a_message_and_can_fail() -> None:
    """A rule with a typo would be refused by the API server when the CRD is installed; a rule
    that holds for everything would refuse nothing. Walk every rule of the CRD."""
    import celpy

    rules: list[dict] = []

    def walk(node: dict) -> None:
        rules.extend(node.get("x-kubernetes-validations") or [])
        for sub in (node.get("properties") or {}).values():
            walk(sub)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])

    walk(schema_of(checked_in_crd()))
    assert len(rules) >= 10
    env = celpy.Environment()
    for rule in rules:
        env.compile(rule["rule"])
        assert rule.get("message"), rule
    broken = {
        v.split(": ", 1)[1]
        for cr, _ in REFUSED.values()
        for v in cel_violations(
            prune_unknown(apply_defaults(cr, schema_of(build_crd())), schema_of(build_crd())), schema_of(build_crd())
        )
    }
    assert {r["message"] for r in rules} <= broken, "a CEL rule no REFUSED case breaks"


def test_a_rule_that_errors_refuses() -> None:
    """CEL errors (a missing field) refuse, as the API server does, rather than pass."""
    schema = {"type": "object", "x-kubernetes-validations": [{"rule": "self.a.b == 1", "message": "m"}]}
    assert cel_violations({}, schema) == ["<root>: m"]
    assert cel_violations({"a": {"b": 1}}, schema) == []
