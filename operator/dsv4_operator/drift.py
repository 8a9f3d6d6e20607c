"""Foreign entries in the lists the operator writes (pure).

Server-side apply merges list-maps by key (Service ports by port and protocol; containers,
env, volumes by name; volume mounts by path): a forced apply takes back the fields of the
entries it names but never removes an entry another writer added. A hand-edited Service port
then leaves two ports named `http` (the apply is a 422), and a foreign env var or container
stays in the pod template. Drift repair removes, by JSON patch, every entry of such a list whose
key the operator's manifest does not name, then applies. The same patch adds the entries of
ours that such a list lacks, so the object between the patch and the apply is never one a real
API server refuses (a Service whose only port was hand-edited would otherwise have none).

Labels are maps, merged key by key the same way, and are treated by what they do:
- a label (or annotation) someone adds to a child's own metadata is kept: cost-allocation,
  backup and GitOps tools label objects, and the label changes nothing the operator runs;
- a label added to a pod template (spec.template.metadata.labels) or to a selector (a Service's
  spec.selector, a budget's or policy's matchLabels) is removed: it changes which pods exist
  (a template edit rolls every GPU engine) or which pods get traffic or protection. Template
  annotations stay: `kubectl rollout restart` writes one there, and removing it would undo a
  restart the user asked for.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

LIST_MAP_FIELDS = frozenset(
    {"containers", "initContainers", "env", "volumes", "volumeMounts", "ports", "imagePullSecrets"}
)


def entry_key(field: str, item: Any) -> Optional[str]:
    """Pure: the key an API server merges a list-map entry by (protocol defaults to TCP)."""
    if not isinstance(item, Mapping):
        return None
    if field == "volumeMounts":
        keys: dict[str, Any] = {"mountPath": item.get("mountPath")}
    elif field == "ports":
        port = "containerPort" if "containerPort" in item else "port"
        keys = {port: item.get(port), "protocol": item.get("protocol") or "TCP"}
    else:
        keys = {"name": item.get("name")}
    if any(v is None for v in keys.values()):
        return None
    return json.dumps(keys, sort_keys=True)


def foreign_entry_removals(live: Any, wanted: Any, pointer: str = "") -> list[dict[str, Any]]:
    """Pure: JSON patch `remove` operations for the list-map entries of `live` whose key `wanted`
    does not name, in the lists `wanted` sets (recursively into the entries both have: a
    container's env), then `add` operations for the wanted entries missing from a list that lost
    some. Within a list the removals come after the nested operations, highest index first, and
    the additions append at the end, so every operation's index holds when it runs."""
    if not isinstance(live, Mapping) or not isinstance(wanted, Mapping):
        return []
    nested: list[dict[str, Any]] = []
    removals: list[dict[str, Any]] = []
    additions: list[dict[str, Any]] = []
    for field, want in wanted.items():
        have = live.get(field)
        here = f"{pointer}/{field}"
        if field in LIST_MAP_FIELDS and isinstance(want, list) and isinstance(have, list):
            wanted_by_key = {entry_key(field, item): item for item in want}
            if None in wanted_by_key:
                continue  # an entry without its key: the list is not merged by key
            present = set()
            removed = False
            for index in range(len(have) - 1, -1, -1):
                key = entry_key(field, have[index])
                if key in wanted_by_key:
                    present.add(key)
                    nested += foreign_entry_removals(have[index], wanted_by_key[key], f"{here}/{index}")
                else:
                    removed = True
                    removals.append({"op": "remove", "path": f"{here}/{index}"})
            if removed:
                additions += [
                    {"op": "add", "path": f"{here}/-", "value": item}
                    for key, item in wanted_by_key.items()
                    if key not in present
                ]
        elif isinstance(want, Mapping):
            nested += foreign_entry_removals(have, want, here)
    return nested + removals + additions


# Label maps the operator owns whole: the pod template's labels and the selectors (paths from the
# object's root; a workload's selector is immutable, so only the others can drift).
OWNED_LABEL_MAPS = (
    ("spec", "template", "metadata", "labels"),
    ("spec", "selector"),
    ("spec", "selector", "matchLabels"),
    ("spec", "podSelector", "matchLabels"),
)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def foreign_label_removals(live: Any, wanted: Any) -> list[dict[str, Any]]:
    """Pure: JSON patch `remove` operations for the keys of live's pod-template labels and selectors
    (OWNED_LABEL_MAPS) that `wanted` does not set. A map `wanted` does not set at all is left alone
    (a Service without a selector, a workload's selector of matchExpressions)."""
    ops = []
    for path in OWNED_LABEL_MAPS:
        have, want = live, wanted
        for part in path:
            have = have.get(part) if isinstance(have, Mapping) else None
            want = want.get(part) if isinstance(want, Mapping) else None
        if not isinstance(have, Mapping) or not isinstance(want, Mapping):
            continue
        if path == ("spec", "selector") and ("matchLabels" in want or "matchExpressions" in want):
            continue  # a label selector, not a Service's plain map: its matchLabels has its own entry
        pointer = "/" + "/".join(path)
        ops += [{"op": "remove", "path": f"{pointer}/{_escape(key)}"} for key in sorted(have) if key not in want]
    return ops


def describe_removals(live: Mapping[str, Any], ops: list[dict[str, Any]]) -> list[str]:
    """Pure: what each removal takes out, for the Event (`spec.ports[1] (name=http, port=8001)`)."""
    out = []
    for op in ops:
        if op["op"] != "remove":
            continue
        node: Any = live
        parts = [_unescape(p) for p in op["path"].strip("/").split("/")]
        for part in parts:
            node = node[int(part)] if isinstance(node, list) else node.get(part)
        if not isinstance(node, Mapping):  # a map key: a label
            out.append(f"{'.'.join(parts[:-1])}[{parts[-1]}={node}]")
            continue
        label = ", ".join(f"{k}={node[k]}" for k in ("name", "port", "containerPort", "mountPath") if k in node)
        out.append(f"{'.'.join(parts[:-1])}[{parts[-1]}] ({label})")
    return out
