"""PD with tensor parallelism on either side, same or different sizes (prefill 2 -> decode 2,
2 -> 1 and 1 -> 2), behind the real router over real NIXL: the same greedy tokens as a monolithic
engine.

Every rank keeps the full latent cache, so prefill's rank 0 sends each page once, and decode's
rank 0 receives it and copies it to its other ranks before the request decodes."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from bench.harness.commands import Proc, free_port


class Pair:
    """A prefill and a decode engine of the given TP sizes, and a router in front of them."""

    def __init__(self, model, tmp, prefill_tp: int, decode_tp: int):
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
                [*common, "--role", "prefill", "--port", p, "--bootstrap-port", b, "--tp-size", prefill_tp],
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
        for p in self.procs:
            p.stop()


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
def deployments(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-pd")
    pairs = {"2->1": Pair(tiny_model, tmp, 2, 1), "1->2": Pair(tiny_model, tmp, 1, 2)}
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
            tiny_model,
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
        urls = {shape: (pair.url, pair.d_url) for shape, pair in pairs.items()}
        urls["2->2"] = (f"http://127.0.0.1:{r}", pairs["1->2"].d_url)
        yield urls, f"http://127.0.0.1:{m}"
    finally:
        router.stop()
        for pair in pairs.values():
            pair.stop()
        mono.stop()


@pytest.mark.parametrize("shape", ["2->2", "2->1", "1->2"])
def test_pd_with_tp_on_either_side_equals_mono(deployments, shape):
    urls, mono = deployments
    url, decode_url = urls[shape]
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
    loads = httpx.get(f"{decode_url}/v1/loads", timeout=5).json()
    assert loads["tp_size"] == int(shape[-1])


def test_v4_pd_into_a_tp2_decode_equals_mono(make_model, tmp_path):
    """DeepSeek-V4 keeps per-request slot rows (window ring, compressor stages) besides pages:
    decode's rank 0 copies both to its other rank when the hand-off lands."""
    model = make_model("v4-tiny")
    pair = Pair(model, tmp_path, 1, 2)
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
    finally:
        pair.stop()
        mono.stop()
