"""API calls per reconcile and per watchdog round at N DSV4Deployments, with the child watches
label-selected on the API server (as shipped) and watched cluster-wide with client-side filtering
(before issue 32: only the workloads were label-selected).

The real operator (kopf + handlers + watchdog daemons, in a thread) against the test emulator
(bench/harness/kmock_cluster.py), which records every request and counts the watch events it
streams to each client. N DSV4Deployments spread over a few namespaces that also hold other
people's Services and PodDisruptionBudgets (unlabelled, as in any shared namespace); then, for a
steady window, another writer keeps changing those (`--churn` writes per second) while the
watchdogs run their rounds (scrapeIntervalSeconds 10, the default; no engine pods, so a round scrapes nothing
and is all bookkeeping).

Counted for the operator (every client but the test's own):
- per reconcile: its requests while the N resources are created and reconciled, divided by N;
- per watchdog round: its requests during the steady window divided by the rounds the daemons ran
  (the reconciler's drift handling counts too: a foreign object that reached a handler and cost
  a read would show here);
- watch events the API server streamed to it, per resource, in each phase.

    python -m bench.suites.api_calls [--deployments 50] [--namespaces 5] [--seconds 20] [--churn 20]

Writes bench/results/api_calls.json (committed: 50 deployments in 5 namespaces; the first reconcile
of all 50 takes 12-15 s on the 2-core test machine). Earlier only 12 could be measured: the
emulator's request lookup (kmock scanning every request served so far for each new one) made
each request cost O(history); that is fixed in bench/harness/kmock_cluster.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


import kmock  # noqa: E402
from bench import RESULTS
from bench.harness import operator_runner  # noqa: E402
from bench.harness.kmock_cluster import TEST_AGENT, ClusterClient, KubeCluster, eventually, write_kubeconfig  # noqa: E402
from bench.harness.operator_runner import OperatorThread, free_port  # noqa: E402

from dsv4_operator import main  # noqa: E402
from dsv4_operator.handlers import children  # noqa: E402
from dsv4_operator.crd import build_crd  # noqa: E402
from dsv4_operator.remediation.daemon import DeploymentWatchdog  # noqa: E402

FOREIGN_PER_NAMESPACE = 20  # other people's Services and PDBs in each namespace
SCRAPE_INTERVAL = 10.0  # the watchdogs' round interval (the spec's default); --scrape-interval


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def deployment(name: str, ns: str) -> dict:
    return {
        "apiVersion": "serving.dsv4.dev/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
            "engine": {"image": "reg/dsv4:1"},
            "remediation": {"scrapeIntervalSeconds": SCRAPE_INTERVAL},
        },
    }


def cluster_wide_settings(standalone: bool = False):  # noqa: ANN201 (kopf.OperatorSettings)
    """The settings before the selector change: only the workloads and pods label-selected."""
    settings = main.make_settings(standalone=standalone)
    for group, version, plural in children.OTHER_CHILD_KINDS:
        del settings.watching.label_selectors[group or version, plural]
    return settings


def operator_calls(cluster: KubeCluster, start: int, end: int | None = None) -> Counter:
    return Counter(
        (c.verb, c.resource)
        for c in cluster.recorder.calls[start:end]
        if not c.agent.startswith((TEST_AGENT, "kmock/")) and c.verb != "watch"
    )


def operator_watch_events(cluster: KubeCluster) -> Counter:
    return Counter(
        {
            plural: n
            for (agent, plural), n in cluster.watch_events.items()
            if not agent.startswith((TEST_AGENT, "kmock/"))
        }
    )


async def run(n: int, namespaces: int, seconds: float, churn: float, selected: bool) -> dict:
    rounds = Counter()
    original_tick, original_settings = DeploymentWatchdog.tick, operator_runner.make_settings

    async def counting_tick(self: DeploymentWatchdog) -> float:
        rounds["rounds"] += 1
        return await original_tick(self)

    DeploymentWatchdog.tick = counting_tick
    if not selected:
        operator_runner.make_settings = cluster_wide_settings
    names = [f"ns{i}" for i in range(namespaces)]
    try:
        async with KubeCluster() as cluster, kmock.Server(cluster):
            # Without schema validation: the emulator evaluates the CRD's CEL rules with cel-python,
            # about 0.3 s a write of a DSV4Deployment, blocking its event loop (some 600 writes at
            # 50 deployments: minutes of the emulator's time). What is counted does not depend on it.
            cluster.register_crd(build_crd(), validate=False)
            async with ClusterClient(str(cluster.url)) as client:
                for ns in names:  # other people's objects, there before the operator
                    for i in range(FOREIGN_PER_NAMESPACE):
                        await client.create(
                            {
                                "apiVersion": "v1",
                                "kind": "Service",
                                "metadata": {"name": f"other-{i}", "namespace": ns},
                                "spec": {"ports": [{"port": 80}]},
                            },
                            "services",
                        )
                        await client.create(
                            {
                                "apiVersion": "policy/v1",
                                "kind": "PodDisruptionBudget",
                                "metadata": {"name": f"other-{i}", "namespace": ns},
                                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": f"other-{i}"}}},
                            },
                            "poddisruptionbudgets",
                        )
                log(f"foreign objects made ({'label-selected' if selected else 'cluster-wide'} run)")
                with tempfile.TemporaryDirectory() as tmp:
                    kubeconfig = write_kubeconfig(Path(tmp) / "kubeconfig", str(cluster.url).rstrip("/"))
                    op = await OperatorThread(kubeconfig, names, free_port()).start(timeout=60)
                    try:
                        start = len(cluster.recorder.calls)
                        events_before = operator_watch_events(cluster)
                        began = time.monotonic()
                        for i in range(n):
                            await client.create(deployment(f"d{i}", names[i % namespaces]), "dsv4deployments")

                        async def all_reconciled() -> bool:
                            for i in range(n):
                                cr = await client.get(
                                    "serving.dsv4.dev/v1alpha1", "dsv4deployments", names[i % namespaces], f"d{i}"
                                )
                                if (cr.get("status") or {}).get("observedGeneration") != 1:
                                    return False
                            return True

                        log(f"{n} created")
                        await eventually(all_reconciled, timeout=600, interval=2.0)
                        log("all reconciled")
                        reconcile_seconds = time.monotonic() - began
                        await asyncio.sleep(2)  # the last status writes and watch echoes
                        reconcile = operator_calls(cluster, start)
                        reconcile_events = operator_watch_events(cluster) - events_before

                        mark, events_mark, rounds_mark = (
                            len(cluster.recorder.calls),
                            operator_watch_events(cluster),
                            rounds["rounds"],
                        )
                        began, writes = time.monotonic(), 0
                        while time.monotonic() - began < seconds:
                            ns, i = names[writes % namespaces], writes % FOREIGN_PER_NAMESPACE
                            plural, api = (
                                ("services", "/api/v1") if writes % 2 else ("poddisruptionbudgets", "/apis/policy/v1")
                            )
                            await client.call(
                                "PATCH",
                                f"{api}/namespaces/{ns}/{plural}/other-{i}",
                                {"metadata": {"annotations": {"touched": str(writes)}}},
                                "application/merge-patch+json",
                                params={"fieldManager": "other-team"},
                            )
                            writes += 1
                            await asyncio.sleep(1.0 / churn)
                        steady_seconds = time.monotonic() - began
                        log("steady window over")
                        steady = operator_calls(cluster, mark)
                        steady_events = operator_watch_events(cluster) - events_mark
                        steady_rounds = rounds["rounds"] - rounds_mark
                    finally:
                        await op.stop()
    finally:
        DeploymentWatchdog.tick = original_tick
        operator_runner.make_settings = original_settings
    total = sum(reconcile.values())
    return {
        "child_watches": "label-selected on the API server" if selected else "cluster-wide, filtered by kopf",
        "deployments": n,
        "namespaces": namespaces,
        "foreign_objects": 2 * FOREIGN_PER_NAMESPACE * namespaces,
        "reconcile": {
            "seconds": round(reconcile_seconds, 1),
            "operator_requests": total,
            "requests_per_reconcile": round(total / n, 2),
            "by_call": {f"{v} {r}": c for (v, r), c in sorted(reconcile.items())},
            "watch_events_received": dict(sorted(reconcile_events.items())),
            "watch_events_per_reconcile": round(sum(reconcile_events.values()) / n, 2),
        },
        "steady": {
            "seconds": round(steady_seconds, 1),
            "foreign_writes": writes,
            "watchdog_rounds": steady_rounds,
            "operator_requests": sum(steady.values()),
            "requests_per_watchdog_round": round(sum(steady.values()) / max(steady_rounds, 1), 3),
            "by_call": {f"{v} {r}": c for (v, r), c in sorted(steady.items())},
            "watch_events_received": dict(sorted(steady_events.items())),
            "watch_events_per_foreign_write": round(sum(steady_events.values()) / max(writes, 1), 2),
        },
    }


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployments", type=int, default=50)
    ap.add_argument("--namespaces", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--churn", type=float, default=20.0, help="foreign writes per second in the steady window")
    ap.add_argument("--out", type=Path, default=RESULTS / "api_calls.json")
    ap.add_argument("--scrape-interval", type=float, default=SCRAPE_INTERVAL)
    args = ap.parse_args()
    globals()["SCRAPE_INTERVAL"] = args.scrape_interval
    runs = [
        asyncio.run(run(args.deployments, args.namespaces, args.seconds, args.churn, selected))
        for selected in (False, True)
    ]
    out = {
        "benchmark": "api_calls",
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "churn_per_second": args.churn,
        "note": "requests exclude watches (their events are counted apart); per watchdog round = every operator "
        "request in the steady window / the rounds all daemons ran in it",
        "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main_()
