"""Time from applying an engine change to its full rollout, with and without the canary step, and
the canary's own probe time; and the time to catch and revert a change that stalls long contexts.

The real operator (kopf + handlers + canary daemon, in a thread) against the test emulator
(bench/harness/kmock_cluster.py) over HTTP, with the stand-in StatefulSet controller and
engines of bench/harness/canary_fleet.py (pods are recreated at once; a real pod's
start, image pull and model load come on top, once more for the canary, which goes first alone).
Deployment: prefill 2, decode 3, prefillFirst; probe: `--duration` s at concurrency 2, per engine
probed (a stable pod, then the canary).

    python -m bench.suites.canary_rollout [--duration 5] [--runs 2]

Writes bench/results/canary_rollout.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


import kmock  # noqa: E402
from bench import RESULTS
from bench.harness.canary_fleet import STALL_AFTER, FakeFleet  # noqa: E402
from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually, write_kubeconfig  # noqa: E402
from bench.harness.operator_runner import OperatorThread, free_port  # noqa: E402

from dsv4_operator.canary.plan import ANNOTATION_CANARY  # noqa: E402
from dsv4_operator.crd import build_crd  # noqa: E402

NS, NAME = "bench", "flash"
API, PLURAL = "serving.dsv4.dev/v1alpha1", "dsv4deployments"


def deployment(canary: bool, duration: int) -> dict:
    return {
        "apiVersion": API,
        "kind": "DSV4Deployment",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
            "engine": {"image": "reg/dsv4:1"},
            "prefill": {"replicas": 2},
            "decode": {"replicas": 3},
            "remediation": {"enabled": False},
            "rollout": {
                "canary": {
                    "enabled": canary,
                    "durationSeconds": duration,
                    "requestTimeoutSeconds": 3,
                    "readyTimeoutSeconds": 60,
                }
            },
        },
    }


async def run(canary: bool, image: str, duration: int) -> dict:
    async with KubeCluster() as cluster, kmock.Server(cluster):
        cluster.register_crd(build_crd())
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = write_kubeconfig(Path(tmp) / "kubeconfig", str(cluster.url).rstrip("/"))
            async with ClusterClient(str(cluster.url)) as client:
                op = await OperatorThread(kubeconfig, [NS], free_port()).start()
                fleet = await FakeFleet(client, NS, NAME).start()
                try:
                    await client.create(deployment(canary, duration), PLURAL)

                    async def settled() -> bool:
                        cr = await client.get(API, PLURAL, NS, NAME)
                        return len(fleet.images) == 5 and ANNOTATION_CANARY in ((cr or {}).get("metadata") or {}).get(
                            "annotations", {}
                        )

                    await eventually(settled, timeout=60)
                    started = time.monotonic()
                    await client.patch(API, PLURAL, NS, NAME, {"spec": {"engine": {"image": image}}})

                    async def done() -> bool:
                        cr = await client.get(API, PLURAL, NS, NAME)
                        phase = ((cr.get("status") or {}).get("canary") or {}).get("phase")
                        if phase == "Failed":  # caught: done once every pod is back on the old image
                            return all(i == "reg/dsv4:1" for i in fleet.images.values())
                        return all(i == image for i in fleet.images.values())  # rolled (a stall not caught too)

                    await eventually(done, timeout=300, interval=0.1)
                    elapsed = time.monotonic() - started
                    cr = await client.get(API, PLURAL, NS, NAME)
                    c = (cr.get("status") or {}).get("canary") or {}
                    figures = c.get("figures") or {}
                    return {
                        "canary": canary,
                        "image": image,
                        "seconds_apply_to_done": round(elapsed, 2),
                        "phase": c.get("phase"),
                        "probe_seconds": figures.get("probeSeconds"),
                        "canary_probe": figures.get("canary"),
                        "stable_probe": figures.get("stable"),
                        "canary_requests_extra_prompt_tokens": (figures.get("canary") or {}).get("prompt_tokens"),
                        "pods_recreated": len(fleet.timeline) - 5,
                    }
                finally:
                    await fleet.stop()
                    await op.stop()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    runs = {"without_canary": [], "with_canary": [], "stalling_change": []}
    for _ in range(args.runs):
        runs["without_canary"].append(await run(False, "reg/dsv4:2", args.duration))
        runs["with_canary"].append(await run(True, "reg/dsv4:2", args.duration))
        runs["stalling_change"].append(await run(True, "reg/dsv4:stall", args.duration))
        print(json.dumps({k: v[-1]["seconds_apply_to_done"] for k, v in runs.items()}), flush=True)
    summary = {
        k: {
            "median_seconds_apply_to_done": statistics.median(r["seconds_apply_to_done"] for r in v),
            "median_probe_seconds": (
                statistics.median(r["probe_seconds"] for r in v)
                if all(r["probe_seconds"] is not None for r in v)
                else None
            ),
            "verdicts": [r["phase"] for r in v],
        }
        for k, v in runs.items()
    }
    out = {
        "what": "apply -> every pod on the new image (or, for the stalling change, the canary Failed and "
        "every pod back on the old image), real operator against the kmock emulator with stand-in "
        "StatefulSet controller and engines; pods start at once (no image pull or model load)",
        "probe_duration_seconds_per_engine": args.duration,
        "concurrency": 2,
        "stall_after_tokens": STALL_AFTER,
        "deployment": "prefill 2, decode 3, prefillFirst",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "summary": summary,
        "runs": runs,
    }
    path = RESULTS / "canary_rollout.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
