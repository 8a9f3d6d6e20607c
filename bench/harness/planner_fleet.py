"""What the planner's real-system test (tests/integration/operator/test_planner_real_engines.py) stands on, besides the emulated API server and the real
operator: a StatefulSet controller and kubelet for one deployment's engine pods that run real
`dsv4 serve` processes, the real `dsv4 router` discovering them through the emulator, and clients.

- Pods: for every ordinal below a StatefulSet's replicas, a `dsv4 serve --role <role>` process
  (tiny model, the deployment's PD secret and admin token from the Secret the operator made) and
  a Pod object (the template's labels, controlled by the StatefulSet, the container port the
  process listens on). The pod is Pending until the engine answers /ready, then Running and
  Ready at 127.0.0.1 (a kubelet's readiness probe: the router takes it only then); when /ready
  says draining, Ready turns False.
- Scale-down, as the StatefulSet controller and kubelet do it: the highest ordinal's Pod object is
  deleted (every router drops it), its preStop hook runs (POST /admin/drain, then up to the drain
  budget for its queues to empty) and the process gets SIGTERM (it ends what is left with an
  error event after --shutdown-grace, which the router migrates).
- Clients: streaming completions through the router with the official `openai` client; every
  answer is checked whole (finish reason, usage equal to max_tokens).
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.commands import Proc, free_port
from bench.harness.kmock_cluster import ClusterClient, ClusterError
from dsv4_wire import ADMIN_TOKEN_ENV, PD_SECRET_ENV, Paths, authorization_header

ENGINE_ARGS = ["--kv-pages", 512, "--page-size", 16, "--max-num-seqs", 64, "--served-model-name", "m"]
PRESTOP_BUDGET_S = 20.0  # the drain the pod's preStop hook waits for (terminationGracePeriod - 10 s)
SHUTDOWN_GRACE_S = 5.0


@dataclass
class EnginePodProc:
    name: str
    role: str
    port: int
    proc: Proc
    ready: bool = False
    ready_at: Optional[float] = None
    terminating: bool = False


@dataclass
class Fleet:
    client: ClusterClient
    namespace: str
    deployment: str
    model: Path
    tmp: Path
    pods: dict[str, EnginePodProc] = field(default_factory=dict)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)  # (monotonic, event, pod)
    env: dict[str, str] = field(default_factory=dict)
    spares: dict[str, int] = field(default_factory=dict)  # role -> engines started ahead (a warm node)
    _spares: dict[str, list] = field(default_factory=dict)
    _task: Optional[asyncio.Task] = None
    _stops: list[asyncio.Task] = field(default_factory=list)

    async def start(self) -> "Fleet":
        secret = None
        deadline = time.monotonic() + 30
        while secret is None:  # the operator makes <name>-auth with the admin token and PD secret
            secret = await self.client.get("v1", "secrets", self.namespace, f"{self.deployment}-auth")
            if secret is None:
                if time.monotonic() > deadline:
                    raise AssertionError("the operator made no auth Secret")
                await asyncio.sleep(0.1)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        self.env = {ADMIN_TOKEN_ENV: data["admin-token"], PD_SECRET_ENV: data["pd-secret"]}
        for role, n in self.spares.items():  # loading beside the first pods: a scale-up gets one at once
            self._spares[role] = [self._spawn(f"{self.deployment}-{role}-spare{i}", role) for i in range(n)]
        self._task = asyncio.create_task(self._controller())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._stops, return_exceptions=True)
        procs = [p.proc for p in self.pods.values()] + [proc for spare in self._spares.values() for _, proc in spare]
        await asyncio.gather(*(asyncio.to_thread(proc.stop) for proc in procs))

    @property
    def admin_headers(self) -> dict[str, str]:
        return authorization_header(self.env[ADMIN_TOKEN_ENV])

    def url(self, pod: str) -> str:
        return f"http://127.0.0.1:{self.pods[pod].port}"

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{p.proc.log()[-1500:]}" for name, p in self.pods.items())

    async def _controller(self) -> None:
        while True:
            try:
                for role in ("prefill", "decode"):
                    await self._reconcile(role)
                await self._probe()
            except ClusterError:
                pass
            await asyncio.sleep(0.2)

    async def _reconcile(self, role: str) -> None:
        sts = await self.client.get("apps/v1", "statefulsets", self.namespace, f"{self.deployment}-{role}")
        if sts is None:
            return
        want = int(sts["spec"].get("replicas", 1))
        for i in range(want):
            name = f"{self.deployment}-{role}-{i}"
            if name not in self.pods:
                await self._create(sts, name, role)
        for name, p in list(self.pods.items()):
            if p.role == role and not p.terminating and int(name.rsplit("-", 1)[1]) >= want:
                p.terminating = True
                self._stops.append(asyncio.create_task(self._terminate(p)))
        # The controller's status: every pod runs the one template (no rollout in this test).
        pods = [p for p in self.pods.values() if p.role == role and not p.terminating]
        revision = f"{sts['metadata']['name']}-{hash(repr(sts['spec'].get('template'))) & 0xFFFFFF:06x}"
        status = {
            "observedGeneration": sts["metadata"].get("generation", 1),
            "replicas": len(pods),
            "readyReplicas": sum(p.ready for p in pods),
            "updatedReplicas": len(pods),
            "availableReplicas": sum(p.ready for p in pods),
            "currentRevision": revision,
            "updateRevision": revision,
        }
        if {k: (sts.get("status") or {}).get(k) for k in status} != status:
            await self.client.patch(
                "apps/v1",
                "statefulsets",
                self.namespace,
                sts["metadata"]["name"],
                {"status": status},
                subresource="status",
            )

    def _spawn(self, name: str, role: str) -> tuple[int, Proc]:
        port = free_port()
        extra = ["--bootstrap-port", free_port()] if role == "prefill" else []
        proc = Proc(
            [
                "serve",
                "--model",
                self.model,
                "--role",
                role,
                *ENGINE_ARGS,
                "--port",
                port,
                "--shutdown-grace",
                SHUTDOWN_GRACE_S,
                *extra,
            ],
            self.tmp / f"{name}-{time.monotonic_ns()}.log",
            env=self.env,
        )
        return port, proc

    async def _create(self, sts: dict, name: str, role: str) -> None:
        spare = self._spares.get(role) or []
        port, proc = spare.pop(0) if spare else self._spawn(name, role)
        self.pods[name] = EnginePodProc(name, role, port, proc)
        labels = dict(((sts["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {})
        await self.client.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "labels": labels,
                    "ownerReferences": [
                        {
                            "apiVersion": "apps/v1",
                            "kind": "StatefulSet",
                            "name": sts["metadata"]["name"],
                            "uid": sts["metadata"]["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": {
                    "containers": [
                        {"name": "engine", "image": "reg/dsv4:1", "ports": [{"name": "http", "containerPort": port}]}
                    ]
                },
            },
            "pods",
        )
        await self.client.patch(
            "v1", "pods", self.namespace, name, {"status": {"phase": "Pending"}}, subresource="status"
        )
        self.timeline.append((time.monotonic(), "created", name))

    async def _probe(self) -> None:
        """The kubelet's readiness probe: /ready of every engine, reflected in its Pod."""
        async with httpx.AsyncClient(timeout=1.0) as http:
            for name, p in list(self.pods.items()):
                if p.terminating:
                    continue
                if p.proc.popen.poll() is not None:
                    raise AssertionError(f"{name} exited:\n{p.proc.log()}")
                try:
                    ready = (await http.get(self.url(name) + Paths.READY)).status_code == 200
                except httpx.HTTPError:
                    ready = False
                if ready != p.ready:
                    p.ready = ready
                    if ready and p.ready_at is None:
                        p.ready_at = time.monotonic()
                    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}
                    if ready:
                        status["podIP"] = "127.0.0.1"
                    await self.client.patch(
                        "v1", "pods", self.namespace, name, {"status": status}, subresource="status"
                    )
                    self.timeline.append((time.monotonic(), "ready" if ready else "unready", name))

    async def _terminate(self, p: EnginePodProc) -> None:
        """The StatefulSet controller deletes the pod; the kubelet runs its preStop drain, then
        SIGTERM (the engine's own shutdown drain, then the error events the router migrates)."""
        try:
            await self.client.delete("v1", "pods", self.namespace, p.name)
        except ClusterError:
            pass
        self.timeline.append((time.monotonic(), "deleted", p.name))
        url = self.url(p.name)
        async with httpx.AsyncClient(timeout=2.0, headers=self.admin_headers) as http:
            try:
                await http.post(url + Paths.ADMIN_DRAIN)
                deadline = time.monotonic() + PRESTOP_BUDGET_S
                while time.monotonic() < deadline:
                    queues = (await http.get(url + Paths.LOADS)).json()["queues"]
                    if not any(queues.values()):
                        break
                    await asyncio.sleep(0.2)
            except (httpx.HTTPError, ValueError, KeyError):
                pass
        await asyncio.to_thread(p.proc.stop)
        self.timeline.append((time.monotonic(), "stopped", p.name))
        del self.pods[p.name]

    def ready_count(self, role: str) -> int:
        return sum(1 for p in self.pods.values() if p.role == role and p.ready and not p.terminating)


def start_router(kubeconfig: Path, namespace: str, deployment: str, tmp: Path, env: dict) -> tuple[Proc, str]:
    """The real router, discovering the deployment's engine pods through the emulator."""
    port = free_port()
    proc = Proc(
        [
            "router",
            "--port",
            port,
            "--discover-namespace",
            namespace,
            "--selector",
            f"app.kubernetes.io/instance={deployment}",
            "--owner",
            f"{deployment}-prefill",
            "--owner",
            f"{deployment}-decode",
            "--health-interval",
            0.5,
        ],
        tmp / "router.log",
        # the PD secret (the engines take the router's requests with it); no admin token: the test
        # reads the router's /admin/workers from loopback
        env={PD_SECRET_ENV: env[PD_SECRET_ENV], "KUBECONFIG": str(kubeconfig)},
    )
    return proc, f"http://127.0.0.1:{port}"


@dataclass
class Load:
    """`clients` concurrent streaming completions through the router, each checked whole."""

    base_url: str
    max_tokens: int = 48
    clients: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _running: dict[int, asyncio.Task] = field(default_factory=dict)
    _stop: bool = False

    async def set_clients(self, n: int) -> None:
        """Clients 0..n-1 run; those at n and above stop after their current request."""
        self.clients = n
        running = {i for i, t in self._running.items() if not t.done()}
        for i in range(n):
            if i not in running:
                self._running[i] = task = asyncio.create_task(self._client(i))
                self._tasks.append(task)

    async def _client(self, index: int) -> None:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        i = 0
        try:
            while not self._stop and index < self.clients:
                i += 1
                prompt = [(11 * index + 7 * i + j) % 400 + 3 for j in range(8 + (i % 24))]
                try:
                    stream = await client.completions.create(
                        model="m",
                        prompt=prompt,
                        max_tokens=self.max_tokens,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                    finish, usage = None, None
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                        if chunk.usage is not None:
                            usage = chunk.usage
                    if finish != "length" or usage is None or usage.completion_tokens != self.max_tokens:
                        self.failures.append(f"client {index}: finish {finish}, usage {usage}")
                    else:
                        self.ok += 1
                except Exception as e:  # any error the client sees is a failed request
                    self.failures.append(f"client {index}: {type(e).__name__}: {e}")
        finally:
            await client.close()

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
