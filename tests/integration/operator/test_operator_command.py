"""`dsv4 operator` as users run it: a real process, KUBECONFIG pointing at the kmock-based API
server, JSON logs, /healthz and /metrics, SIGTERM for a clean stop."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.operator_runner import free_port
from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually

API = "serving.dsv4.dev/v1alpha1"


def dsv4_command() -> list[str]:
    exe = shutil.which("dsv4") or str(Path(sys.executable).with_name("dsv4"))
    return [exe]


class OperatorProcess:
    def __init__(self, args: list[str], kubeconfig: Path, log_path: Path) -> None:
        self.args = args
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.proc: Optional[asyncio.subprocess.Process] = None

    async def start(self) -> "OperatorProcess":
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "wb")
        self.proc = await asyncio.create_subprocess_exec(
            *dsv4_command(), "operator", *self.args, stdout=self._log, stderr=asyncio.subprocess.STDOUT, env=env
        )
        return self

    def log_lines(self) -> list[str]:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace").splitlines()

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._log.close()
        return self.proc.returncode


async def test_dsv4_operator_command(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, kubeconfig: Path, tmp_path: Path
) -> None:
    port = free_port()
    op = await OperatorProcess(
        ["--namespace", "ns1", "--namespace", "ns2", "--standalone", "--health-port", str(port)],
        kubeconfig,
        tmp_path / "operator.log",
    ).start()
    try:

        async def healthy() -> bool:
            assert op.proc.returncode is None, "\n".join(op.log_lines()[-20:])
            try:
                async with httpx.AsyncClient() as http:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await eventually(healthy, timeout=30)
        for ns in ("ns1", "ns2", "ns3"):
            await kube_client.create(
                {
                    "apiVersion": API,
                    "kind": "DSV4Deployment",
                    "metadata": {"name": "flash", "namespace": ns},
                    "spec": {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "reg/dsv4:1"}},
                },
                "dsv4deployments",
            )

        async def served(ns: str) -> bool:
            cr = await kube_client.get(API, "dsv4deployments", ns, "flash")
            return (cr.get("status") or {}).get("observedGeneration") == 1

        await eventually(lambda: served("ns1"), timeout=20)
        await eventually(lambda: served("ns2"), timeout=20)
        assert await kube_client.get("apps/v1", "statefulsets", "ns1", "flash-prefill") is not None
        assert await kube_client.get("apps/v1", "statefulsets", "ns3", "flash-prefill") is None  # not watched
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        assert 'dsv4_operator_reconciles_total{result="applied"} 2.0' in metrics
        assert "dsv4_operator_up 1.0" in metrics
    finally:
        code = await op.stop(signal.SIGTERM)
    assert code == 0, "\n".join(op.log_lines()[-20:])

    # Structured logs: every line a JSON object; the operator's own lines among them.
    records = [json.loads(line) for line in op.log_lines() if line.strip()]
    messages = [r.get("message", "") for r in records]
    assert any("is served by the API server" in m for m in messages)
    assert any(r.get("object", {}).get("name") == "flash" for r in records)  # per-object context
    assert any("Signal SIGTERM" in m for m in messages)


async def test_missing_crd_stops_with_one_clear_line(
    kube_cluster: KubeCluster, kubeconfig: Path, tmp_path: Path
) -> None:
    op = await OperatorProcess(
        ["--standalone", "--health-port", str(free_port()), "--log-format", "plain"],
        kubeconfig,
        tmp_path / "operator.log",
    ).start()
    try:
        code = await asyncio.wait_for(op.proc.wait(), 30)
    finally:
        await op.stop()
    assert code != 0
    assert op.log_lines()[-1] == (
        "error: the operator stopped: the CRD dsv4deployments.serving.dsv4.dev "
        "(serving.dsv4.dev/v1alpha1) is not installed; apply crds/dsv4deployment.yaml first"
    )


async def test_bad_flags_exit_non_zero_with_one_line(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *dsv4_command(),
        "operator",
        "--log-format",
        "xml",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 2
    assert err.decode().strip() == "error: --log-format must be json or plain, not 'xml'"
