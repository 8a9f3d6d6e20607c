"""What a DSV4Deployment may ask for on a shared cluster (issue 27): creating one creates pods,
so whoever may create one could otherwise run any image, mount any host path, tolerate any
taint (control-plane nodes included), read any Secret of the namespace through env, and run as
root. The cluster operator sets the allowlists (the chart's ``tenantPolicy`` values, handed to
the operator as JSON in DSV4_TENANT_POLICY); the operator refuses a spec outside them at
reconcile, with the reason in status, as it refuses any spec it cannot build.

Without the variable (``dsv4 operator`` run by hand, the tests) nothing is restricted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from dsv4_operator.spec import DSV4DeploymentSpec
from dsv4_wire import switches

POLICY_ENV = "DSV4_TENANT_POLICY"


@dataclass(frozen=True)
class TenantPolicy:
    image_registries: Optional[tuple[str, ...]] = None  # image prefixes allowed (None: any)
    allow_host_path: bool = True
    toleration_keys: Optional[tuple[str, ...]] = None  # taint keys a role may tolerate (None: any)
    allow_secret_env: bool = True  # env valueFrom.secretKeyRef
    allow_root: bool = True  # pods whose image runs as root (engine.kind sglang without runAsUser)
    secret_names: Optional[tuple[str, ...]] = None  # Secrets security.secretName may name (None: any)
    pvc_names: Optional[tuple[str, ...]] = None  # PVCs model.volume may mount (None: any)

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any]) -> "TenantPolicy":
        def names(key: str) -> Optional[tuple[str, ...]]:
            v = doc.get(key)
            return None if v is None else tuple(str(x) for x in v)

        return cls(
            image_registries=names("imageRegistries"),
            allow_host_path=bool(doc.get("allowHostPath", True)),
            toleration_keys=names("tolerationKeys"),
            allow_secret_env=bool(doc.get("allowSecretEnv", True)),
            allow_root=bool(doc.get("allowRoot", True)),
            secret_names=names("secretNames"),
            pvc_names=names("pvcNames"),
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "TenantPolicy":
        raw = switches.read(POLICY_ENV, env)
        if not raw:
            return cls()
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{POLICY_ENV} is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{POLICY_ENV} must be a JSON object")
        return cls.from_mapping(doc)


def _registry_ok(image: str, prefixes: tuple[str, ...]) -> bool:
    # "registry.example.com/team" allows "registry.example.com/team/x:1", not ".../teamx"
    return any(
        image == p or image.startswith(p.rstrip("/") + "/") or image.startswith(p.rstrip("/") + "@") for p in prefixes
    )


def policy_violations(spec: DSV4DeploymentSpec, policy: TenantPolicy) -> list[str]:
    """What in the spec the policy does not allow, one line each (empty: allowed). Pure."""
    out: list[str] = []
    if policy.image_registries is not None:
        images = {"spec.engine.image": spec.engine.image}
        if spec.router.image:
            images["spec.router.image"] = spec.router.image
        vol = spec.model.volume
        if vol is not None and vol.image is not None:
            images["spec.model.volume.image.reference"] = vol.image.reference
        for where, image in images.items():
            if not _registry_ok(image, policy.image_registries):
                out.append(
                    f"{where} {image!r} is not from an allowed registry ({', '.join(policy.image_registries) or 'none'})"
                )
    if not policy.allow_host_path and spec.model.volume is not None and spec.model.volume.host_path is not None:
        out.append("spec.model.volume.hostPath is not allowed on this cluster (use a PVC or an image volume)")
    if policy.toleration_keys is not None:
        for role in ("prefill", "decode"):
            for t in getattr(spec, role).tolerations:
                if not t.key:
                    out.append(
                        f"spec.{role}.tolerations: a toleration without a key tolerates every taint; not allowed"
                    )
                elif t.key not in policy.toleration_keys:
                    out.append(
                        f"spec.{role}.tolerations: taint key {t.key!r} is not allowed "
                        f"({', '.join(policy.toleration_keys) or 'none'})"
                    )
    if not policy.allow_secret_env:
        groups = {
            "engine": spec.engine.env,
            "transfer": spec.transfer.env,
            "router": spec.router.env,
            "prefill": spec.prefill.env,
            "decode": spec.decode.env,
        }
        for where, envs in groups.items():
            for e in envs:
                if e.value_from and "secretKeyRef" in e.value_from:
                    out.append(f"spec.{where}.env {e.name}: valueFrom.secretKeyRef is not allowed on this cluster")
    if not policy.allow_root and spec.engine.kind != "builtin" and spec.security.run_as_user is None:
        out.append(
            f"engine.kind {spec.engine.kind} runs as root unless spec.security.runAsUser is set; "
            "root is not allowed on this cluster"
        )
    name = spec.security.secret_name
    if policy.secret_names is not None and name is not None and name not in policy.secret_names:
        out.append(
            f"spec.security.secretName {name!r} is not allowed ({', '.join(policy.secret_names) or 'none'}): "
            "another deployment's Secret holds its tokens"
        )
    pvc = spec.model.volume.persistent_volume_claim if spec.model.volume is not None else None
    if policy.pvc_names is not None and pvc is not None and pvc.claim_name not in policy.pvc_names:
        out.append(
            f"spec.model.volume.persistentVolumeClaim {pvc.claim_name!r} is not allowed "
            f"({', '.join(policy.pvc_names) or 'none'}): another team's checkpoint may be on it"
        )
    return out
