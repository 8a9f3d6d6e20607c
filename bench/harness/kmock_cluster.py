"""A Kubernetes API server for integration tests: kmock 0.8's KubernetesEmulator, real HTTP on
127.0.0.1, with the gaps that matter to an operator filled in.

What this adds to kmock (each is what a real API server does):
- metadata: uid, creationTimestamp, a cluster-wide resourceVersion bumped on every write (and
  not on a no-op write), generation (1 on create, +1 when anything but metadata/status changes),
  generateName, namespace from the URL;
- create answers 201; duplicate create 409; unknown object 404;
- PATCH by content type: JSON merge patch (null deletes), JSON patch (a failed `test` -> 422),
  strategic merge patch (approximated by merge patch: lists are replaced, not merged by key),
  server-side apply (creates the object if absent; prunes the fields the same field manager
  applied before and no longer applies, unless another manager owns them too; list-maps --
  containers, env, volumes, imagePullSecrets by name, volumeMounts by mountPath, ports by
  port/containerPort and protocol, ownerReferences by uid -- merge entry by entry, so an entry
  another manager added stays; other lists are atomic).
  Field ownership per leaf path: an apply owns what it applies (alone, when forcing a different
  value; without force, a different value for a field another manager owns is a 409 conflict), any other write (PATCH, PUT, /scale) owns alone what it changed, named by its
  fieldManager parameter;
- the scale subresource of StatefulSets and Deployments (PATCH/PUT spec.replicas), as an HPA
  or `kubectl scale` uses it; A resourceVersion in the body is a
  precondition (409 on mismatch). PUT replaces, with the same precondition;
- Secrets: stringData is merged into data (base64) and never stored;
- quantities of built-in kinds (container resources, emptyDir sizeLimit) are stored and served in
  canonical form (`4` -> "4", `1000m` -> "1", `1024Mi` -> "1Gi"); a malformed one is a 422;
- the status subresource: writes to /status change only status, other writes never do;
- deletion: finalizers hold an object with a deletionTimestamp; removing the last one deletes it;
  the garbage collector deletes dependents whose ownerReferences all point to owners that do not
  exist (background cascade on the owner's deletion, and for dependents written after it), as
  kube-controller-manager does;
- list and watch honour labelSelector and fieldSelector (metadata.name / metadata.namespace, and
  an Event's involvedObject.*, reason, type, source; any other field is a 400); a watch from a
  resourceVersion replays the events after it from a history (deletions included), or is one
  ERROR event 410 Gone when they are older than the history (`compact`, `watch_history`); with
  allowWatchBookmarks, BOOKMARK events every `bookmark_interval` s of quiet; an object whose labels
  stop (start) matching a watch's selector is sent as DELETED (ADDED); timeoutSeconds ends a
  watch; `sever_watches` ends every open watch and `watches_down` keeps them down while a test
  writes (then compacts); `watch_events` counts what each client was streamed;
- Pod Security admission: a pod created in a namespace labelled
  `pod-security.kubernetes.io/enforce: baseline|restricted` that breaks the level is a 403
  (bench/harness/pod_security.py; `put_namespace` makes or relabels a Namespace);
- two controllers of kube-controller-manager: the StatefulSet controller, where admission would
  refuse the pods of a new or changed template, makes none and posts a Warning Event
  FailedCreate with the admission's message (it makes no pods otherwise either: tests stand in);
  the disruption controller writes PodDisruptionBudget status (observedGeneration, healthy pods)
  through the status subresource when a budget or a pod changes;
- discovery: the bundled builtin resources, `groupVersion: v1` for the core group, and CRDs
  (registered with `register_crd` or by creating a CustomResourceDefinition), whose schema
  defaults, prunes and validates custom objects (422 Invalid) unless registered without it,
  including the schema's CEL rules (`x-kubernetes-validations`, evaluated with cel-python);
- every API call is recorded as (verb, group, resource[/subresource]) for RBAC checks.
- validation of what a merge by key can break (validate_builtin: duplicate Service port names or
  port/protocol pairs, duplicate container or volume names, no Service port, no container;
  tolerationSeconds without NoExecute);
- OwnerReferencesPermissionEnforcement, when a test turns it on with the caller's RBAC grants
  (enforce_owner_references): blockOwnerDeletion needs `update` on the owner's finalizers;
- metadata.managedFields of built-in kinds (manager, operation, time, subresource, FieldsV1);
- feature gates (`feature_gates`, ImageVolume off by default as through 1.33: image volumes and
  their mounts are dropped from pod specs silently) and dryRun=All (answered, never stored);
Still missing: other controllers (a StatefulSet makes no pods: tests stand in for them),
admission beyond CRD schemas and the checks above, RBAC enforcement of every call (test_rbac
compares the recorded calls with the chart instead), initial-events streaming (sendInitialEvents).

Use: `from bench.harness.kmock_cluster import *` in a conftest.py next to the tests (see
tests/integration/operator/conftest.py) for the `kube_cluster`, `kube_client`, `kubeconfig`
and `api_calls` fixtures.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import random
import re
import string
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import jsonschema
import kmock
import pytest
import pytest_asyncio
import yaml
from kmock._internal import dsl, rendering  # the request type kmock hands to handlers

from bench.harness import pod_security

from dsv4_operator.crd import apply_defaults, cel_violations, prune_unknown, to_jsonschema

TEST_AGENT = "dsv4-tests"
CRD_RESOURCE = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
EVENTS = kmock.resource("", "v1", "events")
PODS = kmock.resource("", "v1", "pods")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
MUTATING_METHODS = ("POST", "PUT", "PATCH", "DELETE")


# ---- kmock's reaction lookup in constant time --------------------------------------------------
# kmock picks the reaction for a request with `request in reaction._source`, and a view answers
# that by iterating every request the server has ever served through its filters: each request
# cost O(requests so far), and a run of 10 DSV4Deployments spent 140 of its 160 s there (a GET of
# one object took 0.4 s after ~2,500 requests; 50 deployments never finished reconciling). For the
# views the emulator's own fallbacks are built from (filters and priorities over the server) the
# answer is the filter's criteria on this one request plus "the server saw it": the same answer,
# without the scan. Any other view (slices, groups, exclusions a test builds) keeps kmock's way.

_kmock_contains = dsl.View.__contains__


def _contains_request(view: Any, request: rendering.Request) -> Optional[bool]:
    """The membership of `request` in `view`, or None where only kmock's full scan can tell."""
    while True:
        if type(view) is dsl.Filter:  # exactly Filter.__iter__: the source's requests that pass the criteria
            if not view.criteria(request):
                return False
            view = view._source
        elif type(view) is dsl.Priority:  # a hint that passes its source through
            view = view._source
        elif isinstance(view, dsl.Root) and type(view).__iter__ is dsl.Root.__iter__:
            seen = view._requests
            index = getattr(request, "id", None)
            if isinstance(index, int) and 0 <= index < len(seen) and seen[index] is request:
                return True
            return any(r is request for r in seen)
        else:
            return None


def _view_contains(self: Any, item: Any) -> bool:
    if isinstance(item, rendering.Request):
        found = _contains_request(self, item)
        if found is not None:
            return found
    return _kmock_contains(self, item)


dsl.View.__contains__ = _view_contains


# ---- Label and field selectors ------------------------------------------------------------------

_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9./_-]+)\s*"
    r"(?:(?P<op>==|!=|=|\s+in\s+|\s+notin\s+)\s*(?P<val>\([^)]*\)|[A-Za-z0-9._-]*))?\s*$"
)


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b=c` -> two terms."""
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        terms.append(cur)
    return terms


def _scaled(value: Any, total: int, up: bool) -> int:
    """An int-or-percent (`2`, "50%") of `total`, rounded up (as PDBs count)."""
    if isinstance(value, str) and value.endswith("%"):
        import math

        share = int(value[:-1]) * total / 100
        return math.ceil(share) if up else math.floor(share)
    return int(value)


def label_selector_matches(selector: Optional[str], labels: Mapping[str, str]) -> bool:
    """Kubernetes label selector semantics: =, ==, !=, in, notin, exists, !exists."""
    for term in _split_selector(selector or ""):
        m = _SELECTOR_TERM.match(term)
        if not m:
            raise ValueError(f"bad label selector term: {term!r}")
        key, op, val = m["key"], (m["op"] or "").strip(), m["val"]
        if m["neg"]:
            ok = key not in labels
        elif not op:
            ok = key in labels
        elif op in ("=", "=="):
            ok = labels.get(key) == val
        elif op == "!=":
            ok = labels.get(key) != val
        else:
            values = {v.strip() for v in val.strip("()").split(",") if v.strip()}
            ok = (labels.get(key) in values) if op == "in" else (labels.get(key) not in values)
        if not ok:
            return False
    return True


# Field selectors a real API server serves beyond metadata.name/namespace, per kind (an Event's
# involved object, reason and type are what controllers' failures are found by).
EVENT_FIELDS = frozenset(
    {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)


def _field_value(obj: Mapping[str, Any], key: str) -> Any:
    if key == "source":
        return (obj.get("source") or {}).get("component")
    node: Any = obj
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return "" if node is None else str(node)


def field_selector_matches(selector: Optional[str], obj: Mapping[str, Any], kind: Optional[str] = None) -> bool:
    """metadata.name and metadata.namespace for every kind, and an Event's EVENT_FIELDS; any other
    field is a 400 on a real API server (ValueError here). `kind`: the resource's (a body written
    without one still is what its URL says)."""
    kind = kind or obj.get("kind")
    for term in _split_selector(selector or ""):
        neg = "!=" in term
        key, _, val = term.replace("!=", "=").replace("==", "=").partition("=")
        key = key.strip()
        if key not in ("metadata.name", "metadata.namespace") and not (kind == "Event" and key in EVENT_FIELDS):
            raise ValueError(f"field label not supported: {key}")
        if (_field_value(obj, key) == val.strip()) == neg:
            return False
    return True


# ---- Patch semantics ---------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# Server-side apply merges these lists by key (`x-kubernetes-list-type: map` in the built-in
# schemas): an entry is owned, kept and removed on its own, fields inside it too. Every other
# list is atomic (tolerations, rules, args, ...).
LIST_MAP_FIELDS = frozenset(
    {
        "containers",
        "initContainers",
        "ephemeralContainers",
        "env",
        "volumes",
        "volumeMounts",
        "ports",
        "imagePullSecrets",
        "ownerReferences",
    }
)


def _entry_key(field: Any, item: Any) -> Optional[str]:
    """The key of a list-map entry as managedFields spells it (`k:{"name":"x"}`), or None."""
    if not isinstance(item, dict):
        return None
    if field == "volumeMounts":
        keys = {"mountPath": item.get("mountPath")}
    elif field == "ports":
        port = "containerPort" if "containerPort" in item else "port"
        keys = {port: item.get(port), "protocol": item.get("protocol", "TCP")}
    elif field == "ownerReferences":
        keys = {"uid": item.get("uid")}
    else:
        keys = {"name": item.get("name")}
    if any(v is None for v in keys.values()):
        return None
    return "k:" + json.dumps(keys, sort_keys=True, separators=(",", ":"))


def _as_map(field: Any, value: Any) -> Optional[dict]:
    """A list-map as {key: entry} (insertion order kept), or None: not a list-map field, empty, or
    an entry without its key (then the list is handled whole)."""
    if field not in LIST_MAP_FIELDS or not isinstance(value, list) or not value:
        return None
    out: dict = {}
    for item in value:
        k = _entry_key(field, item)
        if k is None or k in out:
            return None
        out[k] = item
    return out


def _leaf_paths(obj: Any, prefix: tuple = ()) -> set[tuple]:
    """Paths of the fields a config sets, as for SSA: list-map entries by key
    (`(..., "ports", 'k:{"port":80,"protocol":"TCP"}', "name")`), other lists atomic (one leaf)."""
    if isinstance(obj, dict) and obj:
        paths: set[tuple] = set()
        for key, value in obj.items():
            entries = _as_map(key, value)
            if entries is None:
                paths |= _leaf_paths(value, prefix + (key,))
            else:
                for k, entry in entries.items():
                    paths |= _leaf_paths(entry, prefix + (key, k))
        return paths
    return {prefix}


def _step(obj: Any, field: Any, key: Any) -> Any:
    """One step down a path: a dict's key, or a list-map's entry by its `k:` key."""
    if isinstance(obj, dict):
        return obj.get(key, _MISSING)
    if isinstance(obj, list) and isinstance(key, str) and key.startswith("k:"):
        for item in obj:
            if _entry_key(field, item) == key:
                return item
    return _MISSING


def _is_key_field(path: tuple) -> bool:
    """The leaf is one of the key fields of a list-map entry (`(..., 'k:{"port":80,...}', "port")`)."""
    if len(path) < 2 or not isinstance(path[-2], str) or not path[-2].startswith("k:"):
        return False
    return path[-1] in json.loads(path[-2][2:])


def _drop_path(obj: Any, path: tuple) -> None:
    """Remove one leaf; a list-map entry left with no field is removed from its list."""
    chain = []  # (container, node): node as found inside container
    field = None
    for key in path[:-1]:
        nxt = _step(obj, field, key)
        if nxt is _MISSING:
            return
        chain.append((obj, nxt))
        obj, field = nxt, key
    last = path[-1]
    if _is_key_field(path) and chain and isinstance(chain[-1][0], list):
        # An entry cannot lose its key: it goes whole (its other fields were dropped first).
        container, entry = chain[-1]
        container[:] = [item for item in container if item is not entry]
        return
    if isinstance(obj, dict):
        obj.pop(last, None)
    elif isinstance(obj, list):
        obj[:] = [item for item in obj if _entry_key(field, item) != last]
    for container, node in reversed(chain):  # prune list-map entries emptied by the drop
        if isinstance(container, list) and node == {}:
            container[:] = [item for item in container if item is not node]
        else:
            break


def apply_merge(target: Any, patch: Any, field: Any = None) -> Any:
    """Merge an applied configuration into an object: dicts by key, list-maps entry by entry
    (a live entry the configuration does not name stays), other lists replaced."""
    if isinstance(patch, dict):
        out = dict(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = apply_merge(out.get(key), value, key)
        return out
    wanted = _as_map(field, patch)
    if wanted is not None and (not target or _as_map(field, target) is not None):
        out_list = [copy.deepcopy(item) for item in (target or [])]
        index = {_entry_key(field, item): i for i, item in enumerate(out_list)}
        for k, entry in wanted.items():
            if k in index:
                out_list[index[k]] = apply_merge(out_list[index[k]], entry)
            else:
                out_list.append(copy.deepcopy(entry))
        return out_list
    return copy.deepcopy(patch)


def server_side_apply(
    live: Optional[dict], applied: dict, previously_applied: Optional[dict], kept: Iterable[tuple] = ()
) -> dict:
    """Server-side apply for one field manager: the fields (and list-map entries) it applied
    before but no longer applies are removed unless another manager owns them too (`kept`),
    then the new configuration is merged in (apply_merge)."""
    out = copy.deepcopy(live) if live else {}
    kept = set(kept)
    if previously_applied:
        gone = _leaf_paths(previously_applied) - _leaf_paths(applied) - kept
        for path in sorted(gone, key=lambda p: (_is_key_field(p), len(p))):  # key fields last
            if path and path[0] not in ("apiVersion", "kind"):
                _drop_path(out, path)
    return apply_merge(out, applied)


_MISSING = object()


def _value_at(obj: Any, path: tuple) -> Any:
    field = None
    for key in path:
        obj = _step(obj, field, key)
        if obj is _MISSING:
            return _MISSING
        field = key
    return obj


def _owned_paths(obj: Mapping[str, Any]) -> set[tuple]:
    """Leaf paths a writer can own: not status, not the server's metadata."""
    server = {"uid", "resourceVersion", "generation", "creationTimestamp", "managedFields", "deletionTimestamp"}
    return {
        p
        for p in _leaf_paths(_without(obj, "status"))
        if p and p[0] not in ("apiVersion", "kind") and not (p[0] == "metadata" and len(p) > 1 and p[1] in server)
    }


def changed_paths(old: Mapping[str, Any], new: Mapping[str, Any]) -> set[tuple]:
    return {p for p in _owned_paths(old) | _owned_paths(new) if _value_at(old, p) != _value_at(new, p)}


# ---- Quantities, as the API server serves them ----------------------------------------------------
#
# Written independently of the operator's own comparison (dsv4_operator.quantity), so that a
# mistake there is not mirrored here. The rules are resource.Quantity's canonical form: a number
# is kept in the format it was written in (binary SI, decimal SI, decimal exponent) and printed
# with the largest suffix that leaves an integer; binary values below 1024 or with a fraction are
# printed as decimal SI; precision below a nano rounds up.

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$"
)


def canonical_quantity(value: Any) -> str:
    """`4` -> "4", "1000m" -> "1", "0.5" -> "500m", "1024Mi" -> "1Gi", "1e3" -> "1e3"; ValueError
    for anything that is not a quantity."""
    from decimal import ROUND_CEILING, Decimal

    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    number, exponent, suffix = Decimal(m[1]), m[2], m[3] or ""
    if exponent:
        amount, form = number * Decimal(10) ** int(exponent[1:]), "exponent"
    elif suffix in _BINARY:
        amount, form = number * Decimal(1024) ** _BINARY[suffix], "binary"
    else:
        amount, form = number * Decimal(10) ** _DECIMAL[suffix], "decimal"
    amount = (amount * Decimal(10) ** 9).to_integral_value(rounding=ROUND_CEILING) / Decimal(10) ** 9
    if amount == 0:
        return "0"
    if form == "binary" and amount == amount.to_integral_value() and abs(amount) >= 1024:
        power = 0
        while amount % (Decimal(1024) ** (power + 1)) == 0 and power < 6:
            power += 1
        name = {v: k for k, v in _BINARY.items()}.get(power, "")
        return f"{int(amount / Decimal(1024) ** power)}{name}"
    power = -9
    while power < 18 and amount % (Decimal(10) ** (power + 3)) == 0:
        power += 3
    mantissa = int(amount / Decimal(10) ** power)
    if form == "exponent":
        return f"{mantissa}e{power}" if power else str(mantissa)
    return f"{mantissa}{ {v: k for k, v in _DECIMAL.items()}[power] }"


def canonicalize_quantities(obj: Any, path: tuple = ()) -> Any:
    """Every quantity field the operator writes (container resources, emptyDir sizeLimit,
    PVC requests, pod overhead) in its canonical form; kmock.KubernetesError 422 for a bad one."""
    if isinstance(obj, list):
        return [canonicalize_quantities(v, path + ("[]",)) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        here = path + (key,)
        quantity_map = (
            len(here) >= 2 and here[-2] in ("resources",) and key in ("limits", "requests") or key == "overhead"
        )
        try:
            if quantity_map and isinstance(value, dict):
                out[key] = {k: canonical_quantity(v) for k, v in value.items()}
            elif key == "sizeLimit" and value is not None:
                out[key] = canonical_quantity(value)
            else:
                out[key] = canonicalize_quantities(value, here)
        except ValueError as e:
            raise kmock.KubernetesError(422, "Invalid", f"{'.'.join(here)}: {e}") from None
    return out


# ---- Validation of the built-in kinds the operator writes ------------------------------------------


def _duplicates(items: Iterable[Any]) -> list:
    seen, dup = set(), []
    for item in items:
        if item in seen:
            dup.append(item)
        seen.add(item)
    return dup


def _pod_specs(obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    if obj.get("kind") == "Pod":
        return [("spec", obj.get("spec") or {})]
    template = ((obj.get("spec") or {}).get("template") or {}).get("spec")
    return [("spec.template.spec", template)] if isinstance(template, Mapping) else []


def _image_volumes(pod: Optional[Mapping[str, Any]]) -> set:
    return {v.get("name") for v in (pod or {}).get("volumes") or [] if "image" in v}


def drop_disabled_fields(obj: dict, live: Optional[Mapping[str, Any]], gates: Mapping[str, bool]) -> dict:
    """As the API server's dropDisabledFields: with the ImageVolume gate off, `image` volumes
    and the mounts of them leave a pod spec silently (unless the stored object already had them)."""
    if gates.get("ImageVolume", False):
        return obj
    specs = _pod_specs(obj)
    if not specs or any(_image_volumes(pod) for _, pod in _pod_specs(live or {})):
        return obj
    out = copy.deepcopy(obj)
    for _, pod in _pod_specs(out):
        names = _image_volumes(pod)
        if not names:
            continue
        pod["volumes"] = [v for v in pod.get("volumes") or [] if v.get("name") not in names]
        for c in list(pod.get("containers") or []) + list(pod.get("initContainers") or []):
            if "volumeMounts" in c:
                c["volumeMounts"] = [m for m in c["volumeMounts"] if m.get("name") not in names]
    return out


def validate_builtin(obj: Mapping[str, Any]) -> None:
    """What the API server's validation refuses (422) that a merge by key can produce: duplicate
    Service port names or port/protocol pairs, duplicate container or volume names, a
    tolerationSeconds on an effect other than NoExecute; a Service without ports (unless headless
    or ExternalName) or a pod template without containers, which taking out foreign entries leaves."""
    problems = []
    if obj.get("kind") == "Service":
        svc = obj.get("spec") or {}
        ports = svc.get("ports") or []
        if not ports and svc.get("clusterIP") != "None" and svc.get("type") != "ExternalName":
            problems.append("spec.ports: Required value")
        for name in _duplicates(p.get("name") for p in ports if p.get("name")):
            problems.append(f"spec.ports.name: Duplicate value: {name!r}")
        for pair in _duplicates((p.get("port"), p.get("protocol", "TCP")) for p in ports):
            problems.append(f"spec.ports: Duplicate value: {pair!r}")
    for where, pod in _pod_specs(obj):
        if not pod.get("containers"):
            problems.append(f"{where}.containers: Required value")
        containers = list(pod.get("containers") or []) + list(pod.get("initContainers") or [])
        for name in _duplicates(c.get("name") for c in containers):
            problems.append(f"{where}.containers.name: Duplicate value: {name!r}")
        for name in _duplicates(v.get("name") for v in pod.get("volumes") or []):
            problems.append(f"{where}.volumes.name: Duplicate value: {name!r}")
        for i, t in enumerate(pod.get("tolerations") or []):
            if t.get("tolerationSeconds") is not None and t.get("effect") != "NoExecute":
                problems.append(
                    f"{where}.tolerations[{i}].effect: Invalid value: {t.get('effect')!r}: "
                    "effect must be 'NoExecute' when `tolerationSeconds` is set"
                )
    if problems:
        raise kmock.KubernetesError(
            422,
            "Invalid",
            f"{obj.get('kind')} {(obj.get('metadata') or {}).get('name')!r} is invalid: " + "; ".join(problems),
        )


# ---- The API call recorder -----------------------------------------------------------------------


@dataclass(frozen=True)
class ApiCall:
    verb: str  # the RBAC verb: get list watch create update patch delete deletecollection
    group: str
    resource: str  # plural, or plural/subresource
    namespace: Optional[str]
    name: Optional[str]
    agent: str
    label_selector: Optional[str] = None  # of a list or watch


def rbac_verb(method: str, name: Optional[str], params: Mapping[str, str]) -> str:
    if method == "GET":
        if params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if name else "list"
    return {
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }.get(method, method.lower())


@dataclass
class ApiCallRecorder:
    """Every resource request the emulator served, as RBAC sees it."""

    calls: list[ApiCall] = field(default_factory=list)

    def record(self, request: rendering.Request, verb: Optional[str] = None) -> None:
        res = request.resource
        if res is None or res.plural is None:
            return  # discovery (/api, /apis/...): readable by every authenticated user
        resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
        self.calls.append(
            ApiCall(
                verb=verb or rbac_verb(str(request.method.value), request.name, request.params),
                group=res.group or "",
                resource=resource,
                namespace=request.namespace,
                name=request.name,
                agent=str(request.headers.get("User-Agent", "")),
                label_selector=request.params.get("labelSelector"),
            )
        )

    def record_check(
        self, verb: str, group: str, resource: str, namespace: Optional[str], name: Optional[str], agent: str
    ) -> None:
        """An authorization check an admission plugin made on the caller's behalf (RBAC must
        grant it just as it grants a call)."""
        self.calls.append(
            ApiCall(verb=verb, group=group, resource=resource, namespace=namespace, name=name, agent=agent)
        )

    def observed(self, exclude_agents: Iterable[str] = (TEST_AGENT, "kmock/")) -> set[tuple[str, str, str]]:
        """{(verb, apiGroup, resource)} made by anyone but the tests themselves."""
        skip = tuple(exclude_agents)
        return {(c.verb, c.group, c.resource) for c in self.calls if not c.agent.startswith(skip)}

    def rules(self, exclude_agents: Iterable[str] = (TEST_AGENT, "kmock/")) -> dict[tuple[str, str], set[str]]:
        """{(apiGroup, resource): {verbs}}, the shape of RBAC rules."""
        out: dict[tuple[str, str], set[str]] = {}
        for verb, group, resource in self.observed(exclude_agents):
            out.setdefault((group, resource), set()).add(verb)
        return out

    def to_json(self, exclude_agents: Iterable[str] = (TEST_AGENT, "kmock/")) -> str:
        rules = self.rules(exclude_agents)
        return json.dumps(
            [{"apiGroup": g, "resource": r, "verbs": sorted(v)} for (g, r), v in sorted(rules.items())], indent=2
        )


# ---- The emulator ---------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_precise() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _without_managed_fields(obj: Mapping[str, Any]) -> dict:
    return dict(obj, metadata=_without(obj.get("metadata") or {}, "managedFields"))


def _without(obj: Mapping[str, Any], *keys: str) -> dict:
    return {k: v for k, v in obj.items() if k not in keys}


def _generation_relevant(obj: Mapping[str, Any]) -> dict:
    return _without(obj, "metadata", "status")


@attrs.define(kw_only=True)
class KubeCluster(kmock.KubernetesEmulator):
    recorder: ApiCallRecorder = attrs.field(factory=ApiCallRecorder, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _schemas: dict = attrs.field(factory=dict, init=False)  # resource -> openAPIV3Schema
    _applied: dict = attrs.field(factory=dict, init=False)  # (key, manager) -> last applied config
    _owners: dict = attrs.field(factory=dict, init=False)  # key -> {leaf path: managers owning it}
    _custom: set = attrs.field(factory=set, init=False)  # resources served for CRDs
    # OwnerReferencesPermissionEnforcement: None (off, as on a default kubeadm cluster) or the
    # {(apiGroup, resource, verb)} the callers hold (see enforce_owner_references).
    _owner_ref_grants: Optional[set] = attrs.field(default=None, init=False)
    _caller: Optional[str] = attrs.field(default=None, init=False)  # User-Agent of the write being admitted
    # Feature gates as on a 1.29-1.33 cluster by default: ImageVolume off (the apiserver then drops
    # `image` volumes and their mounts from pod specs without a word).
    feature_gates: dict = attrs.field(factory=lambda: {"ImageVolume": False})
    _dry_run: bool = attrs.field(default=False, init=False)
    _write_times: dict = attrs.field(factory=dict, init=False)  # key -> {manager: (operation, time)}
    _writer: Optional[tuple] = attrs.field(default=None, init=False)  # (manager, operation) of the write being stored
    # Watches: the open ones' queues per resource, the events kept for watches that resume from a
    # resourceVersion (the newest watch_history per resource), and the resourceVersion below which
    # a resuming watch is told 410 Gone (compact). Bookmarks every bookmark_interval s of quiet.
    watch_history: int = attrs.field(default=10000)
    bookmark_interval: float = attrs.field(default=5.0)
    # Watch events sent, by (User-Agent, resource plural): what each client is made to process.
    watch_events: dict = attrs.field(factory=dict, init=False)
    _in_controller: bool = attrs.field(default=False, init=False)
    _watchers: dict = attrs.field(factory=dict, init=False)
    _history: dict = attrs.field(factory=dict, init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _watch_gate: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self._watch_gate.set()

    # -- custom resources --

    def register_crd(self, crd: Mapping[str, Any], *, validate: bool = True) -> None:
        """Serve a CRD's resource (as the API server does once the CRD is established)."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            res = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                shortnames=names.get("shortNames", []),
                categories=names.get("categories", []),
                subresources=list((version.get("subresources") or {}).keys()),
                verbs=["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            )
            self._custom.add(res)
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if validate and schema:
                self._schemas[res] = schema
            else:
                self._schemas.pop(res, None)

    def enforce_owner_references(self, grants: Optional[Iterable[tuple[str, str, str]]]) -> None:
        """Turn on the OwnerReferencesPermissionEnforcement admission plugin (on by default on
        OpenShift/OKD and many hardened clusters) for every caller but the tests, who hold
        `grants` ({(apiGroup, resource, verb)}, as chart_testutil.grants gives them); None turns it off.
        As the plugin: setting blockOwnerDeletion on a reference needs `update` on the owner's
        `finalizers` subresource; changing ownerReferences of an existing object needs `delete`
        on it. Each check is recorded as a call, so the RBAC proof sees it."""
        self._owner_ref_grants = None if grants is None else set(grants)

    def _resource_of_kind(self, api_version: str, kind: str) -> Optional[Any]:
        group, _, version = api_version.rpartition("/")
        for res, info in self.resources.items():
            if res.group == group and res.version == version and info.kind == kind:
                return res
        return None

    def _admit_owner_references(self, res: Any, new: Mapping[str, Any], live: Optional[Mapping[str, Any]]) -> None:
        caller = self._caller
        if self._owner_ref_grants is None or caller is None or caller.startswith((TEST_AGENT, "kmock/")):
            return
        new_refs = (new.get("metadata") or {}).get("ownerReferences") or []
        old_refs = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
        if new_refs == old_refs:
            return
        meta = new.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")

        def allowed(verb: str, group: str, resource: str, obj_name: Optional[str]) -> bool:
            self.recorder.record_check(verb, group, resource, namespace, obj_name, caller)
            return (group, resource, verb) in self._owner_ref_grants

        if live is not None and not allowed("delete", res.group or "", res.plural, name):
            raise kmock.KubernetesError(
                403,
                "Forbidden",
                f"{res.plural} {name!r} is forbidden: cannot set an ownerRef on a resource you can't delete",
            )
        blocking_before = {r.get("uid") for r in old_refs if r.get("blockOwnerDeletion")}
        for ref in new_refs:
            if not ref.get("blockOwnerDeletion") or ref.get("uid") in blocking_before:
                continue
            owner = self._resource_of_kind(ref.get("apiVersion", ""), ref.get("kind", ""))
            if owner is None:
                raise kmock.KubernetesError(422, "Invalid", f"ownerReferences: no resource for kind {ref.get('kind')}")
            if not allowed("update", owner.group or "", f"{owner.plural}/finalizers", ref.get("name")):
                raise kmock.KubernetesError(
                    403,
                    "Forbidden",
                    f"{res.plural} {name!r} is forbidden: cannot set blockOwnerDeletion if an "
                    f"ownerReference refers to a resource you can't set finalizers on: User cannot update resource "
                    f'"{owner.plural}/finalizers" in API group "{owner.group}" in the namespace "{namespace}"',
                )

    # -- Pod Security admission and the controllers that answer it --

    def pod_security_level(self, namespace: Optional[str]) -> Optional[str]:
        """The namespace's `pod-security.kubernetes.io/enforce` label (None: no Namespace or label)."""
        ns = self._live((NAMESPACES, None, namespace)) if namespace else None
        return (((ns or {}).get("metadata") or {}).get("labels") or {}).get(pod_security.ENFORCE_LABEL)

    async def put_namespace(self, name: str, labels: Optional[Mapping[str, str]] = None) -> dict:
        """Create or relabel a Namespace (kmock's router cannot serve /api/v1/namespaces/NAME: it
        takes the name for a namespace prefix), e.g. with a Pod Security level."""
        key = (NAMESPACES, None, name)
        async with self._lock:
            live = self._live(key)
            if live is None:
                return await self._create(
                    NAMESPACES,
                    None,
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels or {})}},
                    manager="kubectl-create",
                )
            new = copy.deepcopy(live)
            new["metadata"]["labels"] = dict(labels or {})
            return await self._store(key, new, live, updater="kubectl-label")

    def _admit_pod_security(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        level = self.pod_security_level(meta.get("namespace"))
        found = pod_security.violations(pod.get("spec") or {}, level)
        if found:
            raise kmock.KubernetesError(
                403, "Forbidden", pod_security.forbidden_message(meta.get("name", ""), level, found)
            )

    async def _controllers_after(self, key: tuple, new: dict, live: Optional[dict]) -> None:
        """What kube-controller-manager does after a write, where a test relies on it:
        - the StatefulSet controller creates the pods of a new or changed template; where Pod
          Security admission refuses them it creates none and posts a Warning Event FailedCreate
          on the StatefulSet with the admission's message (its other work, the pods, the tests do);
        - the disruption controller writes a PodDisruptionBudget's status (observedGeneration,
          healthy pods counted from the pods its selector matches) when the budget or a pod changes."""
        if self._in_controller:
            return
        self._in_controller = True
        caller, self._caller = self._caller, None  # the controllers' writes are not the caller's
        try:
            kind, namespace = new.get("kind"), key[1]
            if kind == "StatefulSet" and (
                live is None or new["metadata"].get("generation") != live["metadata"].get("generation")
            ):
                await self._statefulset_creates_pods(new)
            if kind == "PodDisruptionBudget" and (
                live is None or new["metadata"].get("generation") != live["metadata"].get("generation")
            ):
                await self._disruption_status(key)
            elif kind == "Pod":
                for (res, ns, name), obj in list(self.objects._objects.items()):
                    if res == PDBS and ns == namespace and not obj.deleted:
                        await self._disruption_status((res, ns, name))
        finally:
            self._in_controller = False
            self._caller = caller

    async def _statefulset_creates_pods(self, sts: dict) -> None:
        meta, spec = sts["metadata"], sts.get("spec") or {}
        replicas = spec.get("replicas", 1)
        level = self.pod_security_level(meta.get("namespace"))
        found = pod_security.violations(((spec.get("template") or {}).get("spec")) or {}, level)
        if not replicas or not found:
            return
        pod = f"{meta['name']}-0"
        message = f"create Pod {pod} in StatefulSet {meta['name']} failed error: " + pod_security.forbidden_message(
            pod, level, found
        )
        await self.post_event(sts, "Warning", "FailedCreate", message, component="statefulset-controller")

    async def post_event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str, component: str) -> dict:
        """A core/v1 Event on an object, as a controller posts it."""
        meta = obj["metadata"]
        now = _now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": "",
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
        }
        return await self._create(EVENTS, meta.get("namespace"), event, manager="kube-controller-manager")

    async def _disruption_status(self, key: tuple) -> None:
        live = self._live(key)
        if live is None:
            return
        spec = live.get("spec") or {}
        match = (spec.get("selector") or {}).get("matchLabels") or {}
        pods = [
            o.raw
            for (res, ns, _), o in self.objects._objects.items()
            if res == PODS
            and ns == key[1]
            and not o.deleted
            and all(((o.raw.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in match.items())
        ]
        healthy = sum(
            1
            for p in pods
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        )
        expected = len(pods)
        if "minAvailable" in spec:
            desired = _scaled(spec["minAvailable"], expected, up=True)
        elif "maxUnavailable" in spec:
            desired = max(0, expected - _scaled(spec["maxUnavailable"], expected, up=True))
        else:
            desired = expected
        allowed = max(0, healthy - desired)
        status = {
            "observedGeneration": live["metadata"].get("generation"),
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "disruptionsAllowed": allowed,
            "conditions": [
                {
                    "type": "DisruptionAllowed",
                    "status": "True" if allowed else "False",
                    "reason": "SufficientPods" if allowed else "InsufficientPods",
                    "message": "",
                    "observedGeneration": live["metadata"].get("generation"),
                    "lastTransitionTime": _now(),
                }
            ],
        }
        before = dict(live.get("status") or {})
        if {k: v for k, v in before.items() if k != "conditions"} == {
            k: v for k, v in status.items() if k != "conditions"
        } and [c.get("status") for c in before.get("conditions") or []] == ["True" if allowed else "False"]:
            return  # nothing changed: the controller writes nothing
        await self._store(key, dict(live, status=status), live, updater="kube-controller-manager", subresource="status")

    def objects_of(self, resource: Any, namespace: Optional[str] = None) -> list[dict]:
        res = kmock.resource(resource) if isinstance(resource, str) else resource
        return [
            obj.raw
            for (r, ns, _), obj in self.objects.items()
            if r == res and not obj.deleted and (namespace is None or ns == namespace)
        ]

    # -- request routing --

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or str(request.method.value) not in MUTATING_METHODS:
            self.recorder.record(request)
            return await super()._handle(request)
        try:
            status, body = await self._mutate(request)
        except kmock.KubernetesError as e:
            self.recorder.record(request)
            return await self._render_error(e)
        return aiohttp.web.json_response(body, status=status)

    async def _mutate(self, request: rendering.Request) -> tuple[int, dict]:
        method = str(request.method.value)
        res = request.resource
        async with self._lock:
            self._caller = str(request.headers.get("User-Agent", ""))
            self._dry_run = request.params.get("dryRun") == "All"
            saved = (copy.deepcopy(self._owners), copy.deepcopy(self._applied)) if self._dry_run else None
            try:
                return await self._mutate_locked(request, method, res)
            finally:
                self._caller = None
                self._writer = None
                if saved is not None:  # a dry run leaves no trace, field ownership included
                    self._owners, self._applied = saved
                    self._dry_run = False

    async def _mutate_locked(self, request: rendering.Request, method: str, res: Any) -> tuple[int, dict]:
        if method == "POST" and request.name is None:
            self.recorder.record(request)
            return 201, await self._create(
                res, request.namespace, self._body(request), request.params.get("fieldManager") or "unnamed-updater"
            )
        if request.name is None:
            raise kmock.KubernetesError(405, "MethodNotAllowed", f"{method} needs an object name")
        key = (res, request.namespace, request.name)
        live = self._live(key)
        updater = request.params.get("fieldManager") or "unnamed-updater"
        if (
            request.subresource == "scale"
            and live is not None
            and method in ("PATCH", "PUT")
            and live.get("kind") in ("StatefulSet", "Deployment", "ReplicaSet")
        ):
            self.recorder.record(request)
            replicas = (self._body(request).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise kmock.KubernetesError(422, "Invalid", "spec.replicas must be a non-negative integer")
            new = copy.deepcopy(live)
            new["spec"]["replicas"] = replicas
            stored = await self._store(key, new, live, updater=updater)
            return 200, {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {"name": request.name, "namespace": request.namespace},
                "spec": {"replicas": stored["spec"]["replicas"]},
            }
        if request.subresource not in (None, "status"):
            raise kmock.KubernetesNotFoundError(message=f"subresource {request.subresource} is not served")
        if method == "DELETE":
            self.recorder.record(request)
            if live is None:
                raise kmock.KubernetesObjectNotFoundError()
            return 200, await self._delete(key)
        if method == "PATCH":
            ctype = str(request.headers.get("Content-Type", "")).split(";")[0].strip()
            body = self._body(request, allow_list=ctype == "application/json-patch+json")
            if ctype == "application/apply-patch+yaml":
                manager = request.params.get("fieldManager")
                if not manager:
                    raise kmock.KubernetesError(400, "BadRequest", "fieldManager is required for apply")
                if live is None:  # apply creates; RBAC then checks `create` as well as `patch`
                    self.recorder.record(request, verb="create")
                self.recorder.record(request)
                force = str(request.params.get("force", "")).lower() == "true"
                return 200, await self._apply(key, request.subresource, body, manager, force)
            self.recorder.record(request)
            if live is None:
                raise kmock.KubernetesObjectNotFoundError()
            return 200, await self._patch(key, request.subresource, body, ctype, updater)
        if method == "PUT":
            self.recorder.record(request)
            if live is None:
                raise kmock.KubernetesObjectNotFoundError()
            body = self._body(request)
            self._check_precondition(live, body)
            new = self._scoped_write(live, body, request.subresource)
            return 200, await self._store(key, new, live, updater=updater, subresource=request.subresource)
        raise kmock.KubernetesError(405, "MethodNotAllowed", f"{method} is not served")

    @staticmethod
    def _body(request: rendering.Request, allow_list: bool = False) -> Any:
        data = request.data
        if data is None and request.text:
            try:
                data = yaml.safe_load(request.text)
            except yaml.YAMLError:
                data = None
        if isinstance(data, list) and allow_list:
            return data
        if not isinstance(data, dict):
            raise kmock.KubernetesError(400, "BadRequest", "the request body must be a JSON object")
        return copy.deepcopy(data)

    def _live(self, key: tuple) -> Optional[dict]:
        obj = self.objects._objects.get(key)
        return None if obj is None or obj.deleted else copy.deepcopy(obj.raw)

    def _has_status_subresource(self, res: Any) -> bool:
        return res in self.resources and "status" in self.resources[res].subresources

    # -- writes --

    async def _create(
        self, res: Any, url_namespace: Optional[str], body: dict, manager: str = "unnamed-updater"
    ) -> dict:
        meta = body.setdefault("metadata", {})
        if url_namespace and meta.get("namespace") not in (None, url_namespace):
            raise kmock.KubernetesError(400, "BadRequest", "the namespace of the object does not match the URL")
        namespace = url_namespace or meta.get("namespace")
        name = meta.get("name")
        if not name and meta.get("generateName"):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            name = meta["generateName"] + suffix
        if not name:
            raise kmock.KubernetesError(422, "Invalid", "metadata.name or metadata.generateName is required")
        key = (res, namespace, name)
        if self._live(key) is not None:
            raise kmock.KubernetesError(409, "AlreadyExists", f"{res.plural} {name!r} already exists")
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if namespace:
            meta["namespace"] = namespace
        for server_owned in ("resourceVersion", "deletionTimestamp", "managedFields"):
            meta.pop(server_owned, None)
        if self._has_status_subresource(res):
            body.pop("status", None)
        self._owners[key] = {p: {manager} for p in _owned_paths(body)}
        self._writer = self._writer or (manager, "Update")
        return await self._store(key, body, None)

    async def _apply(
        self, key: tuple, subresource: Optional[str], applied: dict, manager: str, force: bool = True
    ) -> dict:
        res, namespace, name = key
        if res not in self._custom:
            applied = canonicalize_quantities(applied)  # fields are compared as the server stores them
        live = self._live(key)
        previous = self._applied.get((key, manager))
        self._writer = (manager, "Apply")
        if live is None:
            applied_meta = dict(applied.get("metadata") or {}, name=name)
            obj = await self._create(res, namespace, dict(applied, metadata=applied_meta), manager=manager)
            self._applied[(key, manager)] = copy.deepcopy(applied)
            return obj
        self._check_precondition(live, applied)
        owners = self._owners.setdefault(key, {})
        if not force:  # a different value for a field someone else owns is a conflict
            taken = sorted(
                ".".join(map(str, p))
                for p in _owned_paths(applied)
                if owners.get(p, set()) - {manager} and _value_at(live, p) != _value_at(applied, p)
            )
            if taken:
                raise kmock.KubernetesError(409, "Conflict", f"Apply failed with conflicts: {', '.join(taken)}")
        # Fields another manager owns stay when this one stops applying them (shared ownership).
        others = {p for p, managers in owners.items() if managers - {manager}}
        merged = server_side_apply(live, applied, previous, kept=others)
        new = self._scoped_write(live, merged, subresource)
        for p in _owned_paths(previous or {}) - _owned_paths(applied):
            owners.get(p, set()).discard(manager)
        for p in _owned_paths(applied):  # forced: a conflicting value makes this manager the only owner
            if _value_at(live, p) != _value_at(applied, p):
                owners[p] = {manager}
            else:
                owners.setdefault(p, set()).add(manager)
        self._applied[(key, manager)] = copy.deepcopy(applied)
        return await self._store(key, new, live)

    async def _patch(
        self, key: tuple, subresource: Optional[str], body: Any, ctype: str, updater: str = "unnamed-updater"
    ) -> dict:
        live = self._live(key)
        assert live is not None
        if isinstance(body, list):
            try:
                patched = jsonpatch.apply_patch(live, body)
            except jsonpatch.JsonPatchTestFailed as e:
                raise kmock.KubernetesError(422, "Invalid", f"the JSON patch test failed: {e}") from None
            except (jsonpatch.JsonPatchConflict, jsonpointer.JsonPointerException) as e:
                raise kmock.KubernetesError(422, "Invalid", f"the JSON patch does not apply: {e}") from None
        elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json", ""):
            self._check_precondition(live, body)
            patched = merge_patch(live, body)
        else:
            raise kmock.KubernetesError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        return await self._store(
            key, self._scoped_write(live, patched, subresource), live, updater=updater, subresource=subresource
        )

    @staticmethod
    def _check_precondition(live: dict, body: Mapping[str, Any]) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != live["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(
                409, "Conflict", "the object has been modified; please apply your changes to the latest version"
            )

    def _scoped_write(self, live: dict, new: dict, subresource: Optional[str]) -> dict:
        """A /status write changes only status; other writes never change status (when the
        resource has a status subresource) nor the server-owned metadata."""
        out = copy.deepcopy(new)
        if subresource == "status":
            out = copy.deepcopy(dict(live, status=new.get("status")))
            if out["status"] is None:
                out.pop("status")
        elif self._status_is_separate(live):
            out.pop("status", None)
            if "status" in live:
                out["status"] = copy.deepcopy(live["status"])
        meta = out.setdefault("metadata", {})
        for owned in ("uid", "creationTimestamp", "name", "namespace", "generation", "deletionTimestamp"):
            if owned in live["metadata"]:
                meta[owned] = live["metadata"][owned]
            else:
                meta.pop(owned, None)
        return out

    def _status_is_separate(self, live: dict) -> bool:
        api_version = live.get("apiVersion", "")
        group, _, version = api_version.rpartition("/")
        for res, info in self.resources.items():
            if res.group == group and res.version == version and info.kind == live.get("kind"):
                return "status" in info.subresources
        return False

    async def _store(
        self,
        key: tuple,
        new: dict,
        live: Optional[dict],
        updater: Optional[str] = None,
        subresource: Optional[str] = None,
    ) -> dict:
        """`updater`: the field manager of a non-apply write; it becomes the only owner of the
        fields it changed (as an Update does in managedFields)."""
        res = key[0]
        writer, self._writer = ((updater, "Update", subresource) if updater is not None else self._writer), None
        if updater is not None and live is not None:
            owners = self._owners.setdefault(key, {})
            for p in changed_paths(live, new):
                owners[p] = {updater}
        if new.get("kind") == "Secret" and "stringData" in new:  # write-only: merged into data, base64
            new = dict(new)
            encoded = {k: base64.b64encode(str(v).encode()).decode() for k, v in (new.pop("stringData") or {}).items()}
            new["data"] = {**(new.get("data") or {}), **encoded}
        self._admit_owner_references(res, new, live)
        if res in self._schemas:
            new = self._admit_custom(res, new)
        elif res not in self._custom:  # built-in kinds: quantities served canonical ("4", "1", "1Gi")
            new = drop_disabled_fields(canonicalize_quantities(new), live, self.feature_gates)
            validate_builtin(new)
            if new.get("kind") == "Pod" and live is None:
                self._admit_pod_security(new)
        if res == CRD_RESOURCE and live is None:
            self.register_crd(new)
        meta = new.setdefault("metadata", {})
        if live is not None:
            old_gen = int(live["metadata"].get("generation") or 1)
            changed = _generation_relevant(new) != _generation_relevant(live)
            meta["generation"] = old_gen + 1 if changed else old_gen
            meta["resourceVersion"] = live["metadata"].get("resourceVersion")
            if _without_managed_fields(new) == _without_managed_fields(live):
                return live  # a no-op write: nothing stored, no event, same resourceVersion
        if self._dry_run:
            return new  # dryRun=All: admitted and answered, never stored
        if res not in self._custom:  # who wrote what, as a real API server reports it
            if writer is not None:
                self._write_times.setdefault(key, {})[writer[0]] = (
                    writer[1],
                    _now_precise(),
                    writer[2] if len(writer) > 2 else None,
                )
            meta["managedFields"] = self._managed_fields(key)
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        if live is None:
            if key in self.objects._objects:
                self.objects._objects[key].create(new)
            else:
                self.objects[key] = new
            self._publish(res, {"type": "ADDED", "object": copy.deepcopy(new)})
        else:
            self.objects._objects[key].create(new)
            self._publish(res, {"type": "MODIFIED", "object": copy.deepcopy(new), "old": live})
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                await self._remove(key)
                return new
        await self._controllers_after(key, new, live)
        refs = meta.get("ownerReferences") or []
        if refs and not any(self._uid_alive(r.get("uid")) for r in refs):
            # The garbage collector deletes dependents of owners that no longer exist, also when
            # they are (re)created after the owner is gone (a late reconcile, for instance).
            await self._delete(key)
        return new

    def _managed_fields(self, key: tuple) -> list[dict]:
        """metadata.managedFields: per manager, the fields it owns (FieldsV1: `f:` names and the
        `k:` keys of list-map entries), its last operation and when."""
        by_manager: dict[str, dict] = {}
        for path, managers in (self._owners.get(key) or {}).items():
            for manager in managers:
                node = by_manager.setdefault(manager, {})
                for part in path:
                    node = node.setdefault(part if str(part).startswith("k:") else f"f:{part}", {})
        out = []
        for manager, fields_v1 in sorted(by_manager.items()):
            operation, when, sub = (self._write_times.get(key) or {}).get(manager, ("Update", _now_precise(), None))
            entry = {
                "manager": manager,
                "operation": operation,
                "apiVersion": key[0].version,
                "time": when,
                "fieldsType": "FieldsV1",
                "fieldsV1": fields_v1,
            }
            if sub:
                entry["subresource"] = sub
            out.append(entry)
        for manager, (operation, when, sub) in sorted((self._write_times.get(key) or {}).items()):
            if manager not in by_manager and sub == "status":  # status writers own status fields (not tracked)
                out.append(
                    {
                        "manager": manager,
                        "operation": operation,
                        "apiVersion": key[0].version,
                        "time": when,
                        "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:status": {}},
                        "subresource": sub,
                    }
                )
        return out

    def _admit_custom(self, res: Any, obj: dict) -> dict:
        schema = self._schemas[res]
        obj = prune_unknown(apply_defaults(obj, schema), schema)
        validator = jsonschema.Draft202012Validator(to_jsonschema(schema))
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            message = "; ".join(f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors)
            raise kmock.KubernetesError(422, "Invalid", message)
        broken = cel_violations(obj, schema)
        if broken:
            raise kmock.KubernetesError(422, "Invalid", "; ".join(broken))
        return obj

    async def _delete(self, key: tuple) -> dict:
        live = self._live(key)
        assert live is not None
        meta = live["metadata"]
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return live
            new = copy.deepcopy(live)
            new["metadata"]["deletionTimestamp"] = _now()
            return await self._store(key, new, live)
        await self._remove(key)
        return live

    async def _remove(self, key: tuple) -> None:
        """Delete for real, then let the garbage collector at the dependents."""
        live = self._live(key)
        if live is None:
            return
        res = key[0]
        self.objects._objects[key].delete()
        self._applied = {k: v for k, v in self._applied.items() if k[0] != key}
        self._owners.pop(key, None)
        self._write_times.pop(key, None)
        self._rv += 1
        gone = dict(live, metadata=dict(live["metadata"], resourceVersion=str(self._rv)))
        self._publish(res, {"type": "DELETED", "object": gone})
        await self._collect_garbage(live["metadata"].get("uid"))

    async def _collect_garbage(self, owner_uid: Optional[str]) -> None:
        if not owner_uid:
            return
        self._caller = None  # the garbage collector's own writes are not the caller's
        for key, obj in list(self.objects._objects.items()):
            if obj.deleted:
                continue
            live = copy.deepcopy(obj.raw)
            refs = live.get("metadata", {}).get("ownerReferences") or []
            if not any(r.get("uid") == owner_uid for r in refs):
                continue
            remaining = [r for r in refs if r.get("uid") != owner_uid and self._uid_alive(r.get("uid"))]
            if remaining:
                new = copy.deepcopy(live)
                new["metadata"]["ownerReferences"] = remaining
                await self._store(key, new, live)
            else:
                await self._delete(key)

    def _uid_alive(self, uid: Optional[str]) -> bool:
        return any(
            not obj.deleted and obj.raw.get("metadata", {}).get("uid") == uid for obj in self.objects._objects.values()
        )

    # -- reads --

    def _matching(self, request: rendering.Request) -> list[dict]:
        selector = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        out = []
        for (res, ns, _), obj in self.objects._objects.items():
            if res != request.resource or obj.deleted:
                continue
            if request.namespace is not None and ns != request.namespace:
                continue
            raw = obj.raw
            try:
                if label_selector_matches(
                    selector, raw.get("metadata", {}).get("labels") or {}
                ) and field_selector_matches(fields, raw, self._kind_of(res)):
                    out.append(copy.deepcopy(raw))
            except ValueError as e:
                raise kmock.KubernetesError(400, "BadRequest", str(e)) from None
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _kind_of(self, res: Any) -> str:
        info = self.resources[res] if res in self.resources else None
        return info.kind if info is not None and info.kind else res.plural.capitalize()

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self.resources and not any(r == request.resource for r, _, _ in self.objects):
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._matching(request)
            rv = str(self._rv)
        res = request.resource
        return {
            "apiVersion": f"{res.group}/{res.version}" if res.group else res.version,
            "kind": f"{self._kind_of(res)}List",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    def _publish(self, res: Any, event: dict) -> None:
        """An event to every watch of the resource, and to its history (what a watch from an older
        resourceVersion replays). Called under the write lock, so the order is the write order."""
        history = self._history.setdefault(res, [])
        history.append(event)
        if len(history) > self.watch_history:  # the oldest leave the window: watches from before them get 410
            dropped = history.pop(0)
            self._compacted_rv = max(self._compacted_rv, int(dropped["object"]["metadata"]["resourceVersion"]))
        for queue in self._watchers.get(res, ()):
            queue.put_nowait(event)

    def compact(self) -> int:
        """As etcd's compaction: forget every event so far. A watch from an older resourceVersion
        is then answered 410 Gone (an ERROR event), and its client must list again."""
        self._compacted_rv = self._rv
        self._history.clear()
        return self._rv

    def sever_watches(self) -> int:
        """End every open watch now, as a restarted API server or a dropped connection does.
        Returns how many were open."""
        count = 0
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(None)
                count += 1
        return count

    @contextlib.asynccontextmanager
    async def watches_down(self, compact: bool = True) -> AsyncIterator[None]:
        """Open watches end and new ones wait (their clients reconnect to nothing) while the body
        runs: what the body writes is seen by no watch. On the way out the history is compacted
        (by default), so a client resuming from where it was is told 410 Gone and must relist."""
        self._watch_gate.clear()
        self.sever_watches()
        try:
            yield
        finally:
            if compact:
                self.compact()
            self._watch_gate.set()

    def _bookmark(self, res: Any, rv: int) -> dict:
        return {
            "type": "BOOKMARK",
            "object": {
                "apiVersion": f"{res.group}/{res.version}" if res.group else res.version,
                "kind": self._kind_of(res),
                "metadata": {"resourceVersion": str(rv)},
            },
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        """A watch as the API server serves one: without a resourceVersion (or "0") the current
        objects as ADDED, then changes; from a resourceVersion the events after it, or one ERROR
        event 410 Gone when they are older than the history kept (compact, watch_history); with
        allowWatchBookmarks, a BOOKMARK (the resourceVersion everything up to has been sent)
        every bookmark_interval seconds of quiet."""
        yield b""  # send the headers now: the stream may stay quiet for a while
        await self._watch_gate.wait()
        res = request.resource
        selector = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        since = request.params.get("resourceVersion")
        bookmarks = request.params.get("allowWatchBookmarks") in ("true", "1")
        timeout = request.params.get("timeoutSeconds")
        deadline = time.monotonic() + float(timeout) if timeout else None
        kind = self._kind_of(res)
        counted = (str(request.headers.get("User-Agent", "")), res.plural)
        try:
            field_selector_matches(fields, {}, kind)
        except ValueError as e:
            yield {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "reason": "BadRequest",
                    "code": 400,
                    "message": str(e),
                },
            }
            return
        queue: asyncio.Queue = asyncio.Queue()
        async with self._lock:  # no write can slip between the snapshot and the subscription
            expired = bool(since and since != "0" and int(since) < self._compacted_rv)
            if expired:
                replay = []
            elif since and since != "0":
                replay = [
                    e
                    for e in self._history.get(res, [])
                    if int(e["object"]["metadata"]["resourceVersion"]) > int(since)
                ]
            else:
                replay = [{"type": "ADDED", "object": obj} for obj in self._matching(request)]
            if not expired:
                self._watchers.setdefault(res, []).append(queue)
        if expired:
            yield {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "reason": "Expired",
                    "code": 410,
                    "message": f"too old resource version: {since} ({self._compacted_rv})",
                },
            }
            return
        try:
            for event in replay:
                out = self._filter_event(event, request.namespace, selector, fields, kind)
                if out is not None:
                    self.watch_events[counted] = self.watch_events.get(counted, 0) + 1
                    yield out
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                wait = remaining if not bookmarks else min(remaining or self.bookmark_interval, self.bookmark_interval)
                try:
                    event = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    if not bookmarks or (deadline is not None and time.monotonic() >= deadline):
                        return
                    async with self._lock:  # every event up to _rv is queued by now: none queued, all sent
                        quiet, rv = queue.empty(), self._rv
                    if quiet:
                        yield self._bookmark(res, rv)
                    continue
                if event is None:  # severed
                    return
                out = self._filter_event(event, request.namespace, selector, fields, kind)
                if out is not None:
                    self.watch_events[counted] = self.watch_events.get(counted, 0) + 1
                    yield out
        finally:
            watchers = self._watchers.get(res, [])
            if queue in watchers:
                watchers.remove(queue)

    @staticmethod
    def _filter_event(
        event: Mapping[str, Any],
        namespace: Optional[str],
        selector: Optional[str],
        fields: Optional[str],
        kind: Optional[str] = None,
    ) -> Optional[dict]:
        obj = event["object"]
        if namespace is not None and obj.get("metadata", {}).get("namespace") != namespace:
            return None

        def matches(o: Optional[Mapping[str, Any]]) -> bool:
            return (
                o is not None
                and label_selector_matches(selector, (o.get("metadata") or {}).get("labels") or {})
                and field_selector_matches(fields, o, kind)
            )

        now_in, was_in = matches(obj), matches(event.get("old"))
        if event["type"] == "MODIFIED":
            if now_in and not was_in:
                return {"type": "ADDED", "object": obj}
            if was_in and not now_in:
                return {"type": "DELETED", "object": obj}
        if not now_in:
            return None
        return {"type": event["type"], "object": obj}

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            payload["groupVersion"] = "v1"  # kmock says "/v1" for the core group
        return payload


# ---- A client for the tests themselves ------------------------------------------------------------


class ClusterError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


def object_path(
    api_version: str,
    plural: str,
    namespace: Optional[str] = None,
    name: Optional[str] = None,
    subresource: Optional[str] = None,
) -> str:
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class ClusterClient:
    """The tests' own kubectl: plain HTTP to the emulator, marked with its own User-Agent so the
    API call recorder can tell its calls from the operator's."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "ClusterClient":
        self._session = aiohttp.ClientSession(headers={"User-Agent": TEST_AGENT})
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._session is not None
        await self._session.close()

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: Optional[Mapping[str, str]] = None,
    ) -> Any:
        assert self._session is not None
        data = None if body is None else json.dumps(body)
        async with self._session.request(
            method, self.base_url + path, data=data, params=params, headers={"Content-Type": content_type}
        ) as resp:
            text = await resp.text()
            doc = json.loads(text) if text else None
            if resp.status >= 400:
                raise ClusterError(resp.status, doc)
            return doc

    async def create(self, obj: Mapping[str, Any], plural: str) -> dict:
        ns = (obj.get("metadata") or {}).get("namespace")
        return await self.call("POST", object_path(obj["apiVersion"], plural, ns), obj)

    async def get(self, api_version: str, plural: str, namespace: Optional[str], name: str) -> Optional[dict]:
        try:
            return await self.call("GET", object_path(api_version, plural, namespace, name))
        except ClusterError as e:
            if e.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, plural: str, namespace: Optional[str] = None, label_selector: Optional[str] = None
    ) -> list[dict]:
        params = {"labelSelector": label_selector} if label_selector else None
        doc = await self.call("GET", object_path(api_version, plural, namespace), params=params)
        return doc["items"]

    async def patch(
        self,
        api_version: str,
        plural: str,
        namespace: Optional[str],
        name: str,
        patch: Any,
        subresource: Optional[str] = None,
    ) -> dict:
        return await self.call(
            "PATCH",
            object_path(api_version, plural, namespace, name, subresource),
            patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, api_version: str, plural: str, namespace: Optional[str], name: str) -> dict:
        return await self.call("DELETE", object_path(api_version, plural, namespace, name))


async def eventually(check: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll an async (or sync) check until it returns something truthy; its last error or a
    timeout otherwise. The loop keeps serving the emulator while it waits."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return result
            last = result
        except AssertionError as e:
            last = e
        if time.monotonic() > deadline:
            if isinstance(last, AssertionError):
                raise last
            raise AssertionError(f"not true within {timeout}s (last: {last!r})")
        await asyncio.sleep(interval)


def write_kubeconfig(path: Path, server: str, token: str = "test-token", namespace: str = "default") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "operator", "user": {"token": token}}],
                "contexts": [
                    {"name": "kmock", "context": {"cluster": "kmock", "user": "operator", "namespace": namespace}}
                ],
            }
        )
    )
    return path


# ---- Fixtures ---------------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def kube_cluster() -> AsyncIterator[KubeCluster]:
    """The emulator, listening on 127.0.0.1 (random port); `.url` is its base URL."""
    async with KubeCluster() as cluster, kmock.Server(cluster):
        yield cluster


@pytest_asyncio.fixture
async def kube_client(kube_cluster: KubeCluster) -> AsyncIterator[ClusterClient]:
    async with ClusterClient(str(kube_cluster.url)) as client:
        yield client


@pytest.fixture
def kubeconfig(kube_cluster: KubeCluster, tmp_path: Path) -> Path:
    """A kubeconfig file pointing at the emulator."""
    return write_kubeconfig(tmp_path / "kubeconfig", str(kube_cluster.url).rstrip("/"))


@pytest.fixture
def api_calls(kube_cluster: KubeCluster) -> ApiCallRecorder:
    """What was called on the emulator, as (verb, apiGroup, resource) — for RBAC checks."""
    return kube_cluster.recorder


__all__ = [
    "ApiCall",
    "ApiCallRecorder",
    "ClusterClient",
    "ClusterError",
    "KubeCluster",
    "TEST_AGENT",
    "api_calls",
    "eventually",
    "kube_client",
    "kube_cluster",
    "kubeconfig",
    "label_selector_matches",
    "merge_patch",
    "object_path",
    "server_side_apply",
    "write_kubeconfig",
]
