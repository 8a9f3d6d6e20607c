"""`dsv4 operator`: run the kopf operator for DSV4Deployment.

- credentials: KUBECONFIG, else in-cluster (the pod's service account), else ~/.kube/config;
- scope: `--namespace NS` (repeatable) or, without it, every namespace;
- `--standalone`: a single replica that does not look for peers; without it the replicas elect a
  leader on the Lease `dsv4-operator` in POD_NAMESPACE (dsv4_operator.leader) and only it acts;
- logs: one JSON object per line (or plain text);
- GET /healthz (liveness) and GET /metrics (the operator's own Prometheus metrics) on
  `--health-port`.
CRD scanning is off: the CRD must be installed before the operator starts (the Helm chart does
that); a missing CRD stops the operator with one clear line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Optional, Sequence, Union

import kopf

# Each handler module registers its handlers on registry.registry when imported.
from dsv4_operator import rollout  # noqa: F401  (the canary daemon)
from dsv4_operator.handlers import apply, groups, watchdog_daemon  # noqa: F401  (reconciler, group controller, watchdog)
from dsv4_operator.handlers import children
from dsv4_operator.handlers.registry import registry
from dsv4_operator.planner import shell as planner_shell  # noqa: F401  (the planner daemon)
from dsv4_operator.kube import KubeApi, load_configuration
from dsv4_operator.leader import LeaderElection, LeaderElector, lease_namespace
from dsv4_operator.manifests import APP, LABEL_MANAGED_BY, LABEL_NAME, MANAGER
from dsv4_operator.remediation.daemon import REVISIONS_ANNOTATION
from dsv4_operator.pod_creation import EVENT_FIELD_SELECTOR
from dsv4_operator.watchdog.pods import engine_pod_watch_selector
from dsv4_operator.telemetry import HealthState, OperatorMetrics, start_health_server
from dsv4_operator.watchdog.corroboration import Fleet, RestartRateLimit
from dsv4_operator.watchdog.policy import STATE_ANNOTATION
from dsv4_wire import switches

Flag = Union[asyncio.Event, threading.Event, None]
ANNOTATION_PREFIX = "serving.dsv4.dev"
# "COUNT/SECONDS": at most COUNT remediations start in any SECONDS, across every deployment.
RESTART_RATE_LIMIT_ENV = "DSV4_RESTART_RATE_LIMIT"
LOG_FORMATS = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.FULL}


def make_settings(standalone: bool) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.peering.standalone = standalone
    # Watch only the resources the handlers name; do not list CRDs or namespaces (less RBAC).
    settings.scanning.disabled = True
    # kopf's bookkeeping under our own prefix, in annotations (status is a structural schema).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    # The watchdog's bookkeeping annotations are no change to act on.
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX,
        key="last-handled-configuration",
        ignored_fields=[("metadata", "annotations", key) for key in (STATE_ANNOTATION, REVISIONS_ANNOTATION)],
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    # Events: ours (Applied, InvalidSpec, ...) plus kopf's warnings, not every handler's info line.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGER
    # Which replica posted an Event (kopf's default is "dev" for every one): the chart passes the pod name.
    settings.posting.reporting_instance = os.environ.get("POD_NAME") or socket.gethostname()
    # Only our own children come over the wire, not every StatefulSet in the cluster.
    ours = f"{LABEL_NAME}={APP},{LABEL_MANAGED_BY}={MANAGER}"
    settings.watching.label_selectors["apps", "statefulsets"] = ours
    settings.watching.label_selectors["apps", "deployments"] = ours
    # Every other kind of child too: a cluster's Services, Roles, PDBs (whose status the disruption
    # controller rewrites all the time) never reach the operator to be filtered out.
    for group, version, plural in children.OTHER_CHILD_KINDS:
        settings.watching.label_selectors[group or version, plural] = ours
    # The watchdog's pod index: engine pods only, one watch for every deployment.
    settings.watching.label_selectors["v1", "pods"] = engine_pod_watch_selector()
    # Events: only the StatefulSet controllers' FailedCreate (pod_creation), chosen by the API server.
    settings.watching.field_selectors["v1", "events"] = EVENT_FIELD_SELECTOR
    return settings


async def serve_operator(
    *,
    namespaces: Sequence[str] = (),
    standalone: bool = False,
    health_host: str = "0.0.0.0",
    health_port: Optional[int] = 8080,
    kubeconfig: Optional[str] = None,
    stop_flag: Flag = None,
    ready_flag: Flag = None,
    settings: Optional[kopf.OperatorSettings] = None,
    state: Optional[HealthState] = None,
    metrics: Optional[OperatorMetrics] = None,
    fleet: Optional[Fleet] = None,
    leader_election: Optional[LeaderElection] = None,
) -> None:
    """Run the operator (and its health server) until stopped. Tests call this directly, with
    a stop flag and an explicit kubeconfig path.

    With ``leader_election`` the process is a candidate: it serves /healthz as a standby and starts
    kopf (reconciler, watchdog) only once it holds the Lease; if it loses the Lease it stops
    kopf and fails (exit 1: the kubelet restarts it as a fresh candidate), as controller-runtime
    does. Its watchdogs check the Lease again before every step (``Fleet.may_act``)."""
    state = state or HealthState()
    metrics = metrics or OperatorMetrics()
    runner = None
    if health_port is not None:
        runner = await start_health_server(state, metrics, health_host, health_port)
    started = asyncio.Event()

    async def watch_ready() -> None:
        await started.wait()
        state.started_at = time.monotonic()
        metrics.up.set(1)
        if isinstance(ready_flag, (asyncio.Event, threading.Event)):
            ready_flag.set()

    logging.getLogger("dsv4.operator").warning(scope_line(namespaces))
    watcher = asyncio.create_task(watch_ready())
    fleet = fleet or Fleet(restarts=RestartRateLimit.parse(switches.read(RESTART_RATE_LIMIT_ENV) or None))
    memo = kopf.Memo(metrics=metrics, kubeconfig=kubeconfig, api=None, fleet=fleet)
    elector: Optional[LeaderElector] = None
    lease_api: Optional[KubeApi] = None
    holder: Optional[asyncio.Task] = None
    lost = asyncio.Event()
    kopf_stop: Flag = stop_flag
    try:
        if leader_election is not None:
            lease_api = KubeApi(await load_configuration(kubeconfig))
            elector = LeaderElector(lambda: lease_api, leader_election)
            fleet.may_act = elector.is_leader
            state.standby = True
            if not await elector.acquire(lambda: _is_set(stop_flag)):
                return  # stopped while standing by
            state.standby = False
            kopf_stop = asyncio.Event()

            async def keep(stop: asyncio.Event = kopf_stop) -> None:
                if not await elector.hold(lambda: _is_set(stop_flag)):
                    lost.set()
                stop.set()

            holder = asyncio.create_task(keep())
        await kopf.operator(
            registry=registry,
            settings=settings or make_settings(standalone or leader_election is not None),
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            standalone=standalone or leader_election is not None,  # the Lease replaces kopf peering
            memo=memo,
            stop_flag=kopf_stop,
            ready_flag=started,
        )
        if lost.is_set():
            raise LeadershipLost("lost the leader Lease: stopped acting; restart to stand by again")
    except Exception as e:
        state.failure = failure_reason(e)
        raise
    finally:
        state.stopped_at = time.monotonic()
        metrics.up.set(0)
        watcher.cancel()
        if holder is not None:
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
        if elector is not None and not lost.is_set():
            await elector.release()
        if lease_api is not None:
            await lease_api.close()
        if runner is not None:
            await runner.cleanup()


def scope_line(namespaces: Sequence[str]) -> str:
    """The operator's first log line: where it reads DSV4Deployments (and that it reads nothing else)."""
    if not namespaces:
        return "serving DSV4Deployments in every namespace"
    return (
        f"serving DSV4Deployments in namespace(s) {', '.join(namespaces)} only: one applied anywhere else is "
        "stored and ignored (kubectl get dsv4d -A shows it with an empty WATCHED-BY)"
    )


class LeadershipLost(RuntimeError):
    pass


def _is_set(flag: Flag) -> bool:
    return flag is not None and flag.is_set()


def run_operator(namespaces: list[str], standalone: bool, health_port: int, log_format: str = "json") -> None:
    """The `dsv4 operator` command."""
    if log_format not in LOG_FORMATS:
        print(f"error: --log-format must be json or plain, not {log_format!r}", file=sys.stderr)
        sys.exit(2)
    if not 0 < health_port < 65536:
        print(f"error: --health-port must be a TCP port, not {health_port}", file=sys.stderr)
        sys.exit(2)
    kopf.configure(log_format=LOG_FORMATS[log_format], log_refkey="object" if log_format == "json" else None)
    try:
        # Without --standalone the replicas elect a leader on a Lease (kopf peering would let two
        # replicas of the same priority both act; see dsv4_operator.leader).
        election = None if standalone else LeaderElection(namespace=lease_namespace())
        asyncio.run(
            serve_operator(
                namespaces=namespaces, standalone=standalone, health_port=health_port, leader_election=election
            )
        )
    except KeyboardInterrupt:
        pass
    except Exception as e:  # kopf already logged the details; leave one line and a failing exit code
        print(f"error: the operator stopped: {failure_reason(e)}", file=sys.stderr)
        sys.exit(1)


def failure_reason(e: BaseException) -> str:
    """The cause worth a line: for a failed kopf activity (e.g. the startup check), the handlers'
    own errors rather than kopf's "One or more handlers failed"."""
    outcomes = getattr(e, "outcomes", None) or {}
    causes = [str(o.exception) for o in outcomes.values() if getattr(o, "exception", None) is not None]
    return "; ".join(causes) if causes else (str(e) or type(e).__name__)


def main(argv: Optional[list[str]] = None) -> Any:  # `python -m dsv4_operator.main` without the CLI
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", action="append", default=[])
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("--health-port", type=int, default=8080)
    parser.add_argument("--log-format", default="json")
    args = parser.parse_args(argv)
    run_operator(args.namespace, args.standalone, args.health_port, args.log_format)


if __name__ == "__main__":
    main()
