"""Re-applies per minute against a writer that keeps changing a child.

The real operator (kopf + handlers, in a thread) against the test emulator (tests/integration/
kmock_cluster.py) over HTTP; a DSV4Deployment is applied, then another field manager (`fighter`)
rewrites the router Service's port several times a second for `--seconds`. Counted: the
operator's writes to that Service (patch or update: a repair is a JSON patch removing the
foreign port plus an apply), its Restored and FightingWriter Events. Run twice: with the
back-off (as shipped) and without it (FightTracker with a threshold no fight reaches: every
foreign change repaired at once, as before issue 32's item 5; the rest of today's repair, such as
removing the foreign port, is the same in both runs).

    python -m bench.suites.fighting_writer [--seconds 60] [--rate 5]

Writes bench/results/fighting_writer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path


import kmock  # noqa: E402
from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually, write_kubeconfig  # noqa: E402
from bench.harness.operator_runner import OperatorThread, free_port  # noqa: E402

import dsv4_operator.handlers.children as children  # noqa: E402
from bench import RESULTS
from dsv4_operator.crd import build_crd  # noqa: E402
from dsv4_operator.fight import FightTracker  # noqa: E402

NS, NAME = "bench", "flash"
SERVICE = f"/api/v1/namespaces/{NS}/services/{NAME}-router"


def deployment() -> dict:
    return {
        "apiVersion": "serving.dsv4.dev/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
            "engine": {"image": "reg/dsv4:1"},
        },
    }


async def run(seconds: float, rate: float, backoff: bool) -> dict:
    original = children.FightTracker
    if not backoff:
        children.FightTracker = lambda: FightTracker(threshold=10**9)  # every change repaired at once
    try:
        async with KubeCluster() as cluster, kmock.Server(cluster):
            cluster.register_crd(build_crd())
            with tempfile.TemporaryDirectory() as tmp:
                kubeconfig = write_kubeconfig(Path(tmp) / "kubeconfig", str(cluster.url).rstrip("/"))
                op = await OperatorThread(kubeconfig, [NS], free_port()).start()
                try:
                    async with ClusterClient(str(cluster.url)) as client:
                        await client.create(deployment(), "dsv4deployments")
                        await eventually(lambda: client.get("v1", "services", NS, f"{NAME}-router"), timeout=30)
                        await asyncio.sleep(2)

                        def operator_writes() -> int:
                            return sum(
                                1
                                for c in cluster.recorder.calls
                                if c.name == f"{NAME}-router"
                                and c.resource == "services"
                                and c.verb in ("patch", "update")
                                and not c.agent.startswith(("dsv4-tests", "kmock/"))
                            )

                        before, writes = operator_writes(), 0
                        started = time.monotonic()
                        while time.monotonic() - started < seconds:
                            port = 9000 + writes % 2
                            await client.call(
                                "PATCH",
                                SERVICE,
                                {
                                    "spec": {
                                        "ports": [
                                            {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}
                                        ]
                                    }
                                },
                                "application/merge-patch+json",
                                params={"fieldManager": "fighter"},
                            )
                            writes += 1
                            await asyncio.sleep(1.0 / rate)
                        elapsed = time.monotonic() - started
                        repairs = operator_writes() - before
                        events = [
                            e for e in await client.list("v1", "events", NS) if e["involvedObject"].get("name") == NAME
                        ]
                finally:
                    await op.stop()
    finally:
        children.FightTracker = original
    return {
        "backoff": backoff,
        "seconds": round(elapsed, 1),
        "foreign_writes": writes,
        "foreign_writes_per_minute": round(writes * 60 / elapsed, 1),
        "operator_writes": repairs,
        "operator_writes_per_minute": round(repairs * 60 / elapsed, 1),
        "restored_events": sum(e["reason"] == "Restored" for e in events),
        "fighting_writer_warnings": sum(e["reason"] == "FightingWriter" for e in events),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=5.0, help="foreign writes per second")
    args = ap.parse_args()
    results = [asyncio.run(run(args.seconds, args.rate, backoff)) for backoff in (False, True)]
    out = {
        "benchmark": "fighting_writer",
        "child": "Service (router)",
        "rate_per_second": args.rate,
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "note": "a repair is up to two writes: a JSON patch removing the foreign entry, then an apply",
        "runs": results,
    }
    path = RESULTS / "fighting_writer.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
