"""Foreign entries in the lists the operator writes (pure).

Server-side apply merges list-maps by key (Service ports by port and protocol; containers,
env, volumes by name; volume mounts by path): a forced apply takes back the fields of the
entries it names but never removes an entry another writer added. A hand-edited Service port
then leaves two ports named `http` (the apply is a 422), and a foreign env var or container
stays in the pod template. Drift repair removes, by JSON patch, every entry of such a list whose
key the operator's manifest does not name, then applies. The same patch adds the entries of
ours that such a list lacks, so the object between the patch and the apply is never one a real
API server refuses (a Service whose only port was hand-edited would otherwise have none).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

LIST_MAP_FIELDS = frozenset({"containers", "initContainers", "env", "volumes", "volumeMounts", "ports",
                             "imagePullSecrets"})


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
                additions += [{"op": "add", "path": f"{here}/-", "value": item}
                              for key, item in wanted_by_key.items() if key not in present]
        elif isinstance(want, Mapping):
            nested += foreign_entry_removals(have, want, here)
    return nested + removals + additions


def describe_removals(live: Mapping[str, Any], ops: list[dict[str, Any]]) -> list[str]:
    """Pure: what each removal takes out, for the Event (`spec.ports[1] (name=http, port=8001)`)."""
    out = []
    for op in ops:
        if op["op"] != "remove":
            continue
        node: Any = live
        parts = op["path"].strip("/").split("/")
        for part in parts:
            node = node[int(part)] if isinstance(node, list) else node.get(part)
        label = ", ".join(f"{k}={node[k]}" for k in ("name", "port", "containerPort", "mountPath")
                          if isinstance(node, Mapping) and k in node)
        out.append(f"{'.'.join(parts[:-1])}[{parts[-1]}] ({label})")
    return out
