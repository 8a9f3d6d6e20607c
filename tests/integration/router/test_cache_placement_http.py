"""Placement by what each engine holds, end to end through a real router process: scripted mono
engines publish their caches on /v1/kv_events (the contract's own message builders) and answer
completions with their name. A prompt goes where its pages are; when that engine's stream says
the pages are gone (a restart: a new instance, empty), the claim is no longer used; the admin
view shows what the router indexed. The engines' side of the events is the KV-continuity work's;
these scripted ones stand in for it here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from bench.harness.commands import Proc, free_port
from dsv4_wire import kv_events as wire

TOKENS = list(range(1000, 1000 + 16 * 8))  # 8 pages of 16
HELD = [h.hex() for h in wire.page_hashes(TOKENS, 16)]


class Engine:
    def __init__(self, name: str, held: list[str]):
        self.name, self.instance, self.held = name, f"{name}-1", list(held)
        self.port = free_port()
        self.served = 0
        self.restarted = threading.Event()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready():
            return {"ready": True}

        @app.get("/v1/kv_events")
        async def events():
            async def stream():
                yield wire.encode(
                    wire.snapshot_message(
                        self.instance,
                        0,
                        {"device": self.held},
                        model="m",
                        role="mono",
                        page_size=16,
                        boundary_tokens=16,
                    )
                )
                instance = self.instance
                while not (self.restarted.is_set() and instance == f"{self.name}-1"):
                    await asyncio.sleep(0.1)
                    yield wire.encode(wire.heartbeat_message(instance, 0))
                # the process restarted: the stream ends; the next subscription meets the new one
                self.instance, self.held = f"{self.name}-2", []

            return StreamingResponse(stream(), media_type=wire.CONTENT_TYPE)

        @app.post("/v1/chat/completions")
        async def chat(http: Request):
            await http.json()
            self.served += 1
            return {
                "id": "chatcmpl-x",
                "object": "chat.completion",
                "model": "m",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": self.name}, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        @app.post("/v1/completions")
        async def completions(http: Request):
            body = await http.json()
            self.served += 1
            return {
                "id": body.get("rid", "x"),
                "object": "text_completion",
                "model": "m",
                "choices": [{"index": 0, "text": self.name, "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "total_tokens": 2},
            }

        return app


def serve(app: FastAPI, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return server


@contextlib.contextmanager
def running(engines: list[Engine], log_dir, *router_args: str, start_engines: bool = True):
    """The scripted engines (already running where not `start_engines`) and a real router
    process in front of them, every engine followed."""
    servers = [serve(e.app(), e.port) for e in engines] if start_engines else []
    log_dir.mkdir(parents=True, exist_ok=True)
    r_port = free_port()
    args = ["router", "--port", r_port, "--health-interval", "0.5", *router_args]
    for e in engines:
        args += ["--mono", f"http://127.0.0.1:{e.port}"]
    router = Proc(args, log_dir / "router.log")
    try:
        url = f"http://127.0.0.1:{r_port}"
        router.wait_ready(url)
        deadline = time.monotonic() + 20
        while True:  # every engine followed
            ws = httpx.get(f"{url}/admin/workers").json()["workers"]
            if all(w["cache"] and w["cache"].get("fresh") for w in ws):
                break
            assert time.monotonic() < deadline, ws
            time.sleep(0.1)
        yield url
    finally:
        router.stop()
        for s in servers:
            s.should_exit = True


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    engines = [Engine("a", []), Engine("b", HELD), Engine("c", HELD[:2])]
    with running(engines, tmp_path_factory.mktemp("cache")) as url:
        yield url, engines


def test_a_prompt_goes_where_its_pages_are_and_a_lost_claim_is_not_used(fleet):
    url, (a, b, c) = fleet
    answers = [
        httpx.post(f"{url}/v1/completions", json={"prompt": TOKENS + [7, 8], "max_tokens": 1}, timeout=30).json()
        for _ in range(6)
    ]
    assert [r["choices"][0]["text"] for r in answers] == ["b"] * 6
    view = {w["url"]: w["cache"] for w in httpx.get(f"{url}/admin/workers").json()["workers"]}
    assert view[f"http://127.0.0.1:{b.port}"]["pages"]["device"] == 8
    assert view[f"http://127.0.0.1:{c.port}"]["pages"]["device"] == 2
    assert all(v["last_event_age_s"] < 5 for v in view.values())
    # b restarts: its stream ends, the new instance holds nothing; c's two pages now win
    b.restarted.set()
    deadline = time.monotonic() + 20
    while True:
        v = {w["url"]: w["cache"] for w in httpx.get(f"{url}/admin/workers").json()["workers"]}
        bv = v[f"http://127.0.0.1:{b.port}"]
        if bv.get("instance") == "b-2" and bv.get("fresh"):
            break
        assert time.monotonic() < deadline, bv
        time.sleep(0.1)
    got = httpx.post(f"{url}/v1/completions", json={"prompt": TOKENS + [9], "max_tokens": 1}, timeout=30).json()
    assert got["choices"][0]["text"] == "c", json.dumps(got)


def test_with_the_tokenizer_chat_and_text_prompts_are_placed_by_their_pages(tiny_model, tmp_path):
    """`--tokenizer`: the router renders a chat (and tokenizes a text prompt) as the engine
    would, so an engine holding those pages wins them; without it both would go by affinity."""
    from dsv4_serve.chat_prompt import PromptIds

    tokenize = PromptIds(str(tiny_model))
    chat = {
        "messages": [
            {"role": "system", "content": "You are a careful agent. " * 20},
            {"role": "user", "content": "List the files, then read the largest one. " * 4},
        ],
        "max_tokens": 1,
    }
    text = {"prompt": "An agent's long shared task description. " * 30, "max_tokens": 1}
    chat_ids = tokenize("/v1/chat/completions", chat)
    text_ids = tokenize("/v1/completions", text)
    assert len(chat_ids) >= 64 and len(text_ids) >= 64
    held_chat = [h.hex() for h in wire.page_hashes(chat_ids, 16)]
    held_text = [h.hex() for h in wire.page_hashes(text_ids, 16)]
    engines = [Engine("a", []), Engine("b", held_chat), Engine("c", held_text), Engine("d", [])]
    with running(engines, tmp_path, "--tokenizer", str(tiny_model)) as url:
        for _ in range(4):
            got = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).json()
            assert got["choices"][0]["message"]["content"] == "b", json.dumps(got)
            got = httpx.post(f"{url}/v1/completions", json=text, timeout=30).json()
            assert got["choices"][0]["text"] == "c", json.dumps(got)
        # a chat the engine would refuse (no messages) is not the router's to judge: it is sent on
        bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
        assert bad.status_code == 200


def test_two_router_replicas_agree_without_talking_to_each_other(tmp_path):
    """Each replica follows every engine's events on its own: both send a prompt to the engine
    that holds it, with no channel between them."""
    prompts = {name: list(range(base, base + 16 * 6)) for name, base in (("a", 2000), ("b", 3000), ("c", 4000))}
    held = {name: [h.hex() for h in wire.page_hashes(ids, 16)] for name, ids in prompts.items()}
    # a partial overlap: d holds the first two pages of c's prompt, which c holds whole
    engines = [Engine("a", held["a"]), Engine("b", held["b"]), Engine("c", held["c"]), Engine("d", held["c"][:2])]
    with running(engines, tmp_path / "r1") as one, running(engines, tmp_path / "r2", start_engines=False) as two:
        for url in (one, two):
            for name, ids in prompts.items():
                for tail in range(3):
                    got = httpx.post(
                        f"{url}/v1/completions", json={"prompt": ids + [tail], "max_tokens": 1}, timeout=30
                    )
                    assert got.json()["choices"][0]["text"] == name, (url, got.text)
