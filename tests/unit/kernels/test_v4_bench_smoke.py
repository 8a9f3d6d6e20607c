"""bench/suites/kernels_bench.py --only v4 runs end to end on CPU (--cpu --quick) and writes the V4
decode attention and indexer rows."""

from __future__ import annotations

import json
import os
import subprocess

from bench import module_argv, module_env


def test_cpu_quick_v4_bench_writes_decode_attention_and_indexer(tmp_path):
    out = tmp_path / "v4.json"
    env = module_env({**os.environ, "OMP_NUM_THREADS": "1"})
    proc = subprocess.run(
        [*module_argv("bench.suites.kernels_bench"), "--cpu", "--quick", "--only", "v4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["v4_attention_decode"]
    assert {(r["kind"], r["batch"]) for r in rows} == {("csa", 1), ("csa", 8), ("hca", 1), ("hca", 8)}
    for r in rows:
        keys = min(128, r["context"]) + (64 if r["kind"] == "csa" else r["context"] // 128)
        per_req = keys * 512 * 4 + 2 * 16 * 512 * 4 + (64 * 4 if r["kind"] == "csa" else 0)
        assert r["bytes"] == r["batch"] * per_req
        assert r["torch_us"] > 0 and r["torch_gbps"] > 0
    assert [r["batch"] for r in result["v4_indexer_topk"]] == [1, 8]
    assert result["mla_decode"] == [] and result["moe_experts"] == []
