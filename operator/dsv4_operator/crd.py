"""The DSV4Deployment CustomResourceDefinition, generated from the pydantic models in `spec`.

`crds/dsv4deployment.yaml` is this module's output (`python -m dsv4_operator.crd --out ...`);
a test checks the file is current. Generating the CRD from the models keeps one source of truth
for field names, types, enums, minimums, required fields and defaults.

Also here: the two things the API server does with that schema that we need offline —
structural defaulting and validation (as plain JSON Schema for `jsonschema`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from pathlib import Path
from typing import Any

import yaml

from dsv4_operator import spec as S
from dsv4_operator.status_model import DSV4DeploymentStatus
from dsv4_operator.manifests import DNS1035_PATTERN, MAX_NAME_LENGTH

CRD_NAME = f"{S.PLURAL}.{S.GROUP}"

# Keys of a JSON Schema node that a structural OpenAPI v3 schema keeps as they are.
_KEPT = (
    "type",
    "description",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minItems",
    "maxItems",
    "maxProperties",
)

PRINTER_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Available")].status',
        "description": "Available condition: every role has a ready replica.",
    },
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.ready",
        "description": "Ready/desired prefill pods.",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decode.ready",
        "description": "Ready/desired decode pods.",
    },
    {
        "name": "Wedged",
        "type": "integer",
        "jsonPath": ".status.wedgedPods",
        "description": "Pods the watchdog holds wedged now.",
    },
    {
        "name": "Watched-By",
        "type": "string",
        "jsonPath": ".status.watchedBy",
        "description": "The operator serving this resource (its namespace); empty: no operator watches this namespace.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Router", "type": "string", "jsonPath": ".status.router.ready", "priority": 1},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind", "priority": 1},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
]


def _strip_nulls(value: Any) -> Any:
    """Drop None from defaults: a structural schema cannot default a field to null."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON Schema node -> one structural OpenAPI v3 node (refs inlined)."""
    siblings = {k: v for k, v in node.items() if k in ("description", "default") or k.startswith("x-kubernetes-")}
    if "$ref" in node:
        out = _structural(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        out.pop("description", None)  # the field's own description wins over the model's
        return _overlay(out, siblings)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        types = sorted(o.get("type", "") for o in options)
        if types == ["integer", "string"]:
            out = {"x-kubernetes-int-or-string": True}
            pattern = next((o["pattern"] for o in options if "pattern" in o), None)
            if pattern:  # applies to the string form only (e.g. a quantity)
                out["pattern"] = pattern
            return _overlay(out, siblings)
        if len(options) != 1:
            raise ValueError(f"cannot express {node} in a structural schema")
        return _overlay(_structural(options[0], defs), siblings)

    out: dict[str, Any] = {k: node[k] for k in _KEPT if k in node}
    if "const" in node:  # a one-value Literal; OpenAPI v3.0 has no const
        out["enum"] = [node["const"]]
    for k, v in node.items():
        if k.startswith("x-kubernetes-"):
            out[k] = v
    kind = node.get("type")
    if kind == "object":
        extra = node.get("additionalProperties")
        keys = dict(node.get("propertyNames") or {})
        if node.get("patternProperties"):  # pydantic's form of dict[<pattern key>, V]
            ((key_pattern, extra),) = node["patternProperties"].items()
            keys["pattern"] = key_pattern
        if "properties" in node:
            out["properties"] = {name: _structural(sub, defs) for name, sub in node["properties"].items()}
            if node.get("required"):
                out["required"] = list(node["required"])
            if extra is True:  # an open record (extra="allow"): keep what others add
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(extra, dict):
            out["additionalProperties"] = _structural(extra, defs)
            if "pattern" in keys:  # OpenAPI v3 cannot constrain map keys; CEL can
                rules = out.setdefault("x-kubernetes-validations", [])
                rules.append(
                    S.cel(
                        f"self.all(k, k.matches('{keys['pattern']}'))",
                        "every key must be a qualified name ([prefix/]name, name at most 63 characters)",
                    )
                )
                if "maxLength" in keys:
                    rules.append(
                        S.cel(
                            f"self.all(k, size(k) <= {keys['maxLength']})",
                            f"keys are at most {keys['maxLength']} characters",
                        )
                    )
        else:  # free-form (dict[str, Any]): e.g. a Kubernetes Affinity
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = _structural(node["items"], defs)
    if "default" in node and node["default"] is not None:
        out["default"] = _strip_nulls(node["default"])
    return out


def _overlay(out: dict[str, Any], siblings: dict[str, Any]) -> dict[str, Any]:
    for k, v in siblings.items():
        if k == "default":
            if v is not None:
                out["default"] = _strip_nulls(v)
        else:
            out[k] = v
    return out


def openapi_schema(model: type[S.BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def name_rules() -> list[dict[str, str]]:
    """The CR name names the children, so it has their limits (manifests.unbuildable_reasons);
    only the root of the schema may read metadata.name."""
    return [
        S.cel(
            f"self.metadata.name.matches('{DNS1035_PATTERN}')",
            "metadata.name must be a DNS-1035 label (lower case, starts with a letter): it names the Services",
        ),
        S.cel(
            f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
            f"metadata.name must be at most {MAX_NAME_LENGTH} characters: the StatefulSet pod labels carry it",
        ),
    ]


def cr_schema() -> dict[str, Any]:
    """The openAPIV3Schema of a whole DSV4Deployment object."""
    return {
        "type": "object",
        "description": "A prefill/decode-disaggregated deployment of a DeepSeek-style MoE model.",
        "required": ["spec"],
        "x-kubernetes-validations": name_rules(),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(S.DSV4DeploymentSpec),
            "status": openapi_schema(DSV4DeploymentStatus),
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "dsv4"}},
        "spec": {
            "group": S.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": S.KIND,
                "listKind": f"{S.KIND}List",
                "plural": S.PLURAL,
                "singular": S.SINGULAR,
                "shortNames": list(S.SHORT_NAMES),
            },
            "versions": [
                {
                    "name": S.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {"openAPIV3Schema": cr_schema()},
                }
            ],
        },
    }


HEADER = (
    "# Generated from operator/dsv4_operator/spec.py by `python -m dsv4_operator.crd --out "
    "crds/dsv4deployment.yaml`.\n# Do not edit by hand: change the pydantic models and regenerate.\n"
)


class _PlainDumper(yaml.SafeDumper):
    """No &anchors/*aliases: shared enum lists are written out where they are used."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd_yaml() -> str:
    return HEADER + yaml.dump(build_crd(), Dumper=_PlainDumper, sort_keys=False, width=100)


# ---- What the API server does with the schema, offline ---------------------------------------


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it: fill absent fields that have a default,
    recursing into objects that exist (after their own defaulting) and into list items."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        out = dict(obj)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(out[name], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for k in out:
                out[k] = apply_defaults(out[k], schema["additionalProperties"])
        return out
    if isinstance(obj, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in obj]
    return obj


def prune_unknown(obj: Any, schema: dict[str, Any], *, root: bool = True) -> Any:
    """Drop fields the schema does not know, as the API server prunes a structural schema
    (kept: metadata, x-kubernetes-preserve-unknown-fields subtrees, additionalProperties maps)."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for k, v in obj.items():
            if root and k in ("apiVersion", "kind", "metadata"):
                out[k] = v
            elif k in props:
                out[k] = prune_unknown(v, props[k], root=False)
            elif isinstance(extra, dict):
                out[k] = prune_unknown(v, extra, root=False)
            elif schema.get("x-kubernetes-preserve-unknown-fields"):
                out[k] = v
        return out
    if isinstance(obj, list) and "items" in schema:
        return [prune_unknown(item, schema["items"], root=False) for item in obj]
    return obj


def to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """A structural OpenAPI v3 node as plain JSON Schema (for the `jsonschema` package)."""
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "properties":
            out[k] = {name: to_jsonschema(sub) for name, sub in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = to_jsonschema(v)
        elif k == "x-kubernetes-int-or-string":
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        elif not k.startswith("x-kubernetes-"):
            out[k] = v
    return out


def crd_jsonschema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd if crd is not None else build_crd()
    return to_jsonschema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@functools.lru_cache(maxsize=None)
def _cel_program(rule: str) -> Any:
    import celpy  # offline tooling only (tests, the emulated API server): the operator never runs CEL

    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_violations(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The `x-kubernetes-validations` rules `obj` breaks, evaluated as the API server does after
    defaulting and pruning: each rule with `self` = the node that carries it, when that node is
    present. A rule that errors counts as broken (the API server refuses those too)."""
    import celpy

    out: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            ok = _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)})
        except Exception:  # noqa: BLE001  (celpy raises its evaluation errors)
            ok = False
        if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            out.append(f"{path or '<root>'}{rule.get('fieldPath', '')}: {rule.get('message') or rule['rule']}")
    if isinstance(obj, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in obj:
                out += cel_violations(obj[name], sub, f"{path}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                out += cel_violations(value, extra, f"{path}[{key}]")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_violations(item, schema["items"], f"{path}[{i}]")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the DSV4Deployment CRD (YAML).")
    parser.add_argument("--out", type=Path, help="File to write (default: stdout).")
    args = parser.parse_args(argv)
    text = render_crd_yaml()
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
