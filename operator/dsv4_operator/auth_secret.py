"""A deployment's auth Secret (admin token, PD secret, router admin token) with as little Secret
access as the operator can have: `create`, and `get` of the one Secret a deployment names.

The values of a Secret the operator makes are derived, HMAC-SHA256(operator key, uid/key), from
an operator key (the chart's Secret, mounted as a file) and the deployment's uid: the reconciler
and the watchdog daemon, or two operator replicas, racing to create it write the same values,
and the operator never patches a Secret. A Secret that exists already is used only when it is
created for this deployment (an owner reference to it), or the user's and given to this
deployment by name (the operator's managed-by label and the annotation serving.dsv4.dev/deployment
naming the deployment). A Secret owned by another DSV4Deployment is never used (issue 39: one
deployment naming another's Secret would get its admin token, PD secret and router token).
Otherwise, or when it cannot be used (a value that is not text, a key missing), the deployment's
status says so (Degraded, reason SecretOfAnotherDeployment, SecretNotOwned or SecretUnusable)
and nothing is written to it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from typing import Any, Mapping, Optional

from dsv4_operator.kube import ApiError, KubeApi, resource_path
from dsv4_operator.manifests import (
    AUTH_SECRET_KEYS,
    LABEL_MANAGED_BY,
    ANNOTATION_SECRET_FOR,
    MANAGER,
    Owner,
    auth_secret,
    auth_secret_name,
)
from dsv4_operator.spec import KIND, DSV4DeploymentSpec
from dsv4_wire import switches

log = logging.getLogger("dsv4.operator.auth")

OPERATOR_KEY_ENV = "DSV4_OPERATOR_KEY"
OPERATOR_KEY_FILE_ENV = "DSV4_OPERATOR_KEY_FILE"
SECRET_NOT_OWNED = "SecretNotOwned"
SECRET_UNUSABLE = "SecretUnusable"
SECRET_OF_ANOTHER = "SecretOfAnotherDeployment"
REASONS = (SECRET_OF_ANOTHER, SECRET_NOT_OWNED, SECRET_UNUSABLE)
SECRET_RECHECK_SECONDS = 10.0  # a refused Secret is looked at again this often (Secrets are not watched)

_process_key: Optional[bytes] = None


class AuthSecretRefused(Exception):
    """The Secret a deployment names cannot be used; `reason` is the status condition's."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def operator_key(environ: Mapping[str, str] = os.environ) -> bytes:
    """The key deployments' tokens are derived from: the file DSV4_OPERATOR_KEY_FILE names (the
    chart mounts its Secret there), else DSV4_OPERATOR_KEY. Without either (a local run), a key
    for this process only: Secrets it creates keep their values, but a later operator derives
    other ones (harmless, since existing Secrets are read, never re-derived)."""
    global _process_key
    path = switches.read(OPERATOR_KEY_FILE_ENV, environ)
    if path:
        with open(path, "rb") as f:
            key = f.read().strip()
        if key:
            return key
    if switches.read(OPERATOR_KEY_ENV, environ):
        return switches.read(OPERATOR_KEY_ENV, environ).encode()
    if _process_key is None:
        log.warning(
            "No operator key (%s / %s): deriving deployments' tokens from a key of this process only",
            OPERATOR_KEY_FILE_ENV,
            OPERATOR_KEY_ENV,
        )
        _process_key = secrets.token_bytes(32)
    return _process_key


def derived_values(key: bytes, uid: str) -> dict[str, str]:
    """Pure: one token per key of the auth Secret, from the operator key and the deployment's uid
    (a deployment deleted and made again has a new uid, hence new tokens)."""
    out = {}
    for name in AUTH_SECRET_KEYS:
        digest = hmac.new(key, f"dsv4-auth/{uid}/{name}".encode(), hashlib.sha256).digest()
        out[name] = base64.urlsafe_b64encode(digest).decode().rstrip("=")
    return out


def usable_values(live: Mapping[str, Any], owner: Owner) -> dict[str, str]:
    """Pure: the values of an existing Secret, or AuthSecretRefused saying why it cannot be used."""
    meta = live.get("metadata") or {}
    where = f"Secret {owner.namespace}/{meta.get('name')}"
    refs = meta.get("ownerReferences") or []
    created_for_us = any(ref.get("uid") == owner.uid for ref in refs)
    others = [r for r in refs if r.get("kind") == KIND and r.get("uid") != owner.uid]
    if others and not created_for_us:  # another deployment's tokens: never handed to this one
        raise AuthSecretRefused(
            f"{where} belongs to DSV4Deployment {others[0].get('name')!r}, not to {owner.name!r}: name a Secret "
            "of this deployment's own (or none, and the operator creates one); nothing was applied",
            SECRET_OF_ANOTHER,
        )
    given = (meta.get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGER and (meta.get("annotations") or {}).get(
        ANNOTATION_SECRET_FOR
    ) == owner.name
    if not (created_for_us or given):  # any Secret of the namespace could be named: use only those given to us
        raise AuthSecretRefused(
            f"{where} is not the operator's for this deployment: label it {LABEL_MANAGED_BY}={MANAGER} and "
            f"annotate it {ANNOTATION_SECRET_FOR}={owner.name} to let this deployment use it "
            "(or name no secret and let the operator create one); nothing was applied",
            SECRET_NOT_OWNED,
        )
    try:
        data = {k: base64.b64decode(v, validate=True).decode() for k, v in (live.get("data") or {}).items()}
    except ValueError:  # UnicodeDecodeError, bad base64
        raise AuthSecretRefused(
            f"{where} holds a value that is not UTF-8 text; nothing was applied", SECRET_UNUSABLE
        ) from None
    missing = [k for k in AUTH_SECRET_KEYS if not data.get(k)]
    if missing:  # the operator does not patch Secrets: the user adds them (or deletes an old one of ours)
        raise AuthSecretRefused(
            f"{where} lacks the keys {', '.join(missing)}: add them (the operator writes no Secret it did not "
            "just create), or delete the Secret if the operator made it, and it is made again; nothing was applied",
            SECRET_UNUSABLE,
        )
    return data


async def ensure_auth_secret(
    api: KubeApi, spec: DSV4DeploymentSpec, owner: Owner, key: Optional[bytes] = None
) -> dict[str, str]:
    """The deployment's tokens: its Secret created with derived values when absent (create), else
    read (get) and used if it is the operator's. Returns {key: value}; AuthSecretRefused when the
    Secret exists and cannot be used."""
    name = auth_secret_name(spec, owner.name)
    values = derived_values(key if key is not None else operator_key(), owner.uid)
    try:
        await api.request(
            "POST", resource_path("v1", "secrets", owner.namespace), body=auth_secret(spec, owner, values)
        )
        return values
    except ApiError as e:
        if e.status != 409:
            raise
    live = await api.get("v1", "Secret", owner.namespace, name)
    if live is None:  # deleted between the two calls: the next reconcile makes it
        raise ApiError(409, "Conflict", f"the Secret {owner.namespace}/{name} went away while it was read")
    return usable_values(live, owner)
