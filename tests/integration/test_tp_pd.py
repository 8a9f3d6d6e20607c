"""PD with tensor parallelism on either side, same or different sizes (prefill 2 -> decode 2,
2 -> 1 and 1 -> 2), behind the real router over real NIXL: the same greedy tokens as a monolithic
engine, for DeepSeek-V3 at the real latent width (mla512) and V4.

Every rank keeps the full latent cache (V4: its single KV head, window ring and compressor
stages), so prefill's rank 0 writes each request's state into EVERY decode rank's own pool, one
transfer per rank (pd.rank_pools): each decode rank's bytes are reported, prefill's count for that
rank matches, and a write that fails on one rank fails the request cleanly on both sides."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from bench.harness.commands import Proc, free_port, stop_all


class Pair:
    """A prefill and a decode engine of the given TP sizes, and a router in front of them."""

    def __init__(self, model, tmp, prefill_tp: int, decode_tp: int, prefill_args=()):
        self.procs: list[Proc] = []
        p, b, d, r = (free_port() for _ in range(4))
        self.p_url, self.d_url, self.url = (f"http://127.0.0.1:{x}" for x in (p, d, r))
        common = [
            "serve",
            "--model",
            model,
            "--kv-pages",
            64,
            "--page-size",
            16,
            "--served-model-name",
            "m",
            "--device",
            "cpu",
        ]
        self.procs.append(
            Proc(
                [
                    *common,
                    *prefill_args,
                    "--role",
                    "prefill",
                    "--port",
                    p,
                    "--bootstrap-port",
                    b,
                    "--tp-size",
                    prefill_tp,
                ],
                tmp / f"prefill-tp{prefill_tp}.log",
            )
        )
        self.procs.append(
            Proc([*common, "--role", "decode", "--port", d, "--tp-size", decode_tp], tmp / f"decode-tp{decode_tp}.log")
        )
        self.procs.append(
            Proc(
                ["router", "--prefill", self.p_url, "--decode", self.d_url, "--port", r, "--health-interval", "0.5"],
                tmp / f"router-{prefill_tp}-{decode_tp}.log",
            )
        )

    def wait(self) -> None:
        for url, proc in zip((self.p_url, self.d_url, self.url), self.procs):
            proc.wait_ready(url, timeout=180)

    def stop(self) -> None:
        stop_all(self.procs)


def loads(url: str) -> dict:
    return httpx.get(f"{url}/v1/loads", timeout=5).json()


def bytes_by_rank(url: str) -> dict[str, int]:
    return loads(url).get("kv_transfer_bytes_by_rank", {})


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}


def assert_every_rank_received(prefill: dict, decode: dict, decode_tp: int) -> None:
    """Each decode rank's pool received the whole state from prefill itself (none was copied to
    it by decode's rank 0), and prefill counts for each rank what that rank counts as landed."""
    assert sorted(decode) == [str(r) for r in range(decode_tp)], decode
    assert len(set(decode.values())) == 1 and min(decode.values()) > 0, decode  # replicated state
    assert prefill == decode, (prefill, decode)


def wait_idle(*urls: str, timeout: float = 15.0) -> None:
    """Every page (and slot row) back, every queue empty."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            ld = loads(url)
            if (
                sum(ld["queues"].values()) == 0
                and ld["kv_pages_free"] == ld["kv_pages_total"]
                and ld.get("kv_slots_free") == ld.get("kv_slots_total")
            ):
                break
            assert time.monotonic() < deadline, f"{url} still holds state: {ld}"
            time.sleep(0.05)


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
        timeout=180,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def deployments(mla512_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-pd")
    model = mla512_model  # DeepSeek-V3 at the real latent width (kv_lora_rank 512, rope 64)
    pairs = {"2->1": Pair(model, tmp, 2, 1), "1->2": Pair(model, tmp, 1, 2)}
    # 2 -> 2: a third router pairs the tp-2 prefill of one pair with the tp-2 decode of the other.
    r = free_port()
    router = Proc(
        [
            "router",
            "--prefill",
            pairs["2->1"].p_url,
            "--decode",
            pairs["1->2"].d_url,
            "--port",
            r,
            "--health-interval",
            "0.5",
        ],
        tmp / "router-2-2.log",
    )
    m = free_port()
    mono = Proc(
        [
            "serve",
            "--model",
            model,
            "--kv-pages",
            64,
            "--page-size",
            16,
            "--served-model-name",
            "m",
            "--device",
            "cpu",
            "--port",
            m,
        ],
        tmp / "mono.log",
    )
    try:
        for pair in pairs.values():
            pair.wait()
        mono.wait_ready(f"http://127.0.0.1:{m}")
        router.wait_ready(f"http://127.0.0.1:{r}")
        urls = {shape: (pair.url, pair.p_url, pair.d_url) for shape, pair in pairs.items()}
        urls["2->2"] = (f"http://127.0.0.1:{r}", pairs["2->1"].p_url, pairs["1->2"].d_url)
        yield urls, f"http://127.0.0.1:{m}"
    finally:
        stop_all([router, mono, *(p for pair in pairs.values() for p in pair.procs)])


@pytest.mark.parametrize("shape", ["2->2", "2->1", "1->2"])
def test_pd_with_tp_on_either_side_equals_mono(deployments, shape):
    urls, mono = deployments
    url, prefill_url, decode_url = urls[shape]
    before = bytes_by_rank(prefill_url), bytes_by_rank(decode_url)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    results: dict[int, list[int]] = {}

    def one(i):
        time.sleep(0.05 * i)  # staggered: later requests join a running decode batch
        results[i] = complete(url, prompts[i], 10 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    for i, p in enumerate(prompts):
        assert results[i] == complete(mono, p, 10 + i), i
    decode_tp = int(shape[-1])
    assert loads(decode_url)["tp_size"] == decode_tp
    sent, landed = delta(bytes_by_rank(prefill_url), before[0]), delta(bytes_by_rank(decode_url), before[1])
    assert_every_rank_received(sent, landed, decode_tp)


def test_v4_pd_into_a_tp2_decode_equals_mono(make_model, tmp_path):
    """DeepSeek-V4 keeps per-request slot rows (window ring, compressor stages) besides pages:
    prefill writes both into each decode rank's pool. A write that fails into rank 1 alone fails
    the request on both sides (every page and slot row back) and the router's retry succeeds."""
    model = make_model("v4-tiny")
    pair = Pair(model, tmp_path, 1, 2, prefill_args=["--enable-fault-injection"])
    m = free_port()
    mono = Proc(
        [
            "serve",
            "--model",
            model,
            "--kv-pages",
            64,
            "--page-size",
            16,
            "--served-model-name",
            "m",
            "--device",
            "cpu",
            "--port",
            m,
        ],
        tmp_path / "mono.log",
    )
    try:
        pair.wait()
        mono.wait_ready(f"http://127.0.0.1:{m}")
        rng = random.Random(7)
        for n in (5, 23, 41):  # inside the window, across compression windows, several pages
            p = [rng.randrange(2, 500) for _ in range(n)]
            assert complete(pair.url, p, 12) == complete(f"http://127.0.0.1:{m}", p, 12), n
        assert_every_rank_received(bytes_by_rank(pair.p_url), bytes_by_rank(pair.d_url), 2)
        # rank 1's write fails: prefill fails the request and tells decode (which, or the router
        # retrying it, ends its leg), every page and slot row comes back on both sides, and the
        # router's retry gives mono's tokens
        failed = loads(pair.p_url)["counters"]["num_transfer_failed_reqs"]
        r = httpx.post(f"{pair.p_url}/admin/faults", json={"fault": "fail_transfer", "count": 1, "rank": 1}, timeout=5)
        assert r.status_code == 200, r.text
        p = [rng.randrange(2, 500) for _ in range(30)]
        assert complete(pair.url, p, 6) == complete(f"http://127.0.0.1:{m}", p, 6)
        assert loads(pair.p_url)["counters"]["num_transfer_failed_reqs"] == failed + 1
        wait_idle(pair.p_url, pair.d_url)
    finally:
        pair.stop()
        mono.stop()
