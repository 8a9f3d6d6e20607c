"""The evidence ConfigMap written before a wedged pod is restarted (pure body builder).

What was live at the moment of the wedge — every thread's stack, the queue state, the stuck
requests' timelines (their PD events, from /v1/loads' `requests`), a metrics snapshot, the pod's last log lines, the spec diff since the last stable revision and the verdict —
is lost by the restart, so it is kept in a ConfigMap labelled ``serving.dsv4.dev/evidence=true``.
A ConfigMap holds at most 1 MiB: each field is cut to a share of a byte budget (small fields keep
everything, large ones split what is left by weight), keeping the part that matters (the end of
logs, the start of stacks and metrics) and saying how much was dropped.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Iterable, Mapping

from dsv4_wire import ANNOTATION_REVISION
from dsv4_wire import LABEL_DEPLOYMENT as DEPLOYMENT_LABEL
from dsv4_wire import LABEL_EVIDENCE as EVIDENCE_LABEL
from dsv4_wire import LABEL_POD as POD_LABEL
from dsv4_wire import LABEL_ROLE as ROLE_LABEL

# Room for metadata and JSON/YAML overhead below the API server's 1 MiB object limit.
DEFAULT_DATA_BUDGET = 900 * 1024

# data key -> (weight in the budget split, which end to keep when cut)
FIELDS: dict[str, tuple[float, str]] = {
    "verdict.json": (1.0, "head"),
    "spec-diff.txt": (1.0, "head"),
    "loads.json": (1.0, "head"),
    "timelines.json": (1.0, "head"),
    "stacks.txt": (4.0, "head"),
    "logs.txt": (4.0, "tail"),
    "metrics.txt": (2.0, "head"),
}


def _marker(dropped: int) -> str:
    return f"\n[... {dropped} bytes truncated ...]\n"


def truncate_utf8(text: str, limit: int, keep: str = "head") -> str:
    """At most ``limit`` UTF-8 bytes of ``text``, cut on a character boundary, with a marker
    saying how many bytes were dropped (``keep``: head, tail or both ends)."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    # Reserve the marker's room for the largest count it could show, so the result fits.
    room = limit - len(_marker(len(raw)).encode())
    if room <= 0:
        return raw[: max(limit, 0)].decode("utf-8", "ignore")
    marker = _marker(len(raw) - room)
    if keep == "tail":
        return marker.lstrip("\n") + raw[len(raw) - room :].decode("utf-8", "ignore")
    if keep == "both":
        head = room // 2
        return raw[:head].decode("utf-8", "ignore") + marker + raw[len(raw) - (room - head) :].decode("utf-8", "ignore")
    return raw[:room].decode("utf-8", "ignore") + marker.rstrip("\n")


def split_budget(sizes: Mapping[str, int], weights: Mapping[str, float], budget: int) -> dict[str, int]:
    """Weighted water-filling: fields under their share keep their size, the rest share what is
    left by weight.  Returns a byte limit per field whose sum is at most ``budget``."""
    limits: dict[str, int] = {}
    open_fields = dict(sizes)
    left = budget
    while open_fields:
        total_w = sum(weights.get(k, 1.0) for k in open_fields)
        fits = {k: s for k, s in open_fields.items() if s <= left * weights.get(k, 1.0) / total_w}
        if not fits:
            for k in open_fields:
                limits[k] = int(left * weights.get(k, 1.0) / total_w)
            break
        for k, s in fits.items():
            limits[k] = s
            left -= s
            del open_fields[k]
    return limits


_DNS_BAD = re.compile(r"[^a-z0-9-]+")


def _dns_label(text: str, limit: int) -> str:
    s = _DNS_BAD.sub("-", text.lower()).strip("-")
    return s[:limit].strip("-") or "x"


def _label_value(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return s.strip("-._") or "x"


def evidence_name(deployment: str, pod: str, captured_at: float) -> str:
    """``<deployment>-evidence-<pod>-<utc time>``: sortable, unique per pod and second, and a
    valid object name (lowercase, at most 253 characters)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(captured_at))
    return f"{_dns_label(deployment, 63)}-evidence-{_dns_label(pod, 160)}-{stamp}"


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(i, str) for i in value):
        return "\n".join(value) + ("\n" if value else "")
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def stuck_timelines(loads: Any) -> Any:
    """The requests' PD timelines of an engine's /v1/loads (the engine lists the unfinished
    hand-offs first, the longest without progress first), or None when it has none (an SGLang
    engine, an engine that did not answer). Pure."""
    if not isinstance(loads, Mapping):
        return None
    requests = loads.get("requests")
    return requests if isinstance(requests, list) else None


def build_evidence_configmap(
    *,
    deployment: str,
    namespace: str,
    pod: str,
    role: str,
    captured_at: float,
    verdict: Mapping[str, Any],
    stacks: str | None = None,
    loads: Any = None,
    metrics: str | None = None,
    logs: str | Iterable[str] | None = None,
    spec_diff: str | Iterable[str] | None = None,
    revision: str | None = None,
    owner_references: list[Mapping[str, Any]] | None = None,
    data_budget: int = DEFAULT_DATA_BUDGET,
) -> dict[str, Any]:
    """The ConfigMap body (a dict ready for the API).  Missing pieces (a dead pod answers no
    /debug/stacks) are written as a one-line note so the record says what could not be had."""
    raw = {
        "verdict.json": _as_text(dict(verdict)),
        "spec-diff.txt": _as_text(
            list(spec_diff) if spec_diff is not None and not isinstance(spec_diff, str) else spec_diff
        ),
        "loads.json": _as_text(loads),
        "timelines.json": _as_text(stuck_timelines(loads)),
        "stacks.txt": _as_text(stacks),
        "logs.txt": _as_text(list(logs) if logs is not None and not isinstance(logs, str) else logs),
        "metrics.txt": _as_text(metrics),
    }
    for key, text in raw.items():
        if not text:
            raw[key] = f"(not captured: {key.split('.')[0]} unavailable)\n"
    sizes = {k: len(v.encode("utf-8")) for k, v in raw.items()}
    limits = split_budget(sizes, {k: FIELDS[k][0] for k in raw}, data_budget)
    data = {k: truncate_utf8(v, limits[k], FIELDS[k][1]) for k, v in raw.items()}

    metadata: dict[str, Any] = {
        "name": evidence_name(deployment, pod, captured_at),
        "namespace": namespace,
        "labels": {
            EVIDENCE_LABEL: "true",
            DEPLOYMENT_LABEL: _label_value(deployment),
            POD_LABEL: _label_value(pod),
            ROLE_LABEL: _label_value(role),
        },
        "annotations": {
            POD_LABEL: pod,
            "serving.dsv4.dev/captured-at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(captured_at)),
            "serving.dsv4.dev/reason": str(verdict.get("reason", verdict.get("state", ""))),
            "serving.dsv4.dev/truncated": ",".join(k for k in raw if sizes[k] > limits[k]),
        },
    }
    if revision:
        metadata["annotations"][ANNOTATION_REVISION] = revision
    if owner_references:
        metadata["ownerReferences"] = [dict(o) for o in owner_references]
    # Immutable: a record nobody can rewrite after the fact (deleting it is what pruning does).
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data, "immutable": True}
