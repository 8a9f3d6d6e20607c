"""The rollback pin: which stored revision the children are built from instead of the spec.

`rollback: auto` does not rewrite the user's spec (a GitOps tool would put it back, and the two
would fight). The watchdog writes ANNOTATION_PINNED_REVISION = "<revision hash>@<generation>"
instead; while the resource is still at that generation, the reconciler builds the children from
that revision's spec, which the watchdog's history (ANNOTATION_REVISIONS) holds. The user's next
edit of the spec moves the generation on and so ends the pin. Pure: no I/O.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping, Optional

from dsv4_wire import ANNOTATION_PINNED_REVISION, ANNOTATION_REVISIONS

from dsv4_operator.watchdog.revisions import IGNORED_KEYS, RevisionTracker


def pin_value(revision_hash: str, generation: int) -> str:
    return f"{revision_hash}@{int(generation)}"


def pinned_revision(annotations: Optional[Mapping[str, str]], generation: int) -> Optional[str]:
    """The pinned revision's hash when a pin is set for ``generation``, else None."""
    pin = (annotations or {}).get(ANNOTATION_PINNED_REVISION) or ""
    revision, _, at = pin.partition("@")
    if not revision or not at.isdigit() or int(at) != generation:
        return None
    return revision


def pinned_spec(
    annotations: Optional[Mapping[str, str]], generation: int, raw_spec: Optional[Mapping[str, Any]]
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(the spec to build children from, its revision hash) when a pin applies, else (None,
    None). A pin applies while the resource is at the pinned generation, and only to a revision
    the history holds. The remediation section is always the current one (revisions leave it
    out)."""
    annotations = annotations or {}
    revision = pinned_revision(annotations, generation)
    if revision is None:
        return None, None
    try:
        tracker = RevisionTracker.from_dict(json.loads(annotations.get(ANNOTATION_REVISIONS) or "{}"))
    except (ValueError, TypeError, KeyError):
        return None, None
    spec = revision_spec(tracker, revision, raw_spec)
    return (spec, revision) if spec is not None else (None, None)


def revision_spec(
    tracker: RevisionTracker, revision: str, raw_spec: Optional[Mapping[str, Any]]
) -> Optional[dict[str, Any]]:
    """The stored revision's spec with the current remediation and planner sections (the parts
    revisions leave out), or None if the history does not hold it."""
    for rev in tracker.revisions:
        if rev.hash == revision:
            spec = copy.deepcopy(dict(rev.spec))
            for key in IGNORED_KEYS:
                if raw_spec and key in raw_spec:
                    spec[key] = copy.deepcopy(raw_spec[key])
            return spec
    return None
