"""The routers hold new requests while a one-replica engine role rolls (issue 45).

A StatefulSet has no surge: rolling a role with one replica deletes its only pod and makes a new
one, and for as long as the new engine loads there is no prefill/decode pair. The routers then
hold new requests instead of answering 503 (router hold.py) -- for --engine-wait-timeout by
themselves, and for as long as the roll lasts when told: each tick of the canary daemon that
sees such a roll renews a short lease on every ready router pod (POST /admin/hold); once the roll
is over the lease lapses by itself, so an operator that stops never leaves routers holding.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import httpx

from dsv4_wire import Paths, authorization_header

LEASE_S = 30.0  # renewed every tick (1 s) while the roll lasts


def rolling_alone(sts: Optional[Mapping[str, Any]]) -> bool:
    """Pure: the StatefulSet has one replica and is rolling it to a new template: its controller says
    the pod's revision (current) is not the template's (update) yet. A set that never ran (no
    current revision) is starting, not rolling: nothing served before, nothing to hold for."""
    if not sts:
        return False
    spec, status = sts.get("spec") or {}, sts.get("status") or {}
    if int(spec.get("replicas") if spec.get("replicas") is not None else 1) != 1:
        return False
    current, update = status.get("currentRevision"), status.get("updateRevision")
    return bool(current and update and current != update)


def hold_reason(statefulsets: Mapping[str, Optional[Mapping[str, Any]]]) -> Optional[str]:
    """Pure: why the routers should hold now (the roles whose only replica rolls), or None."""
    roles = sorted(role for role, sts in statefulsets.items() if rolling_alone(sts))
    if not roles:
        return None
    return "rollout of " + " and ".join(roles) + ": the only replica restarts on the new template"


async def renew_hold(routers: list[str], token: Optional[str], reason: str, logger: Any) -> None:
    """One lease on every router; a router that does not take it holds for its own
    --engine-wait-timeout still."""
    async with httpx.AsyncClient(timeout=3.0, headers=authorization_header(token)) as client:
        for router in routers:
            try:
                r = await client.post(router + Paths.ADMIN_HOLD, json={"seconds": LEASE_S, "reason": reason})
                if r.status_code >= 400:
                    logger.warning(f"router {router} refused the hold: {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                logger.warning(f"router {router} did not take the hold: {e}")
