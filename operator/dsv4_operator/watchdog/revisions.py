"""Spec revisions: which spec ran when, which one was stable, and what changed before a wedge.

Pure: the caller passes times and specs (plain dicts, the ``spec`` of a DSV4Deployment).  The
``remediation`` section is left out of every revision: changing how the operator heals is not a
change to what is served, and rolling back must not flip the rollback setting itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

# Not the serving part: the watchdog's and the planner's own settings (an edit there is no new revision).
IGNORED_KEYS = ("remediation", "planner")
ROLLBACK_OFF, ROLLBACK_SUGGEST, ROLLBACK_AUTO = "off", "suggest", "auto"


def serving_spec(spec: Mapping[str, Any], ignore: Iterable[str] = IGNORED_KEYS) -> dict:
    skip = set(ignore)
    return {k: copy.deepcopy(v) for k, v in spec.items() if k not in skip}


def spec_hash(spec: Mapping[str, Any], ignore: Iterable[str] = IGNORED_KEYS) -> str:
    """Stable short hash of the serving part of a spec (key order does not matter)."""
    canonical = json.dumps(serving_spec(spec, ignore), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Revision:
    hash: str
    generation: int
    applied_at: float
    spec: Mapping[str, Any]
    stable: bool = False
    stable_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hash": self.hash,
            "generation": self.generation,
            "applied_at": self.applied_at,
            "spec": self.spec,
            "stable": self.stable,
            "stable_at": self.stable_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Revision":
        return cls(
            hash=d["hash"],
            generation=int(d["generation"]),
            applied_at=float(d["applied_at"]),
            spec=d.get("spec") or {},
            stable=bool(d.get("stable")),
            stable_at=d.get("stable_at"),
        )


class RevisionTracker:
    """Revisions in the order they were applied (the newest is the one running).  A revision
    becomes stable once it has run ``quiet_period_s`` without a wedge."""

    def __init__(self, quiet_period_s: float = 600.0, max_revisions: int = 10) -> None:
        self.quiet_period_s = float(quiet_period_s)
        self.max_revisions = max(int(max_revisions), 2)
        self.revisions: list[Revision] = []
        self.last_wedge_at: float | None = None
        self.rolled_back: set[str] = set()  # bad revisions already rolled back from (once each)

    @property
    def current(self) -> Revision | None:
        return self.revisions[-1] if self.revisions else None

    @property
    def stable(self) -> Revision | None:
        for rev in reversed(self.revisions):
            if rev.stable:
                return rev
        return None

    def observe(self, generation: int, spec: Mapping[str, Any], now: float) -> Revision:
        """Record the spec seen at ``generation``; a new hash is a new revision (a spec put back
        to an earlier revision re-applies that revision, keeping its stable mark)."""
        h = spec_hash(spec)
        cur = self.current
        if cur is not None and cur.hash == h:
            return cur
        earlier = next((r for r in self.revisions if r.hash == h), None)
        self.revisions = [r for r in self.revisions if r.hash != h]
        if earlier is not None:
            rev = replace(earlier, generation=int(generation), applied_at=now)
        else:
            rev = Revision(hash=h, generation=int(generation), applied_at=now, spec=serving_spec(spec))
        self.revisions.append(rev)
        self._trim()
        return rev

    def _trim(self) -> None:
        # Keep the newest revisions, and always the latest stable one (the rollback target).
        while len(self.revisions) > self.max_revisions:
            stable = self.stable
            victim = next(r for r in self.revisions if r is not stable)
            self.revisions.remove(victim)

    def note_wedge(self, now: float) -> None:
        self.last_wedge_at = now if self.last_wedge_at is None else max(self.last_wedge_at, now)

    def tick(self, now: float) -> Revision | None:
        """Mark the running revision stable when it has been quiet long enough; returns it when
        it just became stable."""
        cur = self.current
        if cur is None or cur.stable:
            return None
        quiet_since = max(cur.applied_at, self.last_wedge_at or cur.applied_at)
        if now - quiet_since < self.quiet_period_s:
            return None
        cur = replace(cur, stable=True, stable_at=now)
        self.revisions[-1] = cur
        return cur

    def mark_rolled_back(self, revision_hash: str) -> None:
        self.rolled_back.add(revision_hash)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quiet_period_s": self.quiet_period_s,
            "max_revisions": self.max_revisions,
            "revisions": [r.to_dict() for r in self.revisions],
            "last_wedge_at": self.last_wedge_at,
            "rolled_back": sorted(self.rolled_back),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, **overrides: Any) -> "RevisionTracker":
        d = d or {}
        tracker = cls(
            quiet_period_s=overrides.get("quiet_period_s", d.get("quiet_period_s", 600.0)),
            max_revisions=overrides.get("max_revisions", d.get("max_revisions", 10)),
        )
        tracker.revisions = [Revision.from_dict(r) for r in d.get("revisions") or ()]
        tracker.last_wedge_at = d.get("last_wedge_at")
        tracker.rolled_back = set(d.get("rolled_back") or ())
        return tracker


# --- naming a change in words ------------------------------------------------------------------


def _show(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Env names whose values are credentials: never written into a diff (events, status and evidence
# ConfigMaps are readable by the namespace's viewers).
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|PASSWD|CREDENTIAL|API_?KEY|PRIVATE|AUTH", re.I)
REDACTED = "<redacted>"


def _show_env(name: str, value: Any) -> str:
    return REDACTED if _SECRET_NAME.search(name) and not isinstance(value, Mapping) else _show(value)


def _env_map(value: Any) -> dict[str, Any] | None:
    """Kubernetes env list ([{name, value|valueFrom}]) or a plain {NAME: value} map."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, list) and all(isinstance(i, Mapping) and "name" in i for i in value):
        return {i["name"]: i.get("value", i.get("valueFrom")) for i in value}
    return None


def _named_items(value: Any) -> dict[str, Any] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, Mapping) and isinstance(i.get("name"), str) for i in value)
    ):
        names = [i["name"] for i in value]
        if len(set(names)) == len(names):
            return {i["name"]: i for i in value}
    return None


def _describe(path: str, old: Any, new: Any, out: list[str]) -> None:
    if old == new:
        return
    leaf = path.rsplit(".", 1)[-1]
    if leaf == "env":
        a, b = _env_map(old), _env_map(new)
        if a is not None and b is not None:
            for name in sorted(set(a) | set(b)):
                if name not in a:
                    out.append(f"{path} {name} added (={_show_env(name, b[name])})")
                elif name not in b:
                    out.append(f"{path} {name} removed (was {_show_env(name, a[name])})")
                elif a[name] != b[name]:
                    out.append(f"{path} {name} changed from {_show_env(name, a[name])} to {_show_env(name, b[name])}")
            return
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old:
                out.append(f"{sub} added (={_show(new[key])})")
            elif key not in new:
                out.append(f"{sub} removed (was {_show(old[key])})")
            else:
                _describe(sub, old[key], new[key], out)
        return
    a, b = _named_items(old), _named_items(new)
    if a is not None and b is not None:
        for name in sorted(set(a) | set(b)):
            sub = f"{path}[{name}]"
            if name not in a:
                out.append(f"{sub} added")
            elif name not in b:
                out.append(f"{sub} removed")
            else:
                _describe(sub, a[name], b[name], out)
        return
    if old is None:
        out.append(f"{path} added (={_show(new)})")
    elif new is None:
        out.append(f"{path} removed (was {_show(old)})")
    else:
        out.append(f"{path} changed from {_show(old)} to {_show(new)}")


def describe_change(old_spec: Mapping[str, Any] | None, new_spec: Mapping[str, Any] | None) -> list[str]:
    """The differences between two specs, one short sentence each, in path order."""
    out: list[str] = []
    _describe("", dict(old_spec or {}), dict(new_spec or {}), out)
    return out


# --- a wedge right after a change --------------------------------------------------------------


@dataclass(frozen=True)
class SuspectChange:
    revision: str
    generation: int
    applied_at: float
    seconds_after: float
    baseline: str  # the revision it replaced
    changes: tuple[str, ...]
    stable_revision: str | None = None
    changes_since_stable: tuple[str, ...] = ()

    def summary(self, limit: int = 3) -> str:
        shown = "; ".join(self.changes[:limit]) or "no serving change"
        more = f" (+{len(self.changes) - limit} more)" if len(self.changes) > limit else ""
        return (
            f"wedges began {self.seconds_after:.0f}s after generation {self.generation} "
            f"(revision {self.revision}): {shown}{more}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["changes"] = list(self.changes)
        d["changes_since_stable"] = list(self.changes_since_stable)
        return d


def correlate(wedge_time: float, revisions: Sequence[Revision], within_s: float = 3600.0) -> SuspectChange | None:
    """The spec change that wedges starting at ``wedge_time`` most likely follow: the revision
    running then, if it was applied at most ``within_s`` earlier, replaced another, and had not
    yet proven itself stable."""
    ordered = sorted(revisions, key=lambda r: r.applied_at)
    running_idx = None
    for i, rev in enumerate(ordered):
        if rev.applied_at <= wedge_time:
            running_idx = i
    if running_idx is None or running_idx == 0:
        return None
    rev = ordered[running_idx]
    if rev.stable or wedge_time - rev.applied_at > within_s:
        return None
    baseline = ordered[running_idx - 1]
    stable = next((r for r in reversed(ordered[:running_idx]) if r.stable), None)
    return SuspectChange(
        revision=rev.hash,
        generation=rev.generation,
        applied_at=rev.applied_at,
        seconds_after=wedge_time - rev.applied_at,
        baseline=baseline.hash,
        changes=tuple(describe_change(baseline.spec, rev.spec)),
        stable_revision=stable.hash if stable else None,
        changes_since_stable=tuple(describe_change(stable.spec, rev.spec)) if stable else (),
    )


# --- rolling back ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RollbackDecision:
    action: str  # "none" | "suggest" | "pin"
    message: str
    from_revision: str | None = None
    to_revision: str | None = None


def decide_rollback(
    mode: str,
    suspect: SuspectChange | None,
    stable: Revision | None,
    current_spec: Mapping[str, Any],
    rolled_back: Iterable[str],
) -> RollbackDecision:
    """off: nothing; suggest: name the revision to go back to; auto: pin the stable revision
    (the children are built from it; the spec is left as written), at most once per bad
    revision, and only while that revision is still the running one (a newer edit means a
    person is already changing things)."""
    if mode == ROLLBACK_OFF or suspect is None:
        return RollbackDecision("none", "no rollback: " + ("disabled" if mode == ROLLBACK_OFF else "no suspect change"))
    if stable is None or stable.hash == suspect.revision:
        return RollbackDecision("none", "no rollback: no earlier stable revision", from_revision=suspect.revision)
    target = f"stable revision {stable.hash} (generation {stable.generation})"
    if mode == ROLLBACK_SUGGEST:
        return RollbackDecision("suggest", f"suggest rolling back to {target}", suspect.revision, stable.hash)
    if mode != ROLLBACK_AUTO:
        raise ValueError(f"unknown rollback mode {mode!r}")
    if suspect.revision in set(rolled_back):
        return RollbackDecision(
            "suggest",
            f"already rolled back from {suspect.revision} once; suggest rolling back to {target}",
            suspect.revision,
            stable.hash,
        )
    if spec_hash(current_spec) != suspect.revision:
        return RollbackDecision(
            "suggest",
            f"spec changed since revision {suspect.revision}; suggest rolling back to {target}",
            suspect.revision,
            stable.hash,
        )
    return RollbackDecision("pin", f"rolling back to {target}", suspect.revision, stable.hash)
