"""What the watchdog's integration tests stand on: the API server with a kubelet's pods/log and
DELETE preconditions, scripted engines, a StatefulSet controller and kubelet for the tests' pods,
and small readers of the resource, its Events and evidence.

Besides the shared emulator (bench/harness/kmock_cluster.py) this adds the API server
behaviours the watchdog relies on: DELETE honours `preconditions.uid` (409 on a mismatch);
pods/log serves text for pods whose log the test registers (other pods get kmock's own answer,
the Pod object, which is the "no logs served" case the operator must survive); and the
policy/v1 Eviction subresource (POST pods/NAME/eviction), which deletes the pod unless a
PodDisruptionBudget selecting it allows no disruption now (429, as the API server answers), with
`deleteOptions.preconditions.uid` honoured (409).
"""

from __future__ import annotations

import asyncio
import time

import httpx
from typing import Any, Callable, Optional

import aiohttp.web
import attrs
import kmock

from bench.harness.kmock_cluster import ClusterClient, KubeCluster
from bench.harness.operator_runner import free_port

API = "serving.dsv4.dev/v1alpha1"
PLURAL = "dsv4deployments"
NS = "serving"


# ---- The API server, with a kubelet's pods/log and DELETE preconditions --------------------------


@attrs.define(kw_only=True)
class WatchdogCluster(KubeCluster):
    pod_logs: dict = attrs.field(factory=dict, init=False)  # (namespace, pod) -> () -> str
    removed: list = attrs.field(factory=list, init=False)  # (monotonic time, object) of every deletion
    evictions: list = attrs.field(factory=list, init=False)  # (pod name, HTTP status) of every eviction
    throttled: int = attrs.field(default=0, init=False)  # this many next requests get API Priority and Fairness' 429

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        res = request.resource
        method = str(request.method.value)
        if res is not None and res.plural == "pods" and request.name:
            key = (request.namespace, request.name)
            if method == "GET" and request.subresource == "log":
                live = self._live((res, request.namespace, request.name))
                names = [c.get("name") for c in ((live or {}).get("spec") or {}).get("containers") or []]
                chosen = request.params.get("container")
                if live is not None and ((len(names) > 1 and not chosen) or (chosen and chosen not in names)):
                    # As the API server: a pod of several containers needs container=, a wrong one is a 400.
                    self.recorder.record(request)
                    return await self._render_error(
                        kmock.KubernetesError(
                            400,
                            "BadRequest",
                            f"a container name must be specified for pod {request.name}, choose one of: {names}"
                            if not chosen
                            else f"container {chosen} is not valid for pod {request.name}",
                        )
                    )
            if method == "GET" and request.subresource == "log" and key in self.pod_logs:
                self.recorder.record(request)
                lines = self.pod_logs[key]().splitlines(keepends=True)
                tail = request.params.get("tailLines")
                return aiohttp.web.Response(
                    text="".join(lines[-int(tail) :] if tail else lines), content_type="text/plain"
                )
            if method == "POST" and request.subresource == "eviction" and self.throttled > 0:
                self.throttled -= 1  # the API server sheds load: a 429 that no PodDisruptionBudget asked for
                self.recorder.record(request)
                self.evictions.append((request.name, 429))
                return await self._render_error(
                    kmock.KubernetesError(429, "TooManyRequests", "Too many requests, please try again later.")
                )
            if method == "POST" and request.subresource == "eviction":
                self.recorder.record(request)
                status, body = await self._evict(request.namespace, request.name, request.data)
                self.evictions.append((request.name, status))
                if status >= 400:
                    return await self._render_error(kmock.KubernetesError(status, body[0], body[1]))
                return aiohttp.web.json_response(body, status=status)
            if method == "DELETE" and isinstance(request.data, dict):
                wanted = (request.data.get("preconditions") or {}).get("uid")
                live = self._live((res, request.namespace, request.name))
                if wanted and live is not None and live["metadata"].get("uid") != wanted:
                    self.recorder.record(request)
                    return await self._render_error(
                        kmock.KubernetesError(
                            409,
                            "Conflict",
                            f"Precondition failed: UID in precondition: {wanted}, "
                            f"UID in object meta: {live['metadata'].get('uid')}",
                        )
                    )
        return await super()._handle(request)

    async def _evict(self, namespace: str, name: str, eviction: Any) -> tuple[int, Any]:
        pods = kmock.resource("v1", "pods")
        async with self._lock:
            live = self._live((pods, namespace, name))
            if live is None:
                return 404, ("NotFound", f'pods "{name}" not found')
            wanted = ((eviction or {}).get("deleteOptions") or {}).get("preconditions", {}).get("uid")
            if wanted and live["metadata"].get("uid") != wanted:
                return 409, ("Conflict", f"Precondition failed: UID in precondition: {wanted}")
            for pdb in self.objects_of("policy/v1/poddisruptionbudgets", namespace):
                if not _pdb_allows(pdb, live, self.objects_of(pods, namespace)):
                    return 429, (
                        "TooManyRequests",
                        f"Cannot evict pod as it would violate the pod's disruption budget {pdb['metadata']['name']}.",
                    )
            await self._delete((pods, namespace, name))
        return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    async def _remove(self, key: tuple) -> None:
        live = self._live(key)
        if live is not None:
            self.removed.append((time.monotonic(), live))
        await super()._remove(key)

    def removed_pods(self) -> list[tuple[float, dict]]:
        return [(t, o) for t, o in self.removed if o.get("kind") == "Pod"]


def _ready(pod: dict) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _pdb_allows(pdb: dict, pod: dict, pods: list[dict]) -> bool:
    """The disruption controller's arithmetic for one PDB (matchLabels selectors, integer or
    percentage minAvailable / maxUnavailable; an unhealthy pod may go while the budget holds)."""
    selector = ((pdb.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    labels = pod["metadata"].get("labels") or {}
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        return True
    matching = [p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
    healthy = sum(_ready(p) for p in matching)
    spec = pdb["spec"]

    def count(value: Any) -> int:
        if isinstance(value, str) and value.endswith("%"):
            return -(-int(value[:-1]) * len(matching) // 100)
        return int(value)

    if "minAvailable" in spec:
        desired = count(spec["minAvailable"])
    else:
        desired = len(matching) - count(spec.get("maxUnavailable", 1))
    if not _ready(pod):
        return healthy >= desired
    return healthy - 1 >= desired


# ---- Scripted engines ---------------------------------------------------------------------------


class ScriptedEngine:
    """A stand-in for one engine's HTTP surface (/metrics, /v1/loads, /ready, /health, the admin
    endpoints), on 127.0.0.1, whose state the test sets: healthy and idle, wedged (a request
    pinned in the prefill inflight queue while the loop keeps iterating — the incident), a long
    prefill (running, prompt tokens growing, nothing inflight), or a busy decode. It stands in
    for many engine states cheaply; the real engine's wedge is reproduced in
    test_watchdog_real_engines.py. An abort empties it, as the real engine's abort does."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.port = free_port()
        self.calls: list[tuple[float, str, str]] = []  # (monotonic, method, path) of all but the scrapes
        self.scrapes = 0
        self.abort_gate: Optional[asyncio.Event] = None  # set: /admin/abort waits until it opens
        self.abort_started = asyncio.Event()
        self._runner: Optional[aiohttp.web.AppRunner] = None
        self.reset("healthy")

    def reset(self, mode: str) -> None:
        """A new engine incarnation (counters from zero) in ``mode``."""
        self.mode = mode
        self.t0 = self.since = time.monotonic()
        self.transfers = 0.0

    def set_mode(self, mode: str) -> None:
        if mode != self.mode:
            self.transfers += 3  # some hand-offs completed before
            self.mode, self.since = mode, time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def loads(self) -> dict[str, Any]:
        now = time.monotonic()
        up = now - self.t0
        since = now - self.since
        queues = (
            {"waiting": 0, "running": 0, "bootstrap": 0, "inflight": 0}
            if self.role == "prefill"
            else {"waiting": 0, "running": 0, "prealloc": 0, "transfer": 0}
        )
        counters = {
            "kv_transfers_completed": self.transfers,
            "prompt_tokens": 0.0,
            "generation_tokens": 0.0,
            "num_transfer_failed_reqs": 0.0,
            "num_transfer_timeout_reqs": 0.0,
            "scheduler_loop_iterations": round(up * 50),
        }
        age = 0.0
        if self.mode == "wedged":
            queues["inflight" if self.role == "prefill" else "transfer"] = 1
            age = since if self.role == "prefill" else 0.0
        elif self.mode == "long_prefill":
            queues["running"] = 1
            counters["prompt_tokens"] = round(since * 400)
        elif self.mode == "busy_decode":
            queues["running"] = 4
            counters["generation_tokens"] = round(since * 120)
            counters["kv_transfers_completed"] = self.transfers + round(since * 2)
        return {
            "role": self.role,
            "queues": queues,
            "counters": counters,
            "prefill_inflight_oldest_age_seconds": age,
            "kv_pages_free": 100,
            "kv_pages_total": 128,
        }

    def metrics(self) -> str:
        ld = self.loads()
        labels = f'{{model_name="m",role="{self.role}"}}'
        lines = [f"dsv4:num_running_reqs{labels} {ld['queues']['running']}"]
        if self.role == "prefill":
            lines.append(f"dsv4:num_prefill_inflight_queue_reqs{labels} {ld['queues']['inflight']}")
            lines.append(
                f"dsv4:prefill_inflight_oldest_age_seconds{labels} {ld['prefill_inflight_oldest_age_seconds']}"
            )
        else:
            lines.append(f"dsv4:num_decode_transfer_queue_reqs{labels} {ld['queues']['transfer']}")
        names = {
            "kv_transfers_completed": "kv_transfers_completed_total",
            "prompt_tokens": "prompt_tokens_total",
            "generation_tokens": "generation_tokens_total",
            "scheduler_loop_iterations": "scheduler_loop_iterations_total",
        }
        lines += [f"dsv4:{names[k]}{labels} {v}" for k, v in ld["counters"].items() if k in names]
        return "\n".join(lines) + "\n"

    async def start(self) -> "ScriptedEngine":
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/ready", self._ready)
        app.router.add_route("*", "/{tail:.*}", self._admin)  # everything else is recorded
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        self.scrapes += 1
        return aiohttp.web.Response(text=self.metrics())

    async def _ready(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"ready": True})

    async def _loads(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(self.loads())

    async def _admin(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.calls.append((time.monotonic(), request.method, request.path))
        if request.path == "/debug/stacks":
            return aiohttp.web.Response(text=f"--- thread dsv4-engine-loop ---\n  scripted {self.role} engine\n")
        if request.path in ("/admin/abort", "/abort_request"):
            self.abort_started.set()
            if self.abort_gate is not None:
                await self.abort_gate.wait()
            self.set_mode("healthy")
            return aiohttp.web.json_response({"aborted": "all"})
        return aiohttp.web.json_response({"ok": True})

    def admin_calls(self) -> list[str]:
        return [path for _, _, path in self.calls]


# ---- Pods: a StatefulSet controller and kubelet for the tests ----------------------------------------


def pod_body(
    deployment: str, name: str, role: str, port: int, sidecar: bool = False, owner: Optional[dict] = None
) -> dict:
    """`sidecar`: a second container, as a service mesh or log shipper injects (pods/log then needs
    container=). `owner`: the StatefulSet that controls the pod (the watchdog and the router take
    only pods their deployment's StatefulSets control)."""
    containers = [{"name": "engine", "image": "reg/dsv4:1", "ports": [{"name": "http", "containerPort": port}]}]
    if sidecar:
        containers.append({"name": "istio-proxy", "image": "istio/proxyv2:1"})
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "labels": {
            "app.kubernetes.io/name": "dsv4",
            "app.kubernetes.io/instance": deployment,
            "serving.dsv4.dev/role": role,
        },
    }
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": containers}}


async def owner_statefulset(
    client: ClusterClient, deployment_name: str, role: str, *, wait: float = 20.0, own: bool = False
) -> dict:
    """The StatefulSet `<deployment>-<role>` that controls the test's pods, as the real controller's
    pods carry it: the operator's, once applied (waited for up to `wait` seconds); with `own` (no
    operator, or pods before their resource), one made here if there is none yet."""
    from dsv4_operator.manifests import Owner, engine_statefulset
    from dsv4_operator.spec import parse_spec

    name = f"{deployment_name}-{role}"
    deadline = time.monotonic() + (0 if own else wait)
    while True:
        live = await client.get("apps/v1", "statefulsets", NS, name)
        if live is not None:
            return live
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    if not own:
        raise AssertionError(f"the operator did not make StatefulSet {name} within {wait}s")
    body = engine_statefulset(
        parse_spec(deployment(deployment_name, remediation={})["spec"]), Owner(deployment_name, NS, "none"), role
    )
    del body["metadata"]["ownerReferences"]  # no resource yet: the garbage collector would take it
    return await client.create(body, "statefulsets")


class PodFarm:
    """Creates engine pods that are Running and Ready at 127.0.0.1:<port>, and — standing in for
    the StatefulSet controller — recreates a deleted pod (same name, new UID) after
    ``recreate_after`` seconds, calling ``on_recreate(name)`` first (a new pod is a new engine)."""

    def __init__(self, client: ClusterClient, cluster: WatchdogCluster, deployment: str) -> None:
        self.client, self.cluster, self.deployment = client, cluster, deployment
        self.pods: dict[str, tuple[str, int]] = {}  # name -> (role, port)
        self.recreate_after: Optional[float] = None
        self.own_statefulsets = False  # True: make the owning StatefulSet instead of waiting for the operator's
        self.on_recreate: Callable[[str], None] = lambda name: None
        self.timeline: list[tuple[float, str, str]] = []  # (monotonic, "deleted"|"ready", pod)
        self._task: Optional[asyncio.Task] = None

    async def add(self, name: str, role: str, port: int) -> dict:
        self.pods[name] = (role, port)
        owner = await owner_statefulset(self.client, self.deployment, role, own=self.own_statefulsets)
        await self.client.create(pod_body(self.deployment, name, role, port, owner=owner), "pods")
        pod = await self.client.patch(
            "v1",
            "pods",
            NS,
            name,
            {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
            subresource="status",
        )
        self.timeline.append((time.monotonic(), "ready", name))
        return pod

    def start(self) -> "PodFarm":
        self._task = asyncio.create_task(self._controller())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _controller(self) -> None:
        seen = 0
        while True:
            await asyncio.sleep(0.05)
            removed = self.cluster.removed_pods()
            for when, obj in removed[seen:]:
                name = obj["metadata"]["name"]
                if name in self.pods:
                    self.timeline.append((when, "deleted", name))
                    if self.recreate_after is not None:
                        asyncio.create_task(self._recreate(name))
            seen = len(removed)

    async def _recreate(self, name: str) -> None:
        await asyncio.sleep(self.recreate_after or 0)
        self.on_recreate(name)
        role, port = self.pods[name]
        await self.add(name, role, port)

    async def get(self, name: str) -> Optional[dict]:
        return await self.client.get("v1", "pods", NS, name)


# ---- The operator ---------------------------------------------------------------------------------


# ---- Resources ------------------------------------------------------------------------------------


def deployment(name: str, *, remediation: dict, decode_env: Optional[list] = None) -> dict:
    spec: dict[str, Any] = {
        "model": {"name": "m", "path": "/models/m"},
        "engine": {"image": "reg/dsv4:1"},
        "remediation": {"scrapeIntervalSeconds": 0.5, "detectionWindowSeconds": 2, "cooldownSeconds": 0, **remediation},
    }
    if decode_env is not None:
        spec["decode"] = {"env": decode_env}
    return {"apiVersion": API, "kind": "DSV4Deployment", "metadata": {"name": name, "namespace": NS}, "spec": spec}


async def get_cr(client: ClusterClient, name: str) -> dict:
    return await client.get(API, PLURAL, NS, name)


def condition(cr: Optional[dict], ctype: str = "Wedged") -> dict:
    for c in ((cr or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return {}


def events(cluster: KubeCluster, name: str, reason: Optional[str] = None) -> list[dict]:
    found = [e for e in cluster.objects_of("v1/events", NS) if e["involvedObject"].get("name") == name]
    return [e for e in found if reason is None or e["reason"] == reason]


def evidence_maps(cluster: KubeCluster) -> list[dict]:
    return [
        c
        for c in cluster.objects_of("v1/configmaps", NS)
        if (c["metadata"].get("labels") or {}).get("serving.dsv4.dev/evidence") == "true"
    ]


def operator_calls(cluster: KubeCluster, verb: str, resource: str) -> list:
    """The operator's (not the tests') calls of one verb on one resource."""
    return [
        c
        for c in cluster.recorder.calls
        if c.verb == verb and c.resource == resource and not c.agent.startswith(("dsv4-tests", "kmock/"))
    ]


# ---- Router pods (their Deployment's ReplicaSet, stood in for) ----------------------------------


async def replicaset(client: ClusterClient, deployment_name: str = "edge") -> dict:
    """The ReplicaSet the router Deployment's controller would make (the emulator has no controllers)."""
    labels = {
        "app.kubernetes.io/name": "dsv4",
        "app.kubernetes.io/instance": deployment_name,
        "serving.dsv4.dev/role": "router",
    }
    body = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"{deployment_name}-router-5d9f", "namespace": NS, "labels": labels},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "router", "image": "r"}]}},
        },
    }
    return await client.create(body, "replicasets")


async def router_pod(client: ClusterClient, name: str, port: int, rs: dict, deployment_name: str = "edge") -> dict:
    """A router pod as its Deployment's ReplicaSet makes it, Running and Ready at 127.0.0.1:port."""
    meta = {
        "name": name,
        "namespace": NS,
        "labels": {
            "app.kubernetes.io/name": "dsv4",
            "app.kubernetes.io/instance": deployment_name,
            "serving.dsv4.dev/role": "router",
        },
        "ownerReferences": [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": rs["metadata"]["name"],
                "uid": rs["metadata"]["uid"],
                "controller": True,
            }
        ],
    }
    containers = [{"name": "router", "image": "reg/dsv4:1", "ports": [{"name": "http", "containerPort": port}]}]
    await client.create(
        {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": containers}}, "pods"
    )
    status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    return await client.patch("v1", "pods", NS, name, {"status": status}, subresource="status")


def wait_metrics(url: str, router: Any) -> None:
    """Serving (its /ready says no engine is: none is behind it, and none need be for this test)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/metrics", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert router.popen.poll() is None, router.log()
        time.sleep(0.2)
    raise TimeoutError(router.log())
