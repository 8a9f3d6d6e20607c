"""The wedge watchdog's daemon: one per DSV4Deployment (dsv4_operator.remediation runs it). kopf
keeps a finalizer on resources with daemons, to stop the daemon before the resource goes.
"""

from __future__ import annotations

from typing import Any, Optional

import kopf

from dsv4_operator.handlers.apply import deployment_admin_token, describe_apply_error
from dsv4_operator.handlers.registry import CR, _api, _metrics, registry
from dsv4_operator.auth_secret import AuthSecretRefused
from dsv4_operator.kube import ApiError
from dsv4_operator.manifests import (
    APP,
    LABEL_NAME,
)
from dsv4_operator.remediation.daemon import DeploymentWatchdog
from dsv4_operator.watchdog.pods import engine_pod_index_key, pod_snapshot


# ---- The wedge watchdog -----------------------------------------------------------------------


@kopf.daemon(*CR, id="wedge_watchdog", registry=registry, cancellation_backoff=1.0, cancellation_timeout=10.0)
async def wedge_watchdog(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, dsv4_pods: kopf.Index, **_: Any
) -> None:
    """Scrape, judge and heal this deployment's engine pods for as long as it exists. `body` is
    kopf's live view of the resource: spec edits reach the running loop."""

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    def pods(namespace: str, instance: str, *group: str) -> list:  # group: () engines, (ROUTER_PODS,) routers
        return list(dsv4_pods.get((namespace, instance, *group), []))

    admin_token, attempt, warned = None, 0, False
    while admin_token is None and not stopped:
        try:
            admin_token = await deployment_admin_token(
                _api(memo), body["metadata"]["namespace"], body["metadata"]["name"]
            )
        except (ApiError, kopf.TemporaryError, AuthSecretRefused) as e:
            logger.warning(f"Cannot read the deployment's admin token yet: {e}")
            if isinstance(e, ApiError) and e.status == 403 and not warned:  # no token, no watchdog: say so once
                post(
                    "Warning",
                    "WatchdogWaiting",
                    f"the wedge watchdog cannot read or create the auth Secret: {describe_apply_error(e)}",
                )
                warned = True
        if admin_token is None:
            await stopped.wait(min(2.0 * 2**attempt, 60.0))
            attempt += 1
    if stopped:
        return
    watchdog = DeploymentWatchdog(
        lambda: _api(memo),
        _metrics(memo),
        body,
        post,
        logger,
        admin_token=admin_token,
        fleet=getattr(memo, "fleet", None),
        pods=pods,
    )
    await watchdog.run(stopped)


# The watchdog's engine pods, from one pod watch (main narrows it by label selector).
@kopf.index("", "v1", "pods", id="dsv4_pods", labels={LABEL_NAME: APP}, registry=registry)
def _index_engine_pod(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> Optional[dict]:
    key = engine_pod_index_key(namespace, labels)
    return None if key is None else {key: pod_snapshot(body)}
