"""What the multi-node group tests stand on, beside watchdog_harness: a StatefulSet controller and
kubelet for every StatefulSet of a deployment (the operator's leader StatefulSets and the worker
StatefulSets it makes per group), and a scripted worker node (the node agent's HTTP surface of
`dsv4 serve --node-rank R`), whose rank the test can stop.

The emulator garbage-collects dependents (a worker StatefulSet owned by its leader pod, the workers
owned by it), as kube-controller-manager does; GroupFarm only makes the pods every StatefulSet
asks for, Running and Ready on 127.0.0.1, each on the port of its scripted backend.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

import aiohttp.web

from bench.harness.kmock_cluster import ClusterClient
from bench.harness.operator_runner import free_port
from watchdog_harness import NS, ScriptedEngine, WatchdogCluster


class ScriptedNode:
    """A worker node's agent: /health, /ready, /metrics (the node gauges), /v1/loads, /debug/stacks.
    `stop_rank()` freezes its rank: the heartbeat age grows from then on."""

    def __init__(self, node: int = 1) -> None:
        self.node = node
        self.port = free_port()
        self.calls: list[str] = []
        self.stopped_at: Optional[float] = None
        self._runner: Optional[aiohttp.web.AppRunner] = None

    def reset(self, mode: str = "healthy") -> None:
        self.stopped_at = None

    def stop_rank(self) -> None:
        self.stopped_at = time.monotonic()

    def beat_age(self) -> float:
        return 0.4 if self.stopped_at is None else 0.4 + time.monotonic() - self.stopped_at

    async def start(self) -> "ScriptedNode":
        app = aiohttp.web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _any(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        path = request.path
        if path not in ("/metrics", "/v1/loads", "/ready", "/health"):
            self.calls.append(f"{request.method} {path}")
        labels = '{role="decode",model_name="m"}'
        if path == "/metrics":
            return aiohttp.web.Response(
                text=f"dsv4:nnodes{labels} 2.0\ndsv4:node_rank{labels} {self.node}.0\n"
                f"dsv4:node_group_ready{labels} 1.0\ndsv4:node_ranks_running{labels} 1.0\n"
                f"dsv4:node_rank_beat_age_seconds{labels} {self.beat_age():.3f}\n"
            )
        if path == "/v1/loads":
            return aiohttp.web.json_response(
                {
                    "role": "node",
                    "node_rank": self.node,
                    "ranks": [{"rank": self.node, "beat_age_seconds": self.beat_age()}],
                }
            )
        if path == "/debug/stacks":
            state = "stopped (SIGSTOP)" if self.stopped_at is not None else "in all_reduce"
            return aiohttp.web.Response(
                text=f"=== rank {self.node} (pid 4242) ===\nThread 0x1 (most recent call first):\n  {state}\n"
            )
        return aiohttp.web.json_response({"ok": True})


class LeaderEngine(ScriptedEngine):
    """A group's leader: as the real engine, /ready fails once its group failed (a node lost)."""

    group_failed = False

    def reset(self, mode: str) -> None:
        super().reset(mode)
        self.group_failed = False

    async def _ready(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if self.group_failed:
            return aiohttp.web.json_response({"ready": False, "reason": "tensor-parallel group failed"}, status=503)
        return await super()._ready(request)


Backend = Any  # LeaderEngine | ScriptedNode


class GroupFarm:
    """The StatefulSet controller and kubelet of one deployment: every StatefulSet of it gets the
    pods it asks for (ordinals from spec.ordinals.start), made `delay` s after they are missing,
    each served by `backend(pod name)` (made once per name, kept across incarnations; reset when
    a pod is made anew). Records a timeline of (monotonic, event, pod, uid)."""

    def __init__(self, client: ClusterClient, cluster: WatchdogCluster, deployment: str) -> None:
        self.client, self.cluster, self.deployment = client, cluster, deployment
        self.backends: dict[str, Backend] = {}
        self.delay = 0.2
        self.timeline: list[tuple[float, str, str, str]] = []
        self._seen: set[str] = set()
        self._task: Optional[asyncio.Task] = None
        self._making: set[str] = set()

    async def backend(self, pod: str, role: str, worker: bool) -> Backend:
        if pod not in self.backends:
            self.backends[pod] = await (
                ScriptedNode(int(pod.rsplit("-", 1)[1])) if worker else LeaderEngine(role)
            ).start()
        return self.backends[pod]

    def start(self) -> "GroupFarm":
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for b in self.backends.values():
            await b.stop()

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in self.cluster.objects_of("v1/pods", NS)}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            pods = self.pods()
            for name in self._seen - set(pods):
                self.timeline.append((time.monotonic(), "deleted", name, ""))
                leader = self.backends.get(name.rsplit("-", 1)[0])
                if isinstance(leader, LeaderEngine) and name.rsplit("-", 1)[0] in pods:
                    leader.group_failed = True  # its engine loses a node: the group fails at once
            self._seen = set(pods)
            for sts in self.cluster.objects_of("apps/v1/statefulsets", NS):
                if (sts["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") != self.deployment:
                    continue
                spec = sts["spec"]
                start = int((spec.get("ordinals") or {}).get("start") or 0)
                for ordinal in range(start, start + int(spec.get("replicas", 1))):
                    name = f"{sts['metadata']['name']}-{ordinal}"
                    if name not in pods and name not in self._making:
                        self._making.add(name)
                        asyncio.create_task(self._make(sts, name, ordinal))

    async def _make(self, sts: dict, name: str, ordinal: int) -> None:
        try:
            await asyncio.sleep(self.delay)
            live = await self.client.get("apps/v1", "statefulsets", NS, sts["metadata"]["name"])
            if live is None or live["metadata"]["uid"] != sts["metadata"]["uid"]:
                return  # its StatefulSet went meanwhile
            template = live["spec"]["template"]
            labels = dict(template["metadata"].get("labels") or {})
            worker = labels.get("serving.dsv4.dev/node") == "worker"
            backend = await self.backend(name, labels.get("serving.dsv4.dev/role", "decode"), worker)
            backend.reset("healthy")
            spec = dict(template["spec"])
            containers = [dict(c) for c in spec["containers"]]
            containers[0]["ports"] = [{"name": "http", "containerPort": backend.port, "protocol": "TCP"}]
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NS,
                    "labels": {
                        **labels,
                        "statefulset.kubernetes.io/pod-name": name,
                        "apps.kubernetes.io/pod-index": str(ordinal),
                        "controller-revision-hash": f"{live['metadata']['name']}-{live['metadata'].get('generation', 1)}",
                    },
                    "annotations": dict(template["metadata"].get("annotations") or {}),
                    "ownerReferences": [
                        {
                            "apiVersion": "apps/v1",
                            "kind": "StatefulSet",
                            "name": live["metadata"]["name"],
                            "uid": live["metadata"]["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": {**spec, "containers": containers},
            }
            made = await self.client.create(body, "pods")
            await self.client.patch(
                "v1",
                "pods",
                NS,
                name,
                {
                    "status": {
                        "phase": "Running",
                        "podIP": "127.0.0.1",
                        "conditions": [{"type": "Ready", "status": "True"}],
                        "containerStatuses": [
                            {
                                "name": "engine",
                                "image": containers[0]["image"],
                                "imageID": "",
                                "restartCount": 0,
                                "ready": True,
                                "state": {"running": {"startedAt": "2026-12-07T00:00:00Z"}},
                            }
                        ],
                    }
                },
                subresource="status",
            )
            self.timeline.append((time.monotonic(), "ready", name, made["metadata"]["uid"]))
        except Exception as e:  # a test's stand-in must not die silently
            self.timeline.append((time.monotonic(), "error", name, repr(e)))
        finally:
            self._making.discard(name)

    def ready_at(self, pod: str, after: float) -> Optional[float]:
        return next((t for t, what, name, _ in self.timeline if what == "ready" and name == pod and t > after), None)


def uid_of(pod: Optional[dict]) -> Optional[str]:
    return None if pod is None else pod["metadata"]["uid"]


async def until(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        await asyncio.sleep(interval)
