"""Memory per GPU of a DeepSeek-V4 engine, from the checkpoint's shapes: the tables of
docs/deploy-v4-flash.md.

    python scripts/v4_memory.py                  # V4-Flash (transformers' DeepseekV4Config defaults)
    python scripts/v4_memory.py --config config.json --tp 4 8
    python scripts/v4_memory.py --capacity 96 8  # KV tokens and 32K-token agents: TP8 vs DP8, bf16 vs FP8

What each rank holds follows the engine's tensor-parallel plan for V4 (docs/tensor-parallel.md):
attention, the shared expert, embeddings, head and norms replicated, routed experts split E/N,
every per-request state whole on every rank. Bytes follow the release format the loader keeps
on a GPU (docs/quantization.md): routed experts FP4 (half a byte a value, one e8m0 scale per 32),
the attention and shared-expert projections FP8 with one scale per 128x128 block, the rest bf16
(mHC mixing fp32, the hash table int32). The tensor list is the engine's own
(`dsv4_engine.checkpoint.v4_tensor_shapes`), the state list the model's (`DeepseekV4.state_specs`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
CONTEXT = 32768  # tokens of context per request in the table's last column
ROUTED = re.compile(r"\.ffn\.experts\.\d+\.(w1|w2|w3)\.weight$")
FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.(w1|w2|w3))\.weight$")
FP32 = re.compile(r"(^|\.)hc_\w+$")
INT32 = re.compile(r"\.gate\.tid2eid$")


HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"
# V4-Flash's shapes as transformers documents them: DeepseekV4Config's defaults, whose docstring
# names deepseek-ai/DeepSeek-V4-Flash-Base (a slow test checks these against the installed
# transformers). Check them against the config.json you download.
FLASH = {
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "vocab_size": 129280,
    "sliding_window": 128,
    "compress_rates": {CSA: 4, HCA: 128},
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "num_nextn_predict_layers": 1,
    "layer_types": [HCA, HCA] + [HCA, CSA] * 20 + [HCA],
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 40,
}


def flash_config() -> dict:
    return json.loads(json.dumps(FLASH))


def tensor_bytes(name: str, shape: tuple[int, ...]) -> float:
    n = math.prod(shape)
    if ROUTED.search(name):
        return n / 2 + n / 32  # e2m1 codes, two a byte; one e8m0 scale per 32 values of a row
    if FP8.search(name):
        rows, cols = shape
        return n + math.ceil(rows / 128) * math.ceil(cols / 128)
    if FP32.search(name) or INT32.search(name):
        return 4 * n
    return 2 * n


@dataclass(frozen=True)
class Sizes:
    replicated: float  # bytes every rank holds
    routed: float  # bytes of all routed experts (split over the ranks)
    mtp: float  # the MTP block (loaded with --speculative-algorithm only), replicated but its experts split
    mtp_routed: float
    kv_per_token: float  # paged states, bytes per token of context, every layer
    per_request: float  # slot states (windows, compressor staging), bytes per running request


def sizes(config: dict) -> Sizes:
    import torch

    from dsv4_engine.checkpoint import v4_tensor_shapes
    from dsv4_engine.models.deepseek_v4 import DeepseekV4
    from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config

    replicated = routed = mtp = mtp_routed = 0.0
    for name, shape in v4_tensor_shapes(config).items():
        b = tensor_bytes(name, shape)
        if name.startswith("mtp."):
            mtp_routed += b if ROUTED.search(name) else 0.0
            mtp += 0.0 if ROUTED.search(name) else b
        elif ROUTED.search(name):
            routed += b
        else:
            replicated += b
    specs = DeepseekV4.state_specs(DeepseekV4Config.from_dict(config))
    return Sizes(
        replicated=replicated,
        routed=routed,
        mtp=mtp,
        mtp_routed=mtp_routed,
        kv_per_token=sum(s.bytes_per_token(torch.bfloat16) for s in specs),
        per_request=sum(s.request_nbytes(torch.bfloat16) for s in specs),
    )


def weights_per_gpu(s: Sizes, tp: int) -> float:
    return s.replicated + s.routed / tp


def render(config: dict, tps: list[int], gpus: list[tuple[str, float]], reserve_gb: float) -> str:
    s = sizes(config)
    lines = [
        f"Weights: {(s.replicated + s.routed) / GB:.1f} GB in all ({s.routed / GB:.1f} GB routed experts, "
        f"{s.replicated / GB:.1f} GB the rest); the MTP block adds {(s.mtp + s.mtp_routed) / GB:.2f} GB "
        "(its experts split like the others) when speculative decoding loads it.",
        f"KV and state: {s.kv_per_token / 1024:.2f} KiB per token of context (paged, every layer) plus "
        f"{s.per_request / 2**20:.1f} MiB per running request (sliding windows and compressor staging), "
        "bf16, whole on every rank.",
        "",
        "| `--tp-size` | weights per GPU | "
        + " | ".join(f"{name} ({gb:g} GB): left for KV | requests of {CONTEXT // 1024}K tokens" for name, gb in gpus)
        + " |",
        "|---|---|" + "---|---|" * len(gpus),
    ]
    for tp in tps:
        w = weights_per_gpu(s, tp)
        cells = [f"{tp}", f"{w / GB:.1f} GB"]
        for _, gb in gpus:
            left = gb * GB - w - reserve_gb * GB
            if left <= 0:
                cells += ["does not fit", "-"]
            else:
                cells += [f"{left / GB:.1f} GB", f"{int(left // (s.per_request + CONTEXT * s.kv_per_token)):,}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"({reserve_gb:g} GB a GPU is set aside for the CUDA context, NCCL, activations and CUDA graphs: an "
        "estimate, not a measurement. Requests: how many running requests of that context the pool holds, "
        "each with its per-request rows.)"
    )
    return "\n".join(lines) + "\n"


GPUS = [("RTX PRO 6000", 96.0), ("H200", 141.0), ("B200", 180.0)]


def render_capacity(config: dict, gpu_gb: float, gpus: int, reserve_gb: float) -> str:
    """Issue 46's capacity table: KV tokens per GPU and concurrent 32K-token agents on `gpus`
    GPUs of `gpu_gb`, TP vs DP attention, bf16 vs FP8 KV (dsv4_engine.capacity)."""
    import torch

    from dsv4_engine.capacity import capacity, kv_cost
    from dsv4_engine.models.deepseek_v4 import DeepseekV4
    from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config

    s = sizes(config)
    specs = DeepseekV4.state_specs(DeepseekV4Config.from_dict(config))
    rows = []
    costs = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        costs[kv_dtype] = cost = kv_cost(specs, torch.bfloat16, kv_dtype)
        for layout in ("tp", "dp"):
            c = capacity(cost, kv_dtype, gpu_gb * GB, s.replicated, s.routed, gpus, layout, reserve_gb * GB, CONTEXT)
            rows.append((layout, kv_dtype, c))
    name = {"auto": "bf16", "fp8_e4m3": "FP8 e4m3"}
    lines = [
        f"{gpus} GPUs of {gpu_gb:g} GB, {reserve_gb:g} GB a GPU reserved; weights {rows[0][2].weights_per_gpu / GB:.1f} GB "
        f"a GPU (attention replicated, experts split {gpus} ways). KV per token (pages of "
        f"{costs['auto'].page_size} tokens, every layer): bf16 {costs['auto'].bytes_per_token:,.0f} B, FP8 "
        f"{costs['fp8_e4m3'].bytes_per_token:,.0f} B; per running request (windows, compressor staging): bf16 "
        f"{costs['auto'].request_bytes / 2**20:.1f} MiB, FP8 {costs['fp8_e4m3'].request_bytes / 2**20:.1f} MiB.",
        "",
        f"| attention | KV dtype | KV per GPU | KV tokens per GPU | KV tokens on the box | concurrent {CONTEXT // 1024}K-token agents |",
        "|---|---|---|---|---|---|",
    ]
    for layout, kv_dtype, c in rows:
        lines.append(
            f"| {layout.upper()}{gpus} | {name[kv_dtype]} | {c.kv_bytes_per_gpu / GB:.1f} GB | "
            f"{c.kv_tokens_per_gpu:,} | {c.kv_tokens_box:,} | {c.agents:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="a V4 config.json (default: V4-Flash's shapes)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--reserve-gb", type=float, default=6.0)
    parser.add_argument(
        "--capacity",
        nargs=2,
        type=float,
        metavar=("GPU_GB", "GPUS"),
        help="print the capacity table instead (TP vs DP attention, bf16 vs FP8 KV), e.g. --capacity 96 8",
    )
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text()) if args.config else flash_config()
    if args.capacity:
        sys.stdout.write(render_capacity(config, args.capacity[0], int(args.capacity[1]), args.reserve_gb))
        return 0
    sys.stdout.write(render(config, args.tp, GPUS, args.reserve_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
