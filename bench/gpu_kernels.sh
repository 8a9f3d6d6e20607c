#!/usr/bin/env bash
# On a CUDA machine, in two calls of under 10 minutes each (one lent run of 15 minutes holds both):
#
#   PARTS=kernels bash bench/gpu_kernels.sh [OUT_DIR]   # ~9 min at most
#   PARTS=engine  bash bench/gpu_kernels.sh [OUT_DIR]   # ~9 min at most
#   PARTS=engine-v3,multi bash bench/gpu_kernels.sh     # the V3 (mla512) smoke; cuda:1, --tp-size 2, --dp-size 2 with 2+ GPUs
#   PARTS=fp8kv bash bench/gpu_kernels.sh               # FP8 KV: V3/V4 kernels, greedy agreement, V4 + MTP (~8 min)
#   PARTS=multi-mtp bash bench/gpu_kernels.sh           # MTP graphs at --tp-size 2 (2+ GPUs, ~4 min at most)
#
# OUT_DIR defaults to $OUT when set (the device runner's), else bench/results.
#
# kernels: the kernel tests compiled for the GPU (the same tests that run under the Triton
# interpreter on CPU, incl. tests/unit/kernels/test_gpu_oracles.py at real widths), then
# bench/suites/kernels_bench.py: DeepSeek-V4 decode attention GB/s and % of memory bandwidth per
# layer type (CSA / HCA / sliding, batch 1-128 x context 1k-64k; the acceptance point is CSA at
# batch 64, 4k) and the V4 indexer; then mla_decode GB/s and MoE TFLOP/s against torch; then
# bench/suites/kernel_paths.py: one CHECK line per path of issue 49 (docs/gpu-path.md lists them).
#
# engine: the capture-safety / host-sync / sampling tests on the GPU; then
# bench/suites/engine_gpu_checks.py, one `CHECK name: PASS|FAIL ...` line each: the KV pool sized
# from free memory with no memory flags and graphs on by default (default_kv_sizing), greedy
# tokens equal with and without decode graphs in fp32 and >= 90% in bf16, with a long context and
# mixed steps (V4 decode rows replaying the graphs) in the batch (greedy_graphs_fp32 / _bf16), a
# device-side assert failing the engine (dead_device); then
# bench/suites/engine_gpu_smoke.py on v4-tiny (bf16, seeded sampling, inter-token latency at
# batch 1/8/32 with and without graphs). docs/gpu-path.md lists the expected lines.
#
# Writes OUT_DIR/kernel_tests.xml + .log, kernels_bench_v4.json, kernels_bench.json,
# kernel_paths.json + .log (kernels);
# engine_gpu_tests.xml + .log, engine_gpu_checks.json + .log, engine_gpu_smoke_v4.json (engine);
# engine_gpu_smoke.json, engine_gpu_smoke_cuda1.json, engine_gpu_smoke_tp2.json (engine-v3, multi);
# mtp_graphs_tp.json + .log (multi-mtp: `CHECK mtp_graphs_tp2: PASS|FAIL ...`).
# Needs python3 with a CUDA torch, triton, pytest (transformers for the HF comparisons); the
# project need not be pip-installed: the checkout and its source folders go on PYTHONPATH.
# Exit status: non-zero if tests, checks or bench failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD:$PWD/wire:$PWD/kernels:$PWD/engine:$PWD/router${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

"$py" - <<'PY' || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_kernels.sh needs a CUDA device; on CPU run: python -m pytest tests/unit/kernels")
import triton
print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory --format=csv,noheader 2>/dev/null || true

start=$SECONDS
status=0
parts="${PARTS:-kernels,engine}"
has() { [[ ",$parts," == *",$1,"* ]]; }
if has kernels; then
# Budget: tests ~3 min with first-time JIT, benchmarks ~5 min, paths ~1 min; the time-outs add to 590 s.
timeout 210 "$py" -m pytest -q -p no:cacheprovider tests/unit/kernels \
    --junitxml "$out/kernel_tests.xml" 2>&1 | tee "$out/kernel_tests.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "kernel tests failed (exit $rc)"; status=1; }
timeout 120 "$py" -m bench.suites.kernels_bench --only v4 --out "$out/kernels_bench_v4.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "V4 benchmark failed (exit $rc)"; status=1; }
timeout 200 "$py" -m bench.suites.kernels_bench --only v3 --out "$out/kernels_bench.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "benchmark failed (exit $rc)"; status=1; }
# The paths that fill the device (issue 49), ~40 s with JIT: one `CHECK name: PASS|FAIL` line each.
timeout 60 "$py" -m bench.suites.kernel_paths --out "$out/kernel_paths.json" > "$out/kernel_paths.log" 2>&1
for path in indexer_split hc_pre_split moe_tp_rows fp4_native; do
  grep -h "^CHECK $path: " "$out/kernel_paths.log" || echo "CHECK $path: FAIL (no line; see kernel_paths.log)"
  grep -q "^CHECK $path: PASS" "$out/kernel_paths.log" || status=1
done
fi
if has engine; then
# Budget: the time-outs add to 580 s.
# Capture safety, host syncs and graph replay of the engine's decode, compiled (~1 min); the EPLB
# hook (expert ids -> replica slots, load counters) replayed from a CUDA graph.
timeout 110 "$py" -m pytest -q -p no:cacheprovider tests/unit/engine/test_cuda_graphs.py tests/unit/engine/test_host_syncs.py \
    tests/unit/engine/test_sampling_devices.py tests/unit/engine/test_eplb_model.py tests/unit/engine/test_eplb_v4.py --junitxml "$out/engine_gpu_tests.xml" 2>&1 | tee "$out/engine_gpu_tests.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "engine GPU tests failed (exit $rc)"; status=1; }
# PD over VRAM: a NIXL write waits for the event after the kernel that wrote its page, not the stream.
timeout 40 "$py" -m pytest -q -p no:cacheprovider \
    "tests/integration/pd/test_nixl_transfer.py::test_a_write_from_vram_waits_for_the_kernel_that_wrote_its_page" \
    2>&1 | tee "$out/pd_vram_ready.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "PD VRAM ready-event test failed (exit $rc)"; status=1; }
# Default KV sizing, graphs on by default, greedy equality with and without graphs, a dead device.
timeout 200 "$py" -m bench.suites.engine_gpu_checks --preset v4-tiny --out "$out/engine_gpu_checks.json" 2>&1 \
    | tee "$out/engine_gpu_checks.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "engine GPU checks failed (exit $rc)"; status=1; }
# DeepSeek-V4 (v4-tiny) smoke: its kernel path, masked window closing under graphs, latency.
timeout 230 "$py" -m bench.suites.engine_gpu_smoke --preset v4-tiny --out "$out/engine_gpu_smoke_v4.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "V4 engine smoke failed (exit $rc)"; status=1; }
grep -h "^CHECK " "$out/engine_gpu_checks.log" 2>/dev/null
fi
if has engine-v3; then
# Engine smoke on the mla512 preset (~3-5 min: Triton JIT and graph capture included).
timeout 400 "$py" -m bench.suites.engine_gpu_smoke --out "$out/engine_gpu_smoke.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "engine smoke failed (exit $rc)"; status=1; }
# The host KV tier (--host-cache-gb) on CUDA: pinned host pages, non_blocking copies on the step's
# stream; outputs equal the no-tier engine's, then its copy cost per page (~1 min).
timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/unit/engine/test_host_tier.py 2>&1 | tee "$out/host_tier_tests.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "host tier tests failed (exit $rc)"; status=1; }
# The disk tier under it (--disk-cache-dir) on CUDA: a dropped pinned host page is synced, then written;
# pages read back from files equal the no-tier engine's outputs (~1 min).
timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/unit/engine/test_disk_tier.py 2>&1 | tee "$out/disk_tier_tests.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "disk tier tests failed (exit $rc)"; status=1; }
timeout 60 "$py" -m bench.suites.kv_tiers_bench --copy-cost-only --out "$out/kv_tiers_copy"
rc=$?; [ "$rc" -ne 0 ] && { echo "host tier copy cost failed (exit $rc)"; status=1; }
fi
if has fp8kv; then
# --kv-cache-dtype fp8_e4m3 (issue 46), ~3 min: the Triton MLA decode reading e4m3 rows and their
# scales, compiled, against the reference; then greedy agreement and logit error of FP8 KV against
# bf16 KV on the mla512 preset through the engine on CUDA (decode in the kernel, graphs on).
# DeepSeek-V4's attention (ring + compressed entries) and indexer reading e4m3 rows, compiled,
# at V4-Flash's head_dim 512 too (-m "": the interpreter's slow shapes are quick on a GPU).
timeout 90 "$py" -m pytest -q -p no:cacheprovider -m "" tests/unit/kernels/test_kernels_mla_decode_fp8.py \
    tests/unit/kernels/test_v4_fp8_kv.py 2>&1 | tee "$out/kv_fp8_kernel_tests.log"
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "FP8 KV kernel tests failed (exit $rc)"; status=1; }
timeout 240 "$py" -m bench.suites.kv_fp8_agreement --preset mla512 --device cuda --kernel-backend triton \
    --prompts 16 --new-tokens 32 --out "$out"
rc=$?; [ "$rc" -ne 0 ] && { echo "FP8 KV agreement failed (exit $rc)"; status=1; }
# V4 on its Triton kernel path (window ring, CSA/HCA entries and indexer keys in FP8), then MTP
# over FP8 KV (V4: draft block's ring packed too): greedy agreement against bf16 KV.
timeout 120 "$py" -m bench.suites.kv_fp8_agreement --preset v4-tiny --device cuda --kernel-backend triton \
    --prompts 16 --new-tokens 32 --out "$out"
rc=$?; [ "$rc" -ne 0 ] && { echo "V4 FP8 KV agreement failed (exit $rc)"; status=1; }
timeout 120 "$py" -m bench.suites.kv_fp8_agreement --preset v4-tiny --device cuda --kernel-backend triton \
    --mtp-steps 3 --prompts 16 --new-tokens 32 --out "$out"
rc=$?; [ "$rc" -ne 0 ] && { echo "V4 FP8 KV with MTP agreement failed (exit $rc)"; status=1; }
fi
if has multi; then
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
if [ "${gpus:-1}" -ge 2 ]; then
# Off GPU 0: kernels launched from a thread that never chose its device would land on GPU 0.
timeout 240 "$py" -m bench.suites.engine_gpu_smoke --preset v4-tiny --device cuda:1 --out "$out/engine_gpu_smoke_cuda1.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "engine smoke on cuda:1 failed (exit $rc)"; status=1; }
# Two ranks (NCCL), decode graphs captured on both at start-up, agreeing after every batch size.
timeout 300 "$py" -m bench.suites.engine_gpu_smoke --preset mla512 --tp 2 --graphs 16 --out "$out/engine_gpu_smoke_tp2.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "TP 2 engine smoke with graphs failed (exit $rc)"; status=1; }
# Data-parallel attention (NCCL): each rank captures its own decode graphs, replays the bucket of
# the step's largest share (an idle rank joins the MoE collectives); greedy with graphs == without.
timeout 300 "$py" -m bench.suites.engine_gpu_smoke --preset mla512 --tp 2 --dp 2 --graphs 16 --out "$out/engine_gpu_smoke_dp2.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "DP 2 engine smoke with per-rank graphs failed (exit $rc)"; status=1; }
# The same for DeepSeek-V4 (its slot rows in each rank's shares, windows found on the device in
# the captured step, every rank's token ids for hash routing in a static buffer; not yet run on a GPU).
timeout 240 "$py" -m bench.suites.engine_gpu_smoke --preset v4-tiny --tp 2 --dp 2 --graphs 16 --out "$out/engine_gpu_smoke_v4_dp2.json"
rc=$?; [ "$rc" -ne 0 ] && { echo "V4 DP 2 engine smoke with per-rank graphs failed (exit $rc)"; status=1; }
else
echo "one GPU: the cuda:1, --tp-size 2 and --dp-size 2 smokes need two"
fi
fi
if has multi-mtp; then
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
if [ "${gpus:-1}" -ge 2 ]; then
# MTP at --tp-size 2: verify/draft/catch-up graphs captured on both ranks; greedy == graphs off.
timeout 300 "$py" -m bench.suites.mtp_graphs_tp --out "$out/mtp_graphs_tp.json" 2>&1 | tee "$out/mtp_graphs_tp.log" | grep -h "^CHECK "
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "MTP graphs at TP 2 failed (exit $rc; see mtp_graphs_tp.log)"; status=1; }
else
echo "CHECK mtp_graphs_tp2: SKIP one GPU (--tp-size 2 needs two)"
fi
fi
echo "gpu_kernels.sh: $((SECONDS - start)) s, results in $out"
exit $status
