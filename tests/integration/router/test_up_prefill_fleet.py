"""Placement by what each engine holds, on real engines started by `dsv4 up --prefill 2`: the
rounds of growing conversations (distinct starts, and a broadcast task: one system prompt and
first message for several agents, diverging afterwards) land on the prefill that holds their
prefix, so the cached share equals what one prefill engine gets on the same workload. Then one
prefill is killed (`kill -9`; `dsv4 up` restarts it): no client sees an error, the router drops
what it had indexed for the old process (a new instance, pages back to what the new one
publishes), and the conversations it held find their prefix again within a round."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from bench.harness.commands import Proc, free_port_block

CONVERSATIONS = 8  # 4 distinct starts, 4 agents of one broadcast task
ROUNDS_BEFORE, ROUNDS_AFTER = 3, 3
WORDS = "file line error build test pass module import value return object list patch diff tool call".split()


def _text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13 + i * i) % len(WORDS)] for i in range(n))


def _starts() -> list[list[dict]]:
    out = []
    for c in range(CONVERSATIONS):
        if c < CONVERSATIONS // 2:
            out.append([{"role": "system", "content": _text(c, 60)}, {"role": "user", "content": _text(c + 50, 20)}])
        else:  # the broadcast task: same system prompt and first message for every agent
            out.append([{"role": "system", "content": _text(99, 60)}, {"role": "user", "content": _text(98, 20)}])
    return out


class Up:
    def __init__(self, tmp: Path, model: Path, prefill: int):
        # the router, the prefills, decode; a bootstrap port per prefill
        port = free_port_block((*range(prefill + 2), *range(100, 100 + prefill)))
        tmp.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{port}"
        self.state = tmp / "cache" / "up" / str(port)
        self.proc = Proc(
            ["up", "--model", model, "--port", port, "--prefill", prefill, "--no-watchdog"],
            tmp / "up.log",
            env={"DSV4_CACHE": str(tmp / "cache"), "COLUMNS": "80"},
        )
        self.proc.wait_ready(self.url, timeout=180)
        deadline = time.monotonic() + 120
        while "admin token:" not in self.proc.log():  # printed once every engine is ready
            assert time.monotonic() < deadline, self.proc.log()
            time.sleep(0.3)
        self.admin = {"Authorization": f"Bearer {(self.state / 'admin-token').read_text().strip()}"}
        self.model = model.name  # `dsv4 up` serves it under its folder's name
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def processes(self) -> dict:
        return json.loads((self.state / "processes.json").read_text())

    def workers(self) -> dict[str, dict]:
        r = httpx.get(f"{self.url}/admin/workers", headers=self.admin, timeout=10)
        return {w["url"]: w for w in r.json()["workers"]}

    def wait_synced(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ws = [w for w in self.workers().values() if w["role"] == "prefill"]
            if all(w["cache"] and w["cache"].get("synced") and w["cache"].get("fresh") for w in ws):
                return
            assert time.monotonic() < deadline, ws
            time.sleep(0.3)


def _round(up: Up, convs: list[list[dict]], rnd: int) -> tuple[int, int]:
    """One round of every conversation: (cached prompt tokens, prompt tokens)."""
    cached = total = 0
    for c, msgs in enumerate(convs):
        if rnd > 0:  # the agents diverge from their second round on
            msgs.append({"role": "user", "content": f"step {rnd} of agent {c}: " + _text(c * 10 + rnd, 24)})
        r = up.client.chat.completions.create(model=up.model, messages=msgs, max_tokens=6, temperature=0)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        cached += r.usage.prompt_tokens_details.cached_tokens or 0
        total += r.usage.prompt_tokens
    return cached, total


def _share(rounds: list[tuple[int, int]]) -> float:
    return sum(c for c, _ in rounds) / sum(t for _, t in rounds)


@pytest.mark.slow  # ~3 min (2 prefills), ~5 (4): two `dsv4 up` fleets of real engines on 2 shared cores
@pytest.mark.parametrize("n", [2, 4])
def test_prefills_cache_as_one_and_a_restarted_one_loses_its_claims(tiny_model, tmp_path, n):
    # ---- one prefill: the share to match ----
    one = Up(tmp_path / "one", tiny_model, 1)
    try:
        one.wait_synced()
        convs = _starts()
        single = [_round(one, convs, r) for r in range(ROUNDS_BEFORE + 1 + ROUNDS_AFTER)]
    finally:
        one.proc.stop()
    # ---- n prefills ----
    two = Up(tmp_path / "two", tiny_model, n)
    try:
        two.wait_synced()
        convs = _starts()
        before = [_round(two, convs, r) for r in range(ROUNDS_BEFORE)]
        prefills = {u: w for u, w in two.workers().items() if w["role"] == "prefill"}
        held = {u: sum(w["cache"]["pages"].values()) for u, w in prefills.items()}
        assert sum(1 for v in held.values() if v > 0) >= min(n, 2), held  # conversations spread out
        # later rounds are placed where the conversation is: the same share as one engine
        assert _share(before[1:]) >= 0.97 * _share(single[1:ROUNDS_BEFORE]), (before, single)

        url = max(held, key=held.get)  # the prefill holding the most: its claims are what a restart loses
        victim = next(
            p for k, p in two.processes().items() if k.startswith("prefill") and url.endswith(f":{p['port']}")
        )
        old = prefills[url]["cache"]
        os.kill(victim["pid"], signal.SIGKILL)
        # a round while it is gone: placed elsewhere, no client error (a raise fails the test)
        during = _round(two, convs, ROUNDS_BEFORE)
        deadline = time.monotonic() + 90
        while True:  # back (restarted by `dsv4 up`) and indexed as a new, empty instance
            cache = two.workers()[url]["cache"]
            if cache.get("synced") and cache.get("instance") != old["instance"]:
                break
            assert time.monotonic() < deadline, (cache, two.proc.log()[-3000:])
            time.sleep(0.3)
        assert cache["restarts"] >= 1 and sum(cache["pages"].values()) < held[url], (cache, held)
        after = [_round(two, convs, r) for r in range(ROUNDS_BEFORE + 1, ROUNDS_BEFORE + 1 + ROUNDS_AFTER)]
        # the conversations it held were recomputed once (the round while it was gone), then
        # found their prefix again: the share after equals one engine's on the same rounds
        assert _share(after) >= 0.97 * _share(single[ROUNDS_BEFORE + 1 :]), (after, single, during)
        print(
            "cached share: one prefill",
            round(_share(single[1:]), 3),
            f"{n} prefills before/during/after the kill",
            round(_share(before[1:]), 3),
            round(_share([during]), 3),
            round(_share(after), 3),
        )
    finally:
        two.proc.stop()
