"""The production wedge, reproduced with real engines, healed by the real operator.

`dsv4 serve --role prefill` and `--role decode` run as processes with fault injection and their
PD deadlines off; a stalled KV transfer pins one request in the prefill inflight queue for good
(as in test_pd.py::test_wedge_reproduced_with_deadlines_disabled). The pods that stand for them
in the emulated API server point at those processes, and the pods/log of the prefill pod serves
the prefill process's real log (a kubelet's job). The operator must capture the evidence, drain
the pod, abort what is stuck (which frees the client) and delete the pod, within the detection
window and a few scrape intervals, leaving the decode — the victim, not the cause — alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from bench.harness.commands import Proc, free_port
from bench.harness.kmock_cluster import ClusterClient, eventually
from watchdog_harness import NS, PLURAL, WatchdogCluster, condition, deployment, events, evidence_maps, get_cr

WINDOW, INTERVAL = 3.0, 0.5


class RealPD:
    def __init__(self, model: Path, tmp: Path) -> None:
        self.p_port, self.b_port, self.d_port = free_port(), free_port(), free_port()
        common = [
            "--model",
            model,
            "--kv-pages",
            64,
            "--page-size",
            16,
            "--served-model-name",
            "m",
            "--enable-fault-injection",
            "--no-deadlines",
        ]
        self.prefill = Proc(
            ["serve", "--role", "prefill", "--port", self.p_port, "--bootstrap-port", self.b_port, *common],
            tmp / "prefill.log",
        )
        self.decode = Proc(["serve", "--role", "decode", "--port", self.d_port, *common], tmp / "decode.log")

    p_url = property(lambda self: f"http://127.0.0.1:{self.p_port}")
    d_url = property(lambda self: f"http://127.0.0.1:{self.d_port}")

    async def ready(self) -> None:
        await asyncio.gather(
            asyncio.to_thread(self.prefill.wait_ready, self.p_url),
            asyncio.to_thread(self.decode.wait_ready, self.d_url),
        )

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture
def real_pd(tiny_model: Path, tmp_path: Path):
    pd = RealPD(tiny_model, tmp_path)  # both boot while the test starts the operator
    yield pd
    pd.stop()


async def test_a_wedged_prefill_pod_is_captured_drained_aborted_and_restarted(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, operator_factory, real_pd: RealPD
) -> None:
    await operator_factory()
    # Engines ready before the CR exists: its revision must not turn stable (5 windows without a
    # wedge) while two engines of two processes each still boot on a busy machine.
    await real_pd.ready()
    cr = await kube_client.create(
        deployment("flash", remediation={"detectionWindowSeconds": WINDOW, "scrapeIntervalSeconds": INTERVAL}), PLURAL
    )
    kube_cluster.pod_logs[(NS, "flash-prefill-0")] = lambda: real_pd.prefill.log_path.read_text(errors="replace")
    farm = pod_farm("flash")
    await farm.add("flash-prefill-0", "prefill", real_pd.p_port)
    await farm.add("flash-decode-0", "decode", real_pd.d_port)

    async def watching() -> Optional[dict]:
        found = await get_cr(kube_client, "flash")
        return found if condition(found).get("reason") == "NoWedge" else None

    await eventually(watching, timeout=10)

    async with httpx.AsyncClient(timeout=60) as http:
        (
            await http.post(f"{real_pd.p_url}/admin/faults", json={"fault": "stall_transfer", "count": 1})
        ).raise_for_status()
        body = {
            "prompt": list(range(20, 70)),
            "max_tokens": 4,
            "temperature": 0,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": real_pd.b_port,
            "bootstrap_room": 4242,
        }
        clients = [
            asyncio.create_task(http.post(f"{url}/v1/completions", json=body)) for url in (real_pd.p_url, real_pd.d_url)
        ]

        async def inflight() -> bool:
            return (await http.get(f"{real_pd.p_url}/v1/loads")).json()["queues"]["inflight"] == 1

        await eventually(inflight, timeout=20)
        wedged_at = time.monotonic()

        # Within the window and a few scrape intervals (plus room for a busy 2-core machine).
        await eventually(kube_cluster.removed_pods, timeout=WINDOW + 6 * INTERVAL + 6)
        [(deleted_at, pod)] = kube_cluster.removed_pods()
        assert pod["metadata"]["name"] == "flash-prefill-0"
        assert deleted_at - wedged_at < WINDOW + 6 * INTERVAL + 4, f"took {deleted_at - wedged_at:.1f}s"
        assert pod["metadata"]["labels"]["serving.dsv4.dev/draining"] == "true"  # drained before the delete

        # The abort freed the stuck client on both sides: an error, not a hang.
        done, _ = await asyncio.wait(clients, timeout=15)
        assert len(done) == 2
        assert [t.result().status_code >= 400 for t in clients] == [True, True], [t.result().text for t in clients]
        assert (await http.get(f"{real_pd.p_url}/v1/loads")).json()["queues"]["inflight"] == 0

    [cm] = evidence_maps(kube_cluster)
    assert cm["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    assert cm["metadata"]["labels"]["serving.dsv4.dev/pod"] == "flash-prefill-0"
    data = cm["data"]
    verdict = json.loads(data["verdict.json"])
    assert (verdict["state"], verdict["reason"]) == ("Wedged", "stuck_inflight")
    assert verdict["details"]["oldest_inflight_age_seconds"] >= WINDOW
    loads = json.loads(data["loads.json"])
    assert loads["queues"]["inflight"] == 1 and loads["deadlines"] is False
    [stuck, *_] = json.loads(data["timelines.json"])  # the stuck request's PD events, oldest state first
    assert stuck["state"] == "Transferring" and stuck["in_state_seconds"] >= WINDOW
    assert [e["event"] for e in stuck["events"]] == [
        "arrival",
        "Bootstrapping",
        "WaitingForInput",
        "forward_done",
        "Transferring",
    ]
    assert "--- thread" in data["stacks.txt"]  # every thread of the live engine
    assert 'dsv4:num_prefill_inflight_queue_reqs{model_name="m",role="prefill"} 1.0' in data["metrics.txt"]
    assert "dsv4 serve: prefill engine" in data["logs.txt"]  # the process's own log, via pods/log
    assert "no stable revision yet" in data["spec-diff.txt"]

    assert not [p for _, p in kube_cluster.removed_pods() if p["metadata"]["name"] == "flash-decode-0"]
    decode = await farm.get("flash-decode-0")
    assert "serving.dsv4.dev/draining" not in decode["metadata"]["labels"]
    for reason in ("WedgeDetected", "EvidenceCaptured", "Drained", "Aborted", "Restarted"):
        found = await eventually(
            lambda: [e for e in events(kube_cluster, "flash", reason) if e["message"].startswith("flash-prefill-0")],
            timeout=5,
        )
        assert len(found) == 1, reason
    assert not [
        e
        for e in events(kube_cluster, "flash")
        if e["reason"] in ("Drained", "Restarted") and e["message"].startswith("flash-decode-0")
    ]

    async def recorded() -> Optional[dict]:
        found = await get_cr(kube_client, "flash")
        return found if (found.get("status") or {}).get("remediationsTotal") == 1 else None

    status = (await eventually(recorded, timeout=5))["status"]
    assert (status["lastRemediation"]["pod"], status["lastRemediation"]["action"]) == ("flash-prefill-0", "restart")

    # The decode healed with the prefill's abort; the prefill pod stays under remediation until
    # its StatefulSet brings it back (which the emulator's missing controller never does).
    async def only_the_prefill() -> Optional[dict]:
        cond = condition(await get_cr(kube_client, "flash"))
        return (
            cond if cond.get("message") == "1 wedged: flash-prefill-0 (stuck_inflight, remediation restarted)" else None
        )

    assert (await eventually(only_the_prefill, timeout=5))["status"] == "True"
