"""Leader election on a coordination.k8s.io/v1 Lease, so that the chart can run two replicas and
only one acts.

Why not kopf peering: kopf's peering (KopfPeering objects) pauses an operator only for a peer of
*higher* priority; peers of the same priority both keep running, with a warning (kopf 1.45
`_core/engines/peering.py`: "Possibly conflicting operators with the same priority"), and its
keep-alives are plain patches without a precondition. Two replicas of one Deployment have the
same priority, so peering would let both remediate. A Lease written with a resourceVersion
precondition has one holder at a time, as controller-runtime and client-go do it.

The rules (client-go's, in a few lines):
* a candidate takes the Lease when it is free or its holder has not renewed it for
  ``lease_s`` *as observed on the candidate's own clock* (the time the candidate first saw the
  current renewTime, not the renewTime itself: no trust in the other node's clock);
* the holder renews every ``retry_s``; every write (a merge patch: RBAC verbs get, create, patch)
  names the resourceVersion it read, so of two racing candidates one gets 409 and stays one;
* the holder counts itself leader only until ``renew_deadline_s`` (< ``lease_s``) after its last
  successful renewal began: a partitioned holder stops acting before anyone else may take over;
* on a clean stop the holder releases the Lease (holder cleared) so the standby takes over at once.

``decide`` is pure; ``LeaderElector`` is the thin I/O shell over ``KubeApi``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from dsv4_operator.kube import ApiError, KubeApi, resource_path

log = logging.getLogger("dsv4.leader")

LEASE_API = "coordination.k8s.io/v1"
DEFAULT_LEASE_NAME = "dsv4-operator"
ACQUIRE, RENEW, WAIT = "acquire", "renew", "wait"


@dataclass(frozen=True)
class LeaderElection:
    """Where the Lease lives and how long a leadership lasts (client-go's defaults)."""

    namespace: str
    name: str = DEFAULT_LEASE_NAME
    identity: str = ""
    lease_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError("leader election wants 0 < retry < renew deadline < lease duration")


def default_identity() -> str:
    """The pod name (hostname) plus a random part: a restarted container is a new candidate."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def lease_namespace(
    env: Mapping[str, str] = os.environ,
    sa_namespace_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
) -> str:
    """POD_NAMESPACE (the chart sets it from the downward API), else the service account's
    namespace, else "default"."""
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        with open(sa_namespace_file) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


# ---- pure -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseView:
    holder: Optional[str]
    renew_time: Optional[str]  # as written, compared for change only (never against our clock)
    transitions: int = 0
    acquire_time: Optional[str] = None

    @classmethod
    def of(cls, lease: Optional[Mapping[str, Any]]) -> "LeaseView":
        spec = (lease or {}).get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or None,
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
            acquire_time=spec.get("acquireTime"),
        )


def decide(view: LeaseView, identity: str, observed_at: Optional[float], now: float, lease_s: float) -> str:
    """What a candidate does with the Lease it read. ``observed_at``: when (on our clock) we first
    saw this holder with this renewTime; None if we never saw it before."""
    if view.holder == identity:
        return RENEW
    if view.holder is None:
        return ACQUIRE
    if observed_at is not None and now - observed_at >= lease_s:
        return ACQUIRE  # the holder stopped renewing for a whole lease duration
    return WAIT


def micro_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(view: LeaseView, identity: str, action: str, wall: float, lease_s: float) -> dict[str, Any]:
    now = micro_time(wall)
    taking = action == ACQUIRE
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": max(int(round(lease_s)), 1),
        "acquireTime": now if taking else (view.acquire_time or now),
        "renewTime": now,
        "leaseTransitions": view.transitions + (1 if taking and view.holder not in (None, identity) else 0),
    }


# ---- I/O --------------------------------------------------------------------------------------


class LeaderElector:
    def __init__(
        self,
        api: Callable[[], KubeApi],
        config: LeaderElection,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api, self.config = api, config
        self.identity = config.identity or default_identity()
        self.clock, self.wall = clock, wall
        self._valid_until: Optional[float] = None
        self._seen: Optional[tuple[Optional[str], Optional[str]]] = None
        self._seen_at: Optional[float] = None
        self.transitions = 0  # how often this elector became leader

    @property
    def path(self) -> str:
        return resource_path(LEASE_API, "leases", self.config.namespace)

    def is_leader(self) -> bool:
        """True only within the renew deadline of the last successful renewal: a holder cut off
        from the API server stops acting before any other candidate may take the Lease."""
        return self._valid_until is not None and self.clock() < self._valid_until

    async def try_once(self) -> bool:
        """Read the Lease and take or renew it if the rules allow; returns whether we lead."""
        started = self.clock()
        api = self.api()
        try:
            lease = await api.request("GET", f"{self.path}/{self.config.name}")
        except ApiError as e:
            if e.status != 404:
                raise
            lease = None
        view = LeaseView.of(lease)
        key = (view.holder, view.renew_time)
        if key != self._seen:
            self._seen, self._seen_at = key, started
        action = decide(view, self.identity, self._seen_at if lease is not None else None, started, self.config.lease_s)
        if action == WAIT:
            self._valid_until = None  # someone else holds it (or took it over)
            return False
        spec = lease_spec(view, self.identity, action, self.wall(), self.config.lease_s)
        try:
            if lease is None:
                await api.request(
                    "POST",
                    self.path,
                    content_type="application/json",
                    body={
                        "apiVersion": LEASE_API,
                        "kind": "Lease",
                        "metadata": {"name": self.config.name, "namespace": self.config.namespace},
                        "spec": spec,
                    },
                )
            else:
                await self._patch(api, lease, spec)
        except ApiError as e:
            if e.status == 409:  # another candidate wrote first
                return False
            raise
        if not self.is_leader():
            self.transitions += 1
            log.info(f"{self.identity} now leads ({self.config.namespace}/{self.config.name})")
        self._valid_until = started + self.config.renew_deadline_s
        return True

    async def _patch(self, api: KubeApi, lease: Mapping[str, Any], spec: Mapping[str, Any]) -> None:
        """A merge patch naming the resourceVersion read: of two writers racing, one gets 409."""
        await api.request(
            "PATCH",
            f"{self.path}/{self.config.name}",
            content_type="application/merge-patch+json",
            body={"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": dict(spec)},
        )

    async def _attempt(self) -> bool:
        try:
            return await self.try_once()
        except ApiError as e:
            log.warning(f"Lease {self.config.namespace}/{self.config.name}: {e}")
            return False

    async def acquire(self, stopping: Callable[[], bool]) -> bool:
        """Wait until this candidate leads (True) or ``stopping()`` (False)."""
        while not stopping():
            if await self._attempt():
                return True
            await asyncio.sleep(self.config.retry_s)
        return False

    async def hold(self, stopping: Callable[[], bool]) -> bool:
        """Renew until ``stopping()`` (True) or the renew deadline passes without a renewal
        (False: leadership lost)."""
        while not stopping():
            await self._attempt()
            if not self.is_leader():
                log.error(f"{self.identity} lost the Lease {self.config.namespace}/{self.config.name}")
                return False
            await asyncio.sleep(min(self.config.retry_s, max(self._valid_until - self.clock(), 0.0)))
        return True

    async def release(self) -> None:
        """Give the Lease up on a clean stop, so that a standby takes over without waiting."""
        if not self.is_leader():
            return
        self._valid_until = None
        try:
            lease = await self.api().request("GET", f"{self.path}/{self.config.name}")
            if LeaseView.of(lease).holder != self.identity:
                return
            await self._patch(self.api(), lease, {"holderIdentity": None, "leaseDurationSeconds": 1})
        except ApiError as e:
            log.warning(f"Lease not released ({e}); the standby takes over after it expires")
