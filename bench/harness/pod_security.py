"""Pod Security admission for the test API server (kmock_cluster): the Pod Security Standards'
checks that matter to the pods the operator builds, as the API server's PodSecurity plugin makes
them for a namespace labelled `pod-security.kubernetes.io/enforce: baseline|restricted`.

Written from the Pod Security Standards' text (kubernetes.io/docs/concepts/security/
pod-security-standards), independently of the operator, so that a mistake in the operator's
security contexts is not mirrored here. Messages have the API server's shape:
`violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false (container "engine"
must set securityContext.allowPrivilegeEscalation=false), ...`.

Not modelled (the operator sets none of them): AppArmor, SELinux options, /proc mount type,
sysctls, Windows host process; `enforce-version` (every level is `latest`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")

# Capabilities a container may add under baseline (the container runtime's defaults).
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# Volume types restricted admits; everything else (hostPath, nfs, ...) is refused. `image` joins
# them with the ImageVolume feature (an image is read-only and carries no host access).
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
        "image",
    }
)


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or []), *(pod.get("ephemeralContainers") or [])]


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _baseline(pod: Mapping[str, Any]) -> list[str]:
    out = []
    host = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    if host:
        out.append(f"host namespaces ({', '.join(host)})")
    privileged = [c.get("name", "") for c in _containers(pod) if ((c.get("securityContext") or {}).get("privileged"))]
    if privileged:
        out.append(
            f"privileged (container{'s' if len(privileged) > 1 else ''} {_quoted(privileged)} must not set "
            "securityContext.privileged=true)"
        )
    for c in _containers(pod):
        added = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        extra = [cap for cap in added if cap not in BASELINE_CAPABILITIES]
        if extra:
            out.append(
                f'non-default capabilities (container "{c.get("name", "")}" must not include '
                f"{_quoted(extra)} in securityContext.capabilities.add)"
            )
    host_paths = [v.get("name", "") for v in pod.get("volumes") or [] if "hostPath" in v]
    if host_paths:
        out.append(f"hostPath volumes (volume{'s' if len(host_paths) > 1 else ''} {_quoted(host_paths)})")
    for c in _containers(pod):
        ports = [str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")]
        if ports:
            out.append(f'hostPort (container "{c.get("name", "")}" uses hostPort {", ".join(ports)})')
    return out


def _restricted(pod: Mapping[str, Any]) -> list[str]:
    out = []
    pod_sc = pod.get("securityContext") or {}
    for v in pod.get("volumes") or []:
        kinds = [k for k in v if k != "name" and k not in RESTRICTED_VOLUMES]
        if kinds:
            out.append(
                f'restricted volume types (volume "{v.get("name", "")}" uses restricted volume type "{kinds[0]}")'
            )
    containers = _containers(pod)
    escalating = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False
    ]
    if escalating:
        out.append(
            f"allowPrivilegeEscalation != false (container{'s' if len(escalating) > 1 else ''} "
            f"{_quoted(escalating)} must set securityContext.allowPrivilegeEscalation=false)"
        )
    for c in containers:
        caps = (c.get("securityContext") or {}).get("capabilities") or {}
        added = [cap for cap in caps.get("add") or [] if cap != "NET_BIND_SERVICE"]
        if "ALL" not in (caps.get("drop") or []):
            out.append(
                f'unrestricted capabilities (container "{c.get("name", "")}" must set '
                'securityContext.capabilities.drop=["ALL"])'
            )
        if added:
            out.append(
                f'unrestricted capabilities (container "{c.get("name", "")}" must not include '
                f"{_quoted(added)} in securityContext.capabilities.add)"
            )
    non_root = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True
    ]
    if non_root:
        out.append(
            f"runAsNonRoot != true (pod or container{'s' if len(non_root) > 1 else ''} {_quoted(non_root)} "
            "must set securityContext.runAsNonRoot=true)"
        )
    as_root = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("runAsUser", pod_sc.get("runAsUser")) == 0
    ]
    if as_root:
        out.append(f"runAsUser=0 (pod or container {_quoted(as_root)} must not set runAsUser=0)")
    unconfined = [
        c.get("name", "")
        for c in containers
        if (
            ((c.get("securityContext") or {}).get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
            not in ("RuntimeDefault", "Localhost")
        )
    ]
    if unconfined:
        out.append(
            f"seccompProfile (pod or container{'s' if len(unconfined) > 1 else ''} {_quoted(unconfined)} "
            'must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")'
        )
    return out


def violations(pod: Mapping[str, Any], level: Optional[str]) -> list[str]:
    """Pure: what a pod spec breaks at a Pod Security level (none for privileged or no label)."""
    if level not in ("baseline", "restricted"):
        return []
    found = _baseline(pod)
    if level == "restricted":
        found += _restricted(pod)
    return found


def forbidden_message(pod_name: str, level: str, found: list[str]) -> str:
    return f'pods "{pod_name}" is forbidden: violates PodSecurity "{level}:latest": {", ".join(found)}'
