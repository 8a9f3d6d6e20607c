"""PD with MTP speculation between real processes over real NIXL, behind the real router, on
DeepSeek-V3 and V4 tiny checkpoints with an MTP block: both roles speculate, decode drafts (its
/v1/loads shows acceptance), and every answer equals a monolithic engine's without speculation,
token for token; every page comes back on both sides."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from dsv4_wire import EngineFlags
from test_pd import PDCluster, complete, loads, wait_pages_back

SPEC = [EngineFlags.SPECULATIVE_ALGORITHM, "mtp", EngineFlags.SPECULATIVE_NUM_STEPS, 2]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_pd_with_speculation_equals_mono_over_http(preset, tmp_path):
    from dsv4_engine.checkpoint import init_checkpoint

    model = init_checkpoint(tmp_path / f"{preset}-mtp", preset=preset, seed=0, mtp=True)
    cluster = PDCluster(model, tmp_path, prefill_args=SPEC, decode_args=SPEC)
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
        results: dict[int, dict] = {}

        def one(i):
            time.sleep(0.05 * i)
            results[i] = complete(cluster.r_url, prompts[i], max_tokens=10 + i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for i, p in enumerate(prompts):
            mono = complete(cluster.m_url, p, max_tokens=10 + i)
            assert results[i]["choices"][0]["token_ids"] == mono["choices"][0]["token_ids"], i
        wait_pages_back(cluster.p_url, cluster.d_url)
        spec = loads(cluster.d_url)["speculative"]
        assert spec["algorithm"] == "mtp" and spec["mean_acceptance_length"] >= 1
        assert "dsv4:spec_decode_num_draft_tokens_total" in httpx.get(f"{cluster.d_url}/metrics").text
    finally:
        cluster.stop()
