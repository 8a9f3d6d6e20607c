"""Pods a StatefulSet controller cannot create: why a deployment stays short of pods.

The operator writes StatefulSets; their pods are made by kube-controller-manager, and admission
(Pod Security above all: `security.ipcLock` and a hostPath model volume need the `privileged`
level, SGLang's root image `baseline`) refuses them there, not at the operator's apply. The
controller then makes no pod and says why only in a Warning Event `FailedCreate` on the
StatefulSet. The operator watches those Events (one watch, selected by reason and kind on the API
server) and reports the controller's message as Degraded=True, reason FailedCreate, instead of
"RollingOut" forever.

A failure stands while its StatefulSet (the same object: same uid) has fewer pods than it wants
(status.replicas, which counts the pods the controller made, ready or not); a later Event replaces
it. Kept in process memory: after an operator restart the watch lists the Events again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

FAILED_CREATE = "FailedCreate"
# kopf's watch of core/v1 Events: only these, selected by the API server (fields it indexes).
EVENT_FIELD_SELECTOR = f"involvedObject.kind=StatefulSet,reason={FAILED_CREATE}"


@dataclass(frozen=True)
class CreationFailure:
    namespace: str
    statefulset: str
    uid: Optional[str]  # the StatefulSet's: a failure of a deleted and re-made one does not count
    message: str


def creation_failure(event: Mapping[str, Any]) -> Optional[CreationFailure]:
    """Pure: the failure a core/v1 Event reports, or None when it is not a StatefulSet's FailedCreate."""
    involved = event.get("involvedObject") or {}
    if event.get("reason") != FAILED_CREATE or involved.get("kind") != "StatefulSet" or not involved.get("name"):
        return None
    namespace = involved.get("namespace") or (event.get("metadata") or {}).get("namespace") or ""
    return CreationFailure(namespace, involved["name"], involved.get("uid"), str(event.get("message") or FAILED_CREATE))


def standing_failures(
    failures: Mapping[tuple[str, str], CreationFailure], namespace: str, children: Iterable[Any]
) -> dict[str, str]:
    """Pure: role -> the controller's message, for the StatefulSets among `children`
    (status.ChildObservation) that are short of pods and have a failure on record."""
    out = {}
    for child in children:
        failure = failures.get((namespace, child.name))
        if failure is None or child.kind != "StatefulSet":
            continue
        if failure.uid and child.uid and failure.uid != child.uid:
            continue
        if child.created < child.spec_replicas:
            out[child.role] = failure.message
    return out


class CreationFailures:
    """The latest FailedCreate per StatefulSet, as the Event watch delivers them."""

    def __init__(self) -> None:
        self._by_statefulset: dict[tuple[str, str], CreationFailure] = {}

    def record(self, failure: CreationFailure) -> None:
        self._by_statefulset[(failure.namespace, failure.statefulset)] = failure

    def forget(self, namespace: str, statefulset: str) -> None:
        self._by_statefulset.pop((namespace, statefulset), None)

    def standing(self, namespace: str, children: Iterable[Any]) -> dict[str, str]:
        return standing_failures(self._by_statefulset, namespace, children)


# One per operator process, shared by every handler (status refreshes come from several).
CREATION_FAILURES = CreationFailures()
