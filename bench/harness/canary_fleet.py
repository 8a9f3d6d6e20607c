"""What the canary rollout test stands on, besides the emulated API server: engines whose pods a
stand-in StatefulSet controller creates from the live StatefulSets (ordinals at or past the
partition run the latest template; the rest keep theirs), and a router pod.

The engines are fakes with the real engine's HTTP surface for what the probe and the watchdog
read (/v1/models, streamed /v1/completions, /v1/loads, /metrics, /ready): real pods cannot run
here, and a PD pair of real engines per pod would not fit 2 cores. An engine whose image tag
contains "stall" behaves as `--arm-fault stall_long_context`: a request whose prompt passes
STALL_AFTER tokens never gets an answer — a short request passes, the growing conversation does
not. The router stand-in honours what the operator relies on: the pin header (the request goes to
that worker) and POST /admin/workers with "canary" (recorded; a canary takes no unpinned request);
the real router's pin and canary paths are tested in tests/unit/router/test_canary_pin.py.
Both check the tokens the real ones check, from the deployment's auth Secret: an engine's
/v1/loads takes its admin token, the router's pin and /admin/workers its router-admin token
(with set_tokens; before that, nothing is checked)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from typing import Optional

import aiohttp
import aiohttp.web
import httpx

from pathlib import Path

from bench.harness.kmock_cluster import ClusterClient
from bench.harness.operator_runner import free_port

PIN_HEADER = "x-dsv4-pin-worker"
MAX_MODEL_LEN = 2048
STALL_AFTER = 100  # tokens of context past which a "stall" engine's decode hangs
TOKEN_SECONDS = 0.002


def _refused(request: aiohttp.web.Request, token: Optional[str]) -> Optional[aiohttp.web.Response]:
    """A 401 as the real components answer an admin call without their token, else None."""
    if token and request.headers.get("Authorization") != f"Bearer {token}":
        return aiohttp.web.json_response({"error": {"message": "admin token required"}}, status=401)
    return None


class FakeEngine:
    def __init__(self, role: str, image: str, admin_token: Optional[str] = None, port: Optional[int] = None) -> None:
        self.role, self.image, self.admin_token = role, image, admin_token
        self.stall = "stall" in image
        self.port = port or free_port()
        self.running = 0
        self.generated = 0
        self.iterations_t0 = time.monotonic()
        self.requests: list[int] = []  # prompt lengths received
        self._runner: Optional[aiohttp.web.AppRunner] = None
        self._stopping = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FakeEngine":
        app = aiohttp.web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get(
            "/v1/loads", lambda r: _refused(r, self.admin_token) or aiohttp.web.json_response(self.loads())
        )
        app.router.add_get("/metrics", lambda _: aiohttp.web.Response(text=self.metrics()))
        app.router.add_get("/ready", lambda _: aiohttp.web.json_response({"ready": True}))
        app.router.add_get("/health", lambda _: aiohttp.web.json_response({"ok": True}))
        app.router.add_get("/server_info", lambda _: aiohttp.web.json_response({"bootstrap_port": 1}))
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        self._stopping.set()  # a stalled request ends with its pod
        if self._runner is not None:
            await self._runner.cleanup()

    def loads(self) -> dict:
        return {
            "role": self.role,
            "queues": {"waiting": 0, "running": self.running, "prealloc": 0, "transfer": 0},
            "counters": {
                "kv_transfers_completed": 0.0,
                "prompt_tokens": float(sum(self.requests)),
                "generation_tokens": float(self.generated),
                "num_transfer_failed_reqs": 0.0,
                "num_transfer_timeout_reqs": 0.0,
                "scheduler_loop_iterations": round((time.monotonic() - self.iterations_t0) * 50),
            },
            "prefill_inflight_oldest_age_seconds": 0.0,
            "kv_pages_free": 100 - self.running,
            "kv_pages_total": 128,
        }

    def metrics(self) -> str:
        ld = self.loads()
        lab = f'{{model_name="m",role="{self.role}"}}'
        return (
            "\n".join(
                [
                    f"dsv4:num_running_reqs{lab} {self.running}",
                    f"dsv4:num_decode_transfer_queue_reqs{lab} 0",
                    f"dsv4:generation_tokens_total{lab} {self.generated}",
                    f"dsv4:prompt_tokens_total{lab} {ld['counters']['prompt_tokens']}",
                    f"dsv4:scheduler_loop_iterations_total{lab} {ld['counters']['scheduler_loop_iterations']}",
                ]
            )
            + "\n"
        )

    async def _models(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(
            {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": MAX_MODEL_LEN}]}
        )

    async def _completions(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        self.requests.append(len(prompt))
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running += 1
        try:
            for i in range(int(body.get("max_tokens", 16))):
                if self.stall and len(prompt) + i > STALL_AFTER:
                    await self._stopping.wait()  # the decode step that never finishes (while the pod lives)
                    raise ConnectionResetError("the pod went away")
                await asyncio.sleep(TOKEN_SECONDS)
                self.generated += 1
                last = i == int(body.get("max_tokens", 16)) - 1
                choice = {"index": 0, "text": "x", "finish_reason": "length" if last else None}
                chunk = {"id": "c", "object": "text_completion", "choices": [choice]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.running -= 1
        return resp


class FakeRouter:
    def __init__(self) -> None:
        self.port = free_port()
        self.canary: dict[str, bool] = {}  # worker url -> canary flag, as set by the operator
        self.flag_calls: list[tuple[str, bool]] = []
        self.shares: list[tuple[bool, float]] = []  # (canary, canary_percent) as the operator sent them
        self.pinned: list[str] = []
        self.admin_token: Optional[str] = None  # the router-admin token, as the router pod's env has it
        self.refused: list[str] = []  # admin calls without that token
        self._runner: Optional[aiohttp.web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None

    async def start(self) -> "FakeRouter":
        app = aiohttp.web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/admin/workers", self._workers)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _workers(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        refusal = _refused(request, self.admin_token)
        if refusal is not None:
            self.refused.append("/admin/workers")
            return refusal
        body = await request.json()
        self.canary[body["url"]] = bool(body.get("canary"))
        self.flag_calls.append((body["url"], bool(body.get("canary"))))
        self.shares.append((bool(body.get("canary")), float(body.get("canary_percent", 0))))
        return aiohttp.web.json_response({"url": body["url"], "role": body["role"], "canary": body.get("canary")})

    async def _completions(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        pin = request.headers.get(PIN_HEADER)
        if not pin:
            return aiohttp.web.json_response(
                {"error": {"message": "this stand-in routes pinned requests only"}}, status=400
            )
        refusal = _refused(request, self.admin_token)
        if refusal is not None:
            self.refused.append("pin")
            return refusal
        self.pinned.append(pin)
        assert self._session is not None
        async with self._session.post(
            pin + "/v1/completions", data=await request.read(), headers={"Content-Type": "application/json"}
        ) as upstream:
            resp = aiohttp.web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            except aiohttp.ClientPayloadError:
                pass  # the engine's pod went away mid-answer: the client sees a cut stream
            return resp


def template_revision(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


class FakeFleet:
    """The StatefulSet controller and kubelet for one deployment's engine pods, plus a router pod."""

    def __init__(self, client: ClusterClient, namespace: str, name: str, real_router: Optional[dict] = None) -> None:
        """`real_router`: {"logs": folder, "replicas": {role: n}}: the real `dsv4 router` instead of
        the stand-in, its workers the pods at fixed ports (a pod restarts on its port), its
        router-admin token from the Secret."""
        self.client, self.ns, self.name = client, namespace, name
        self.real_router = real_router
        self.ports: dict[str, int] = {}  # pod name -> the port its engine listens on
        self.router_proc = None
        self.engines: dict[str, FakeEngine] = {}  # pod name -> its engine
        self.revisions: dict[str, str] = {}  # pod name -> revision it runs
        self.images: dict[str, str] = {}  # pod name -> image it runs
        self.timeline: list[tuple[float, str, str]] = []  # (monotonic, pod, image) of every pod (re)created
        self.router = FakeRouter()
        self.admin_token: Optional[str] = None  # the engines' token, from the deployment's auth Secret
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> "FakeFleet":
        await self._read_tokens()
        if self.real_router is None:
            await self.router.start()
            router_port = self.router.port
        else:
            router_port = await asyncio.to_thread(self._start_real_router)
        rs = await self.client.create(
            {  # the Deployment controller's ReplicaSet, which controls the router pod
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {"name": f"{self.name}-router-5d8f9c7b6", "namespace": self.ns},
                "spec": {
                    "selector": {"matchLabels": {"serving.dsv4.dev/role": "router"}},
                    "template": {
                        "metadata": {"labels": {"serving.dsv4.dev/role": "router"}},
                        "spec": {"containers": [{"name": "router", "image": "img"}]},
                    },
                },
            },
            "replicasets",
        )
        await self._pod(
            f"{self.name}-router-5d8f9c7b6-x2x7q",
            "router",
            router_port,
            {},
            {"kind": "ReplicaSet", "name": rs["metadata"]["name"], "uid": rs["metadata"]["uid"]},
        )
        self._task = asyncio.create_task(self._loop())
        return self

    async def _read_tokens(self) -> None:
        """The engines and the router take their tokens from the Secret the operator made, as the
        pods' env does (the engines ADMIN_TOKEN_KEY, the router ROUTER_ADMIN_TOKEN_KEY)."""
        deadline = time.monotonic() + 30
        while True:
            secret = await self.client.get("v1", "secrets", self.ns, f"{self.name}-auth")
            if secret is not None:
                break
            if time.monotonic() > deadline:
                raise AssertionError("the operator made no auth Secret")
            await asyncio.sleep(0.1)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        self.admin_token, self.router.admin_token = data["admin-token"], data["router-admin-token"]
        assert self.admin_token != self.router.admin_token, "the Secret gives routers a token of their own"

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for engine in self.engines.values():
            await engine.stop()
        await self.router.stop()
        if self.router_proc is not None:
            await asyncio.to_thread(self.router_proc.stop)

    def _start_real_router(self) -> int:
        from bench.harness.commands import Proc
        from dsv4_wire import ADMIN_TOKEN_ENV

        args = []
        for role, n in self.real_router["replicas"].items():
            for i in range(n):
                port = self.ports.setdefault(f"{self.name}-{role}-{i}", free_port())
                args += [f"--{role}", f"http://127.0.0.1:{port}"]
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self.router_proc = Proc(
            ["router", *args, "--port", port, "--health-interval", 0.5],
            Path(self.real_router["logs"]) / "router.log",
            env={ADMIN_TOKEN_ENV: self.router.admin_token},
        )
        deadline = time.monotonic() + 60
        while True:  # up (its /ready waits for a healthy worker: the engines come after it)
            try:
                if httpx.get(self.router_url + "/metrics", timeout=1.0).status_code == 200:
                    return port
            except httpx.HTTPError:
                pass
            if self.router_proc.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the router did not start:\n{self.router_proc.log()}")
            time.sleep(0.2)

    async def _pod(self, pod: str, role: str, port: int, extra_labels: dict, owner: dict) -> None:
        """`owner`: the controller's ownerReference (kind, name, uid), as the real controllers set it."""
        labels = {
            "app.kubernetes.io/name": "dsv4",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": role,
            "serving.dsv4.dev/role": role,
            **extra_labels,
        }
        meta = {
            "name": pod,
            "namespace": self.ns,
            "labels": labels,
            "ownerReferences": [{"apiVersion": "apps/v1", "controller": True, "blockOwnerDeletion": True, **owner}],
        }
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "containers": [
                    {
                        "name": "engine" if role != "router" else "router",
                        "image": "img",
                        "ports": [{"name": "http", "containerPort": port}],
                    }
                ]
            },
        }
        if await self.client.get("v1", "pods", self.ns, pod) is not None:
            await self.client.delete("v1", "pods", self.ns, pod)
        await self.client.create(body, "pods")
        await self.client.patch(
            "v1",
            "pods",
            self.ns,
            pod,
            {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
            subresource="status",
        )

    async def _loop(self) -> None:
        while True:
            for role in ("prefill", "decode"):
                sts = await self.client.get("apps/v1", "statefulsets", self.ns, f"{self.name}-{role}")
                if sts is not None:
                    await self._reconcile(role, sts)
            await asyncio.sleep(0.1)

    async def _reconcile(self, role: str, sts: dict) -> None:
        spec = sts["spec"]
        template = spec["template"]
        update = template_revision(template)
        image = template["spec"]["containers"][0]["image"]
        n = int(spec.get("replicas", 1))
        partition = int(spec["updateStrategy"]["rollingUpdate"]["partition"])
        for i in range(n):
            pod = f"{self.name}-{role}-{i}"
            if pod not in self.revisions or (i >= partition and self.revisions[pod] != update):
                old = self.engines.pop(pod, None)
                if old is not None:
                    await old.stop()
                engine = await FakeEngine(role, image, self.admin_token, self.ports.get(pod)).start()
                self.engines[pod], self.revisions[pod], self.images[pod] = engine, update, image
                self.timeline.append((time.monotonic(), pod, image))
                await self._pod(
                    pod,
                    role,
                    engine.port,
                    {"controller-revision-hash": update},
                    {"kind": "StatefulSet", "name": sts["metadata"]["name"], "uid": sts["metadata"]["uid"]},
                )
        updated = sum(1 for i in range(n) if self.revisions.get(f"{self.name}-{role}-{i}") == update)
        status = {
            "observedGeneration": sts["metadata"]["generation"],
            "replicas": n,
            "readyReplicas": n,
            "updatedReplicas": updated,
            "availableReplicas": n,
            "updateRevision": update,
            "currentRevision": update if updated == n else (sts.get("status") or {}).get("currentRevision", update),
        }
        if {k: (sts.get("status") or {}).get(k) for k in status} != status:
            await self.client.patch(
                "apps/v1", "statefulsets", self.ns, sts["metadata"]["name"], {"status": status}, subresource="status"
            )

    def images_of(self, role: str) -> list[str]:
        return [self.images.get(f"{self.name}-{role}-{i}", "") for i in range(len(self.roles(role)))]

    def roles(self, role: str) -> list[str]:
        return sorted(p for p in self.images if p.startswith(f"{self.name}-{role}-"))
