"""`dsv4 serve --tp-size 2 --speculative-algorithm mtp` as real processes over HTTP: concurrent
greedy requests get the tokens a one-rank engine without speculation gives, mono and PD with a
tp-2 speculating prefill (its ranks run the MTP block over the prompt together; rank 0's pool
sends the block's state with the rest) into a one-rank speculating decode, behind the router over
real NIXL. The in-process tests (tests/unit/parallel/test_tp_spec_decode.py, PD into a tp-2 decode
in tests/unit/engine/test_spec_decode_pd.py) cover acceptance, rollback and aborts; this is the
end to end."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.harness.commands import Proc, free_port, stop_all

pytestmark = pytest.mark.slow  # six engine processes and a router on two cores: about a minute

COMMON = ["--kv-pages", 64, "--page-size", 16, "--served-model-name", "m", "--device", "cpu"]
SPEC = ["--speculative-algorithm", "mtp", "--speculative-num-steps", 2]


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("tp-spec") / "tiny-mtp", preset="tiny", seed=0, mtp=True)


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def answers(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: one batch with rows of every kind
        return list(pool.map(lambda p: complete(url, p, 12), prompts))


def test_tp2_speculation_over_http_mono_and_pd_equals_one_rank_plain(tiny_mtp, tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 19, 33, 8)]
    ports = [free_port() for _ in range(6)]
    mono, tp_mono, prefill, boot, decode, router = ports
    url = {name: f"http://127.0.0.1:{p}" for name, p in zip(("mono", "tp", "p", "b", "d", "r"), ports)}
    procs = [
        Proc(["serve", "--model", tiny_mtp, *COMMON, "--port", mono], tmp_path / "mono.log"),
        Proc(["serve", "--model", tiny_mtp, *COMMON, *SPEC, "--tp-size", 2, "--port", tp_mono], tmp_path / "tp.log"),
        Proc(
            ["serve", "--model", tiny_mtp, *COMMON, *SPEC, "--role", "prefill", "--tp-size", 2]
            + ["--port", prefill, "--bootstrap-port", boot],
            tmp_path / "prefill.log",
        ),
        Proc(["serve", "--model", tiny_mtp, *COMMON, *SPEC, "--role", "decode", "--port", decode], tmp_path / "d.log"),
        Proc(["router", "--prefill", url["p"], "--decode", url["d"], "--port", router], tmp_path / "router.log"),
    ]
    try:
        for name, proc in zip(("mono", "tp", "p", "d", "r"), procs):
            proc.wait_ready(url[name], timeout=300)
        want = answers(url["mono"], prompts)
        assert answers(url["tp"], prompts) == want
        assert answers(url["r"], prompts) == want
        loads = httpx.get(f"{url['tp']}/v1/loads").json()
        assert loads["tp_size"] == 2 and loads["speculative"]["num_steps"] == 2
        assert loads["speculative"]["mean_acceptance_length"] is not None  # it verified drafts
        assert httpx.get(f"{url['d']}/v1/loads").json()["speculative"]["mean_acceptance_length"] is not None
    finally:
        stop_all(procs)
