"""The operator's own Kubernetes calls: login source, server-side apply, reads, status writes.

kopf watches and posts Events with its own client; the handlers use this thin wrapper around
kubernetes_asyncio, logged in from the same source (see `choose_login_source`), so that both
sides talk to the same cluster as the same identity.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, Union

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from dsv4_operator import spec as S
from dsv4_operator.bounded import LOG_MAX_BYTES, read_capped
from dsv4_operator.manifests import MANAGER

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
USER_AGENT = "dsv4-operator/0.1"

# The kinds the operator reads or writes, by (apiVersion, kind).
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("v1", "Secret"): "secrets",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    (S.API_VERSION, S.KIND): S.PLURAL,
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
}


def choose_login_source(kubeconfig_env: Optional[str], in_cluster: bool, home_config: bool) -> Optional[str]:
    """Where credentials come from, in the order controller-runtime uses: an explicit
    KUBECONFIG, then the pod's service account, then ~/.kube/config."""
    if kubeconfig_env:
        return "kubeconfig"
    if in_cluster:
        return "in-cluster"
    if home_config:
        return "kubeconfig"
    return None


def in_cluster_available(env: Mapping[str, str] = os.environ, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and (sa_dir / "token").is_file()


async def load_configuration(
    kubeconfig: Optional[str] = None,
    *,
    env: Mapping[str, str] = os.environ,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
    home: Optional[Path] = None,
) -> k8s.Configuration:
    """A kubernetes_asyncio Configuration from KUBECONFIG / in-cluster / ~/.kube/config."""
    kubeconfig = kubeconfig or env.get("KUBECONFIG")
    home_config = home if home is not None else Path("~/.kube/config").expanduser()
    source = choose_login_source(kubeconfig, in_cluster_available(env, sa_dir), home_config.is_file())
    cfg = k8s.Configuration()
    if source == "in-cluster":
        # The service-account token is rotated on disk; the loader re-reads it when it expires.
        k8s_config.load_incluster_config(
            client_configuration=cfg,
            try_refresh_token=True,
            token_filename=str(sa_dir / "token"),
            cert_filename=str(sa_dir / "ca.crt"),
            environ=env,
        )
    elif source == "kubeconfig":
        await k8s_config.load_kube_config(
            config_file=kubeconfig or str(home_config), client_configuration=cfg, persist_config=False
        )
    else:
        raise kopf.LoginError(
            "no Kubernetes credentials: set KUBECONFIG, run in a pod with a service account, or create ~/.kube/config"
        )
    return cfg


async def connection_info(cfg: k8s.Configuration) -> kopf.ConnectionInfo:
    """kopf's view of the same credentials."""
    header = await cfg.get_api_key_with_prefix("BearerToken") or await cfg.get_api_key_with_prefix("authorization")
    parts = header.strip().split(" ", 1) if header else []  # token files may end in a newline
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        proxy_url=cfg.proxy,
    )


def resource_path(
    api_version: str,
    plural: str,
    namespace: Optional[str] = None,
    name: Optional[str] = None,
    subresource: Optional[str] = None,
) -> str:
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def path_of(obj: Mapping[str, Any], subresource: Optional[str] = None) -> str:
    plural = PLURALS[(obj["apiVersion"], obj["kind"])]
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], plural, meta.get("namespace"), meta["name"], subresource)


@dataclass
class ApiError(Exception):
    status: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"

    @property
    def transient(self) -> bool:
        """Worth retrying as is (the spec is not the problem)."""
        return self.status in (0, 403, 409, 429) or self.status >= 500


class PatchAborted(Exception):
    """Raised by a ``patch_with_retry`` builder: what it read forbids the write (the message says why)."""


PatchBuilder = Callable[[dict], Union[Optional[Mapping[str, Any]], Awaitable[Optional[Mapping[str, Any]]]]]
PATCH_ATTEMPTS = 5


class KubeApi:
    """Server-side apply and the few reads and writes the handlers need."""

    def __init__(self, configuration: k8s.Configuration, field_manager: str = MANAGER) -> None:
        self.configuration = configuration
        self.field_manager = field_manager
        self._client = k8s.ApiClient(configuration)
        self._client.user_agent = USER_AGENT

    async def close(self) -> None:
        await self._client.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: Optional[str] = None,
        query: Sequence[tuple[str, str]] = (),
    ) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            return await self._client.call_api(
                path,
                method,
                query_params=list(query),
                header_params=headers,
                body=body,
                response_types_map={200: "object", 201: "object"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=30,
            )
        except ApiException as e:
            raise _api_error(e) from None
        except OSError as e:  # connection refused / reset: the API server is not there right now
            raise ApiError(0, "ConnectionError", str(e)) from None
        except asyncio.TimeoutError:
            raise ApiError(0, "Timeout", f"{method} {path} took longer than 30s") from None

    async def get_text(
        self, path: str, query: Sequence[tuple[str, str]] = (), timeout: float = 10, limit: int = LOG_MAX_BYTES
    ) -> str:
        """A plain-text read, e.g. pods/log (kept as text: a log line may look like JSON), of at
        most ``limit`` bytes: a longer body is cut there (a pod's log is tenant output)."""
        try:
            resp = await self._client.call_api(
                path,
                "GET",
                query_params=list(query),
                header_params={"Accept": "text/plain, */*"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
            try:
                body = await read_capped(resp, limit, truncate=True)
            finally:
                resp.release()
        except OSError as e:
            raise ApiError(0, "ConnectionError", str(e)) from None
        except asyncio.TimeoutError:
            raise ApiError(0, "Timeout", f"GET {path} took longer than {timeout}s") from None
        text = body.decode("utf-8", "replace")
        if not 200 <= resp.status <= 299:
            reason, message = "", text[:300]
            try:
                doc = json.loads(text)
                reason, message = str(doc.get("reason") or ""), str(doc.get("message") or message)
            except (ValueError, AttributeError):
                pass
            raise ApiError(resp.status, reason, message)
        return text

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates the object or makes our fields match; force takes back
        fields someone else changed (the operator owns its children)."""
        return await self.request(
            "PATCH",
            path_of(manifest),
            body=dict(manifest),
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", self.field_manager), ("force", "true")],
        )

    async def get(self, api_version: str, kind: str, namespace: Optional[str], name: str) -> Optional[dict]:
        try:
            return await self.request("GET", resource_path(api_version, PLURALS[(api_version, kind)], namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def patch_with_retry(
        self,
        api_version: str,
        kind: str,
        namespace: Optional[str],
        name: str,
        build: PatchBuilder,
        *,
        subresource: Optional[str] = None,
        attempts: int = PATCH_ATTEMPTS,
    ) -> Optional[dict]:
        """Read the object, ``build`` a merge patch from what was read, and write it with the
        resourceVersion read as a precondition; on 409 (someone wrote in between) read and build
        again. The one optimistic-concurrency loop of the operator: no write is last-writer-wins.

        ``build`` returns None when there is nothing to write (the object read is returned), or
        raises ``PatchAborted``. Returns the written object, or None when the object is gone.
        Raises ApiError 409 when it kept changing for ``attempts`` reads."""
        path = resource_path(api_version, PLURALS[(api_version, kind)], namespace, name, subresource)
        for _ in range(max(attempts, 1)):
            obj = await self.get(api_version, kind, namespace, name)
            if obj is None:
                return None
            patch = build(obj)
            if asyncio.iscoroutine(patch):
                patch = await patch
            if patch is None:
                return obj
            body = dict(patch)
            body["metadata"] = dict(body.get("metadata") or {}, resourceVersion=obj["metadata"].get("resourceVersion"))
            try:
                return await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")
            except ApiError as e:
                if e.status == 404:
                    return None
                if e.status != 409:
                    raise
        raise ApiError(
            409, "Conflict", f"{kind} {namespace}/{name} kept changing: not written after {attempts} attempts"
        )

    async def served_resources(self, group_version: str) -> Optional[list[str]]:
        """The resource names the API server serves in a group/version (None: not served)."""
        path = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        try:
            doc = await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        return [r.get("name", "") for r in (doc or {}).get("resources", [])]


def _api_error(e: ApiException) -> ApiError:
    reason, message = e.reason or "", ""
    try:
        doc = json.loads(e.body or "{}")
        reason = doc.get("reason") or reason
        message = doc.get("message") or ""
    except (ValueError, TypeError):
        message = str(e.body or "")[:300]
    return ApiError(int(e.status or 0), str(reason), message)
