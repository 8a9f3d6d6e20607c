"""The operator's kopf registry and what every handler shares: the DSV4Deployment resource (`CR`),
the labels of its children, the handlers' memo (metrics, the API client), the start-up, login
and clean-up activities, and the indexes of the children kopf keeps current from its watches.
The handlers register on `registry` from their modules (`apply`, `children`, `watchdog_daemon`;
`dsv4_operator.rollout` for the canary), which `dsv4_operator.main` imports and runs.
"""

from __future__ import annotations

from typing import Any, Optional

import kopf

from dsv4_operator import spec as S
from dsv4_operator.kube import ApiError, KubeApi, connection_info, load_configuration
from dsv4_operator.manifests import (
    APP,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGER,
)
from dsv4_operator.status import (
    ChildObservation,
    observe,
)
from dsv4_operator.telemetry import OperatorMetrics

registry = kopf.OperatorRegistry()

CR = (S.GROUP, S.VERSION, S.PLURAL)
CHILD_LABELS = {LABEL_NAME: APP, LABEL_MANAGED_BY: MANAGER}


def _metrics(memo: kopf.Memo) -> OperatorMetrics:
    if getattr(memo, "metrics", None) is None:
        memo.metrics = OperatorMetrics()
    return memo.metrics


def _api(memo: kopf.Memo) -> KubeApi:
    api = getattr(memo, "api", None)
    if api is None:
        raise kopf.TemporaryError("not logged in to the API server yet", delay=2)
    return api


def _children(namespace: str, name: str, *indices: Any) -> list[ChildObservation]:
    found: list[ChildObservation] = []
    for index in indices:
        found.extend(obs for obs in index.get((namespace, name), []) if obs is not None)
    return found


# ---- Activities ------------------------------------------------------------------------------


@kopf.on.startup(registry=registry)
async def check_crd_installed(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Fail fast, with one clear line, when the CRD is missing: with CRD scanning off, the
    operator would otherwise run and serve nothing."""
    _metrics(memo)
    # Shared by every handler (kopf gives each object a shallow copy of this memo): workload
    # generations our own writes produced, so that their watch events are not taken for drift.
    memo.setdefault("child_generations", {})
    api = KubeApi(await load_configuration(getattr(memo, "kubeconfig", None)))
    try:
        served = await api.served_resources(S.API_VERSION)
    except ApiError as e:
        raise kopf.PermanentError(f"cannot reach the Kubernetes API: {e}") from None
    finally:
        await api.close()
    if not served or S.PLURAL not in served:
        raise kopf.PermanentError(
            f"the CRD {S.PLURAL}.{S.GROUP} ({S.API_VERSION}) is not installed; apply crds/dsv4deployment.yaml first"
        )
    logger.info(f"{S.KIND} ({S.API_VERSION}) is served by the API server.")


@kopf.on.login(registry=registry)
async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """KUBECONFIG, else the pod's service account, else ~/.kube/config — for kopf and for the
    handlers' own client alike. Called again by kopf when the credentials stop working."""
    cfg = await load_configuration(getattr(memo, "kubeconfig", None))
    old = getattr(memo, "api", None)
    memo.api = KubeApi(cfg)
    if old is not None:
        await old.close()
    return await connection_info(cfg)


@kopf.on.cleanup(registry=registry)
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
        memo.api = None


# ---- Indexes: what the children look like, kept current by kopf's watches ----------------------


def _index_child(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> Optional[dict]:
    obs = observe(body)
    instance = labels.get(LABEL_INSTANCE)
    if obs is None or not instance:
        return None
    return {(namespace, instance): obs}


# Handlers receive these indexes by their ids: dsv4_statefulsets[(namespace, instance)] -> observations.
kopf.index("apps", "v1", "statefulsets", id="dsv4_statefulsets", labels=CHILD_LABELS, registry=registry)(_index_child)
kopf.index("apps", "v1", "deployments", id="dsv4_deployments", labels=CHILD_LABELS, registry=registry)(_index_child)


@kopf.index(*CR, id="dsv4_resources", registry=registry)
def _index_resource(namespace: str, name: str, **_: Any) -> dict:
    return {(namespace, name): True}
