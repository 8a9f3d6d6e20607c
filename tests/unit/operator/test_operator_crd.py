"""The CRD and the pydantic models agree: the checked-in CRD is what the models generate, and
the CRD's schema (via jsonschema, with the API server's defaulting) accepts, rejects and fills
in exactly what the models do."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from dsv4_operator import spec as S
from dsv4_operator import status_model as SM
from dsv4_operator.crd import (
    apply_defaults,
    build_crd,
    cel_violations,
    crd_jsonschema,
    prune_unknown,
    render_crd_yaml,
    to_jsonschema,
)

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "crds" / "dsv4deployment.yaml"
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))


@functools.lru_cache(maxsize=1)
def _load_checked_in() -> dict:
    return yaml.load(CRD_FILE.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def checked_in_crd() -> dict:
    return copy.deepcopy(_load_checked_in())


def schema_of(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def minimal() -> dict:
    return {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "metadata": {"name": "flash", "namespace": "ns"},
        "spec": {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "img:1"}},
    }


def with_spec(**changes: Any) -> dict:
    cr = minimal()
    for dotted, value in changes.items():
        node = cr["spec"]
        *path, last = dotted.split("__")
        for key in path:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return cr


_DELETE = object()

GOOD = {
    "minimal": minimal(),
    "sglang": with_spec(engine={"kind": "sglang", "image": "lmsysorg/sglang:latest"}),
    "scaled_to_zero": with_spec(prefill={"replicas": 0}, decode={"replicas": 0}, router={"replicas": 0}),
    "no_gpu_cpu_pool": with_spec(prefill={"gpusPerPod": 0, "nodeSelector": {}, "tolerations": []}),
    "quantities": with_spec(prefill={"resources": {"limits": {"memory": "512Gi", "cpu": 32}}}),
    "env_from_secret": with_spec(
        engine={
            "image": "i",
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        }
    ),
    "rollback_auto": with_spec(remediation={"rollback": "auto", "dryRun": True}),
    "threshold_edge": with_spec(remediation={"transferFailureRateThreshold": 1}),
    "image_volume": with_spec(model={"name": "m", "path": "/m/x", "volume": {"image": {"reference": "reg/m:1"}}}),
}

BAD = {
    "negative_replicas": with_spec(prefill={"replicas": -1}),
    "unknown_engine_kind": with_spec(engine={"kind": "vllm", "image": "i"}),
    "unknown_rollback": with_spec(remediation={"rollback": "maybe"}),
    "missing_image": with_spec(engine={"kind": "builtin"}),
    "missing_model": with_spec(model=_DELETE),
    "empty_model_name": with_spec(model={"name": "", "path": "/m"}),
    "relative_path": with_spec(model={"name": "m", "path": "models/m"}),
    "threshold_above_one": with_spec(remediation={"transferFailureRateThreshold": 1.5}),
    "gpus_as_words": with_spec(decode={"gpusPerPod": "four"}),
    "zero_scrape_interval": with_spec(remediation={"scrapeIntervalSeconds": 0}),
    "port_out_of_range": with_spec(router={"port": 70000}),
    "bad_backend": with_spec(transfer={"backend": "mooncake"}),
    "toleration_effect": with_spec(decode={"tolerations": [{"key": "k", "effect": "Sometimes"}]}),
    "env_without_name": with_spec(engine={"image": "i", "env": [{"value": "x"}]}),
    "negative_max_unavailable": with_spec(remediation={"maxUnavailable": {"prefill": -1}}),
}


def crd_accepts(cr: dict, crd: dict) -> bool:
    """What the API server admits: defaulted, pruned, then the schema and its CEL rules."""
    schema = schema_of(crd)
    obj = prune_unknown(apply_defaults(cr, schema), schema)
    if list(jsonschema.Draft202012Validator(to_jsonschema(schema)).iter_errors(obj)):
        return False
    return not cel_violations(obj, schema)


def pydantic_accepts(cr: dict) -> bool:
    try:
        S.parse_spec(cr.get("spec"))
    except ValidationError:
        return False
    return "spec" in cr


def test_checked_in_crd_is_what_the_models_generate() -> None:
    assert CRD_FILE.read_text() == render_crd_yaml(), (
        "crds/dsv4deployment.yaml is stale: run `python -m dsv4_operator.crd --out crds/dsv4deployment.yaml`"
    )


def test_crd_names_scope_subresources_and_printer_columns() -> None:
    crd = checked_in_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "dsv4deployments.serving.dsv4.dev"
    assert spec["group"] == "serving.dsv4.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "DSV4Deployment",
        "listKind": "DSV4DeploymentList",
        "plural": "dsv4deployments",
        "singular": "dsv4deployment",
        "shortNames": ["dsv4d"],
    }
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    default_columns = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert default_columns == ["READY", "PREFILL", "DECODE", "WEDGED", "WATCHED-BY", "AGE"]
    by_name = {c["name"].upper(): c for c in version["additionalPrinterColumns"]}
    assert by_name["READY"]["jsonPath"] == '.status.conditions[?(@.type=="Available")].status'
    assert by_name["AGE"]["type"] == "date"


def _walk(node: dict, path: str = "") -> list[tuple[str, dict]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    """What the API server demands of a v1 CRD schema: every node typed (or int-or-string or
    free-form), no refs / anyOf-with-types / titles, defaults only where a type exists."""
    for path, node in _walk(schema_of(checked_in_crd())):
        assert not {"$ref", "$defs", "title", "anyOf", "oneOf", "allOf"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("type") == "object" and path not in ("", ".metadata"):
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path
        if "default" in node:
            assert None not in (node["default"] if isinstance(node["default"], list) else [node["default"]]), path


def test_spec_requires_model_and_engine_and_the_issue_fields_exist() -> None:
    spec = schema_of(checked_in_crd())["properties"]["spec"]
    assert spec["required"] == ["model", "engine"]
    props = spec["properties"]
    assert set(props) == {
        "model",
        "engine",
        "prefill",
        "decode",
        "router",
        "transfer",
        "remediation",
        "rollout",
        "security",
        "planner",
    }
    assert props["engine"]["properties"]["kind"]["enum"] == ["builtin", "sglang"]
    # scaling: planner (issue 48), beside operator and external; the router has no planner.
    assert props["prefill"]["properties"]["scaling"]["enum"] == ["operator", "external", "planner"]
    assert props["router"]["properties"]["scaling"]["enum"] == ["operator", "external"]
    assert "default" not in props["planner"]  # absent stays absent: older objects keep their revision
    assert set(props["planner"]["properties"]) == {
        "intervalSeconds",
        "ttftTargetSeconds",
        "itlTargetSeconds",
        "prefill",
        "decode",
        "targetUtilization",
        "hysteresis",
        "scaleDownCooldownSeconds",
        "startupSeconds",
        "drainTimeoutSeconds",
        "burstFactor",
        "dryRun",
    }
    role = props["prefill"]["properties"]
    assert {"replicas", "gpusPerPod", "resources", "nodeSelector", "tolerations", "affinity", "env", "args"} <= set(
        role
    )
    assert role["replicas"]["minimum"] == 0
    assert set(props["transfer"]["properties"]) >= {
        "backend",
        "ucxNetDevices",
        "bootstrapTimeoutSeconds",
        "transferTimeoutSeconds",
    }
    rem = props["remediation"]["properties"]
    assert set(rem) == {
        "enabled",
        "dryRun",
        "scrapeIntervalSeconds",
        "detectionWindowSeconds",
        "transferFailureRateThreshold",
        "maxUnavailable",
        "cooldownSeconds",
        "captureEvidence",
        "rollback",
        "podDisruptionBudget",
    }
    assert rem["rollback"]["enum"] == ["off", "suggest", "auto"] and rem["rollback"]["default"] == "suggest"
    status = schema_of(checked_in_crd())["properties"]["status"]["properties"]
    assert {
        "observedGeneration",
        "conditions",
        "prefill",
        "decode",
        "lastRemediation",
        "remediationsTotal",
        "stableRevision",
        "wedgedPods",
    } <= set(status)
    assert status["conditions"]["items"]["properties"]["type"]["enum"] == list(SM.CONDITION_TYPES)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_resources_pass_both(name: str) -> None:
    crd = checked_in_crd()
    assert crd_accepts(GOOD[name], crd)
    assert pydantic_accepts(GOOD[name])


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_resources_fail_both(name: str) -> None:
    crd = checked_in_crd()
    assert not crd_accepts(BAD[name], crd)
    assert not pydantic_accepts(BAD[name])


def test_missing_spec_is_rejected() -> None:
    cr = minimal()
    del cr["spec"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cr, crd_jsonschema(checked_in_crd()))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    cr = yaml.safe_load(path.read_text())
    assert crd_accepts(cr, checked_in_crd())
    S.parse_spec(cr["spec"])


@pytest.mark.parametrize("name", sorted(GOOD))
def test_api_server_defaulting_equals_pydantic_defaults(name: str) -> None:
    """The spec the operator sees after the API server applied the CRD's defaults is the spec
    pydantic builds from what the user wrote: no default lives in only one place."""
    schema = schema_of(checked_in_crd())
    defaulted = apply_defaults(copy.deepcopy(GOOD[name]), schema)["spec"]
    assert defaulted == S.dump(S.parse_spec(GOOD[name]["spec"]))
    # ... and parsing the defaulted spec changes nothing either.
    assert S.dump(S.parse_spec(defaulted)) == defaulted


def test_explicit_empty_overrides_survive_defaulting() -> None:
    cr = with_spec(prefill={"nodeSelector": {}, "tolerations": []})
    spec = apply_defaults(cr, schema_of(checked_in_crd()))["spec"]
    assert spec["prefill"]["nodeSelector"] == {} and spec["prefill"]["tolerations"] == []
    assert spec["decode"]["nodeSelector"] == S.DEFAULT_NODE_SELECTOR
    parsed = S.parse_spec(cr["spec"])
    assert parsed.prefill.node_selector == {} and parsed.decode.node_selector == S.DEFAULT_NODE_SELECTOR


def test_unknown_fields_are_pruned_and_ignored() -> None:
    cr = with_spec(prefill={"replicas": 2, "typoReplica": 3}, surprise={"x": 1})
    schema = schema_of(checked_in_crd())
    pruned = prune_unknown(apply_defaults(cr, schema), schema)
    assert "surprise" not in pruned["spec"] and "typoReplica" not in pruned["spec"]["prefill"]
    assert S.dump(S.parse_spec(cr["spec"])) == pruned["spec"]


def test_models_and_crd_have_the_same_fields_everywhere() -> None:
    """Walk the models and the checked-in schema together: same property names, same required."""
    crd_spec = schema_of(checked_in_crd())["properties"]

    def check(model: type, node: dict, where: str) -> None:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        assert set(fields) == set(node.get("properties", {})), where
        required = sorted(a for a, f in fields.items() if f.is_required())
        assert sorted(node.get("required", [])) == required, where
        for alias, f in fields.items():
            sub = node["properties"][alias]
            ann = f.annotation
            args = getattr(ann, "__args__", ())
            nested = [a for a in (ann, *args) if isinstance(a, type) and issubclass(a, S.BaseModel)]
            if nested:
                target = sub["items"] if sub.get("type") == "array" else sub
                check(nested[0], target, f"{where}.{alias}")

    check(S.DSV4DeploymentSpec, crd_spec["spec"], "spec")
    check(SM.DSV4DeploymentStatus, crd_spec["status"], "status")


def test_spec_revision_is_stable_and_sensitive() -> None:
    a = S.parse_spec(minimal()["spec"])
    b = S.parse_spec(apply_defaults(minimal(), schema_of(build_crd()))["spec"])
    assert S.spec_revision(a) == S.spec_revision(b)
    c = S.parse_spec(with_spec(prefill={"replicas": 2})["spec"])
    assert S.spec_revision(c) != S.spec_revision(a)
