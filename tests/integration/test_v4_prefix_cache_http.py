"""DeepSeek-V4 prefix reuse through real servers (v4-tiny): a growing conversation through the PD
router (prefill's cache, real NIXL to decode) and a mono engine with the cache equals a mono
engine started with --disable-prefix-cache, token for token; usage.prompt_tokens_details says
what the cache served (through PD too); /metrics and /v1/loads show the snapshots and the bytes
held per state; everything is given back."""

from __future__ import annotations

import random
import re

import httpx

from bench.harness.commands import serving
from dsv4_wire import EngineFlags
from test_pd import PDCluster, complete, loads
from test_v4_pd import tokens, wait_idle


def test_v4_conversation_with_the_cache_equals_without_in_mono_and_pd(make_model, tmp_path):
    model = make_model("v4-tiny")
    # Prefill's cache through PD: decode serves no round itself here (with --decode-local-prefill,
    # on by default, PD caches what mono does: tests/integration/test_kv_continuity_http.py).
    cluster = PDCluster(model, tmp_path, decode_args=("--decode-local-prefill", 0))
    try:
        with serving(
            [
                "--model",
                model,
                "--kv-pages",
                128,
                "--page-size",
                16,
                "--served-model-name",
                "m",
                EngineFlags.DISABLE_PREFIX_CACHE,
            ],
            tmp_path / "nocache.log",
        ) as off:
            rng = random.Random(21)
            history = [rng.randrange(2, 250) for _ in range(40)]
            cached = {"pd": [], "mono": []}
            for round_ in range(3):
                want = tokens(complete(off, history, max_tokens=20))
                for side, url in (("pd", cluster.r_url), ("mono", cluster.m_url)):
                    body = complete(url, history, max_tokens=20)
                    assert tokens(body) == want, (side, round_)
                    cached[side].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                history += want + [rng.randrange(2, 250) for _ in range(12)]
            # Prompts of 40, 72, 104 tokens, boundaries of 16. Prefill resumes at its previous
            # prompt's last boundary (32, 64: the answer was computed on decode, so it is
            # recomputed here); mono inside its previous answer (the decode snapshot at 48, 80).
            assert cached == {"pd": [0, 32, 64], "mono": [0, 48, 80]}, cached
            wait_idle(cluster.p_url, cluster.d_url, cluster.m_url)
            for url in (cluster.p_url, cluster.m_url):
                pc = loads(url)["prefix_cache"]
                assert pc["enabled"] and pc["snapshots_cached"] > 0 and pc["snapshots_restored"] >= 2, pc
                assert (
                    pc["bytes_by_state"]["swa_kv"]
                    == pc["snapshots_cached"] * loads(url)["kv_state_bytes_per_request"]["swa_kv"]
                )
                text = httpx.get(f"{url}/metrics", timeout=10).text
                m = re.search(r"^dsv4:prefix_cache_snapshots\{[^}]*\} (\S+)$", text, re.M)
                assert m and float(m.group(1)) == pc["snapshots_cached"]
                assert re.search(r'^dsv4:prefix_cache_state_bytes\{[^}]*state="csa_stage"[^}]*\} \S+$', text, re.M)
            assert loads(cluster.d_url)["prefix_cache"]["enabled"] is False
    finally:
        cluster.stop()
