"""Real processes for migration chaos: one prefill, several decode engines (or mono engines)
and a router, on 127.0.0.1, with helpers to run many greedy streams and compare each with the
undisturbed answer.

A `Stream` is what one client saw: every event's text and id in order, its usage, and how it
ended. Equality with the undisturbed run is checked on the whole text and the completion token
count: text that was repeated or lost would show in both.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp
import httpx

from bench.harness.commands import Proc, free_port, stop_all  # noqa: E402

ENGINE_ARGS = ["--kv-pages", 512, "--page-size", 16, "--max-num-seqs", 64, "--served-model-name", "m"]


@dataclass
class Stream:
    text: str = ""
    ids: set = field(default_factory=set)
    usage: Optional[dict] = None
    finish: Optional[str] = None
    error: Optional[str] = None
    done: bool = False
    events: int = 0
    roles: int = 0  # chat: role chunks seen (exactly one per choice is right)
    texts: dict = field(default_factory=dict)  # per choice index (n > 1)
    finishes: dict = field(default_factory=dict)
    role_per_choice: dict = field(default_factory=dict)
    errors: int = 0  # error events (one at most is right)
    max_gap: float = 0.0  # the longest wait between two events (or for the first), seconds

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and self.finish is not None


async def _one(session: aiohttp.ClientSession, url: str, body: dict, chat: bool, deadline_s: float) -> Stream:
    s = Stream()
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def run() -> None:
        last = time.monotonic()
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                s.error = f"http {r.status}: {(await r.text())[:300]}"
                return
            if not body.get("stream"):
                obj = await r.json()
                s.ids.add(obj["id"])
                s.usage, s.done, s.events = obj["usage"], True, 1
                for c in obj["choices"]:
                    s.texts[c["index"]] = c["message"]["content"] if chat else c["text"]
                    s.finishes[c["index"]] = c["finish_reason"]
                c = obj["choices"][0]
                s.text = c["message"]["content"] if chat else c["text"]
                s.finish = c["finish_reason"]
                return
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                s.max_gap, last = max(s.max_gap, now - last), now
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        s.done = True
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        s.error = str(obj)[:300]
                        s.errors += 1
                        continue
                    s.events += 1
                    s.ids.add(obj.get("id"))
                    if obj.get("usage"):
                        s.usage = obj["usage"]
                    for c in obj.get("choices") or ():
                        j = c.get("index", 0)
                        if chat:
                            delta = c.get("delta") or {}
                            s.roles += "role" in delta
                            s.role_per_choice[j] = s.role_per_choice.get(j, 0) + ("role" in delta)
                            piece = delta.get("content") or ""
                        else:
                            piece = c.get("text") or ""
                        s.text += piece
                        s.texts[j] = s.texts.get(j, "") + piece
                        if c.get("finish_reason"):
                            s.finish = s.finishes[j] = c["finish_reason"]

    try:
        await asyncio.wait_for(run(), deadline_s)
    except asyncio.TimeoutError:
        s.error = "hang"
    except (aiohttp.ClientError, ConnectionError) as e:
        s.error = f"{type(e).__name__}: {e}"
    return s


def body_for(i: int, max_tokens: int, chat: bool = False, **extra) -> dict:
    b = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if chat:
        b["messages"] = [{"role": "user", "content": f"question number {i}: tell me"}]
    else:
        b["prompt"] = [(7 * i + j) % 400 + 3 for j in range(4 + i % 9)]
    return b


def streams(url: str, bodies: list[dict], chat: bool = False, deadline_s: float = 120.0) -> list[Stream]:
    async def go() -> list[Stream]:
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            return list(await asyncio.gather(*(_one(session, url, b, chat, deadline_s) for b in bodies)))

    return asyncio.run(go())


def mismatches(got: list[Stream], want: list[Stream], max_tokens: Optional[int]) -> list[str]:
    """Why each stream is not the undisturbed one: errors, text (per choice), usage, ids, role
    chunks. max_tokens None: the completion count must be the undisturbed run's."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        why = []
        completion = max_tokens if max_tokens is not None else w.usage["completion_tokens"]
        if not g.ok:
            why.append(f"ended badly: done={g.done} finish={g.finish} error={g.error}")
        if g.texts != w.texts:
            why.append(f"text differs: {str(g.texts)[:90]}... vs {str(w.texts)[:90]}...")
        if g.finishes != w.finishes:
            why.append(f"finish reasons {g.finishes} vs {w.finishes}")
        if (
            not g.usage
            or g.usage.get("completion_tokens") != completion
            or g.usage.get("prompt_tokens") != w.usage["prompt_tokens"]
        ):
            why.append(f"usage {g.usage} (want {completion} completion, {w.usage['prompt_tokens']} prompt)")
        if len(g.ids) != 1:
            why.append(f"ids {g.ids}")
        if any(r > 1 for r in g.role_per_choice.values()):
            why.append(f"role chunks per choice {g.role_per_choice}")
        if why:
            bad.append(f"stream {i}: " + "; ".join(why))
    return bad


class Cluster:
    """prefill + N decode engines (or N mono engines) + a router, real processes."""

    def __init__(
        self,
        model: Path,
        tmp: Path,
        *,
        decodes: int = 2,
        prefills: int = 1,
        mono: bool = False,
        secret: str = "mig-secret",
        engine_args=(),
        router_args=(),
        decode_args=(),
    ):
        self.model, self.tmp, self.mono = Path(model), Path(tmp), mono
        self.env = {"DSV4_PD_SECRET": secret}
        self.engine_args = [*ENGINE_ARGS, *engine_args]
        self.procs: dict[str, Proc] = {}
        self.urls: dict[str, str] = {}
        self.ports: dict[str, list] = {}
        self.router: Optional[Proc] = None
        try:
            for i in range(0 if mono else prefills):
                self._engine("prefill" if i == 0 else f"prefill{i}", "prefill", ["--bootstrap-port", free_port()])
            for i in range(decodes):
                self._engine(f"{'mono' if mono else 'decode'}{i}", "mono" if mono else "decode", list(decode_args))
            for name, p in self.procs.items():
                p.wait_ready(self.urls[name], timeout=180)
            self.r_url = f"http://127.0.0.1:{free_port()}"
            role_args = []
            for name, u in self.urls.items():
                role_args += [
                    f"--{'mono' if name.startswith('mono') else 'prefill' if name.startswith('prefill') else 'decode'}",
                    u,
                ]
            self._router_cmd = [
                "router",
                *role_args,
                *("--port", self.r_url.rsplit(":", 1)[1], "--health-interval", 0.5),
                *router_args,
            ]
            self.start_router()
        except BaseException:
            self.stop()
            raise

    def start_router(self) -> None:
        """The router (again, on its port: a restart after it was killed)."""
        if self.router is not None:
            self.router.popen.wait(30)
            self.router.stop()
        self.router = Proc(self._router_cmd, self.tmp / f"router-{time.monotonic_ns()}.log", env=self.env)
        self.router.wait_ready(self.r_url, timeout=60)
        self.router.wait_workers_healthy(self.r_url, len(self.procs), timeout=60)

    def _engine(self, name: str, role: str, extra: list) -> None:
        port, role, extra = self.ports.setdefault(name, [free_port(), role, extra])
        self.urls[name] = f"http://127.0.0.1:{port}"
        self.procs[name] = Proc(
            ["serve", "--model", self.model, "--role", role, *self.engine_args, "--port", port, *extra],
            self.tmp / f"{name}-{time.monotonic_ns()}.log",
            env=self.env,
        )

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """The same engine again (same port and flags) after it died."""
        self.procs[name].popen.wait(30)
        self.procs[name].stop()
        self._engine(name, "", [])
        self.procs[name].wait_ready(self.urls[name], timeout=timeout)

    def engine_urls(self) -> list[str]:
        return list(self.urls.values())

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        os.kill(p.popen.pid, sig)

    def running(self, name: str) -> int:
        try:
            return httpx.get(f"{self.urls[name]}/v1/loads", timeout=5).json()["queues"].get("running", 0)
        except httpx.HTTPError:
            return 0

    def wait_running(self, name: str, at_least: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.running(name) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never ran {at_least} requests\n{self.logs()}")
            time.sleep(0.05)

    def metric(self, name: str) -> str:
        return httpx.get(f"{self.r_url}/metrics", timeout=5).text

    def stop(self) -> None:
        stop_all([self.router, *self.procs.values()])

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{p.log()}" for name, p in [("router", self.router), *self.procs.items()] if p is not None
        )


def idle(url: str, headers: Optional[dict] = None) -> bool:
    ld = httpx.get(f"{url}/v1/loads", timeout=5, headers=headers).json()
    return sum(ld["queues"].values()) == 0 and ld["kv_pages_free"] == ld["kv_pages_total"]


def wait_idle(urls: list[str], timeout: float = 30.0, headers: Optional[dict] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(idle(u, headers) for u in urls):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    loads = [httpx.get(u + "/v1/loads", headers=headers).json() for u in urls]
    raise TimeoutError(f"engines not idle after {timeout}s: {loads}")


class LocalUp:
    """`dsv4 up` as a real process (router, engines, supervisor and watchdog)."""

    def __init__(self, model: Path, tmp: Path, *args, port: Optional[int] = None):
        from bench.harness.commands import free_port_block

        self.port = port or free_port_block()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = tmp / "cache" / "up" / str(self.port)
        self.proc = Proc(
            [
                "up",
                "--model",
                model,
                "--port",
                self.port,
                "--evidence-dir",
                tmp / "evidence",
                "--engine-arg=--kv-pages=512",
                "--engine-arg=--page-size=16",
                *args,
            ],
            tmp / "up.log",
            env={"DSV4_CACHE": str(tmp / "cache"), "COLUMNS": "200"},
        )
        try:
            self.proc.wait_ready(self.url, timeout=180)
            deadline = time.monotonic() + 60
            while "admin token:" not in self.proc.log():  # printed once every engine is ready
                if time.monotonic() > deadline:
                    raise TimeoutError(self.proc.log())
                time.sleep(0.2)
        except BaseException:
            self.proc.stop()
            raise

    @property
    def admin(self) -> dict:
        return {"Authorization": f"Bearer {(self.state / 'admin-token').read_text().strip()}"}

    def processes(self) -> dict:
        return json.loads((self.state / "processes.json").read_text())

    def engine_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.processes()[key]['port']}"

    def stop(self) -> None:
        self.proc.stop()
