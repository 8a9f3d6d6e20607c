"""`--kv-cache-dtype fp8_e4m3` through PD between real processes behind the real router (issue 46).

Prefill and decode both storing FP8 KV hand the FP8 bytes and their scales over NIXL, and the
output equals a mono engine storing FP8 KV token for token (DeepSeek-V3 and V4); a decode whose
KV dtype differs from its prefill's is refused at bootstrap with an error that names the flag.
"""

from __future__ import annotations

import random

import httpx
import pytest

from test_pd import PDCluster, complete, loads, wait_pages_back

FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


def tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


@pytest.mark.slow  # two PD clusters of four processes each
@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_fp8_kv_pd_equals_fp8_kv_mono(make_model, tmp_path, preset):
    c = PDCluster(make_model(preset), tmp_path, prefill_args=FP8, decode_args=FP8, mono_args=FP8)
    try:
        rng = random.Random(46)
        for n in (5, 17, 40, 70):
            p = [rng.randrange(2, 250) for _ in range(n)]
            assert tokens(complete(c.r_url, p, max_tokens=12)) == tokens(complete(c.m_url, p, max_tokens=12)), n
        wait_pages_back(c.p_url, c.d_url)
        for url in (c.p_url, c.d_url, c.m_url):
            assert loads(url)["kv_sizing"]["kv_cache_dtype"] == "fp8_e4m3"
        moved = loads(c.p_url)["kv_transfer_bytes_by_state"]
        per_token = loads(c.p_url)["kv_state_bytes_per_token"]
        assert set(per_token) <= set(moved)
    finally:
        c.stop()


@pytest.mark.slow
def test_a_decode_with_another_kv_cache_dtype_is_refused(make_model, tmp_path):
    c = PDCluster(make_model("tiny"), tmp_path, prefill_args=FP8)
    try:
        r = httpx.post(
            f"{c.r_url}/v1/completions",
            json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code >= 500, r.text
        assert "--kv-cache-dtype" in r.text and "fp8_e4m3" in r.text, r.text
        wait_pages_back(c.p_url, c.d_url)
    finally:
        c.stop()
