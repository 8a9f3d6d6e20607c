"""MLA attention forms of the torch (CPU) backend, side by side, at the mla512 widths
(latent 512 + rope 64, 8 heads of 64 + 64, value 64):

  decode   gathered   every request's whole context gathered into one tensor per length bucket,
                      per layer, then two bmms over it (the backend's decode before)
           paged      the block table walked in 256-token blocks: each block's pages read into a
                      small cache-resident tile, folded into a running log-sum-exp (now)
  extend   absorbed   every new token's query in the 576-wide latent space (the fused kernel's form)
           chosen     what the model runs now: the per-head (expanded) form for requests where
                      `expanded_is_cheaper` says so, absorbed for the others

Each row is one layer's attention for a batch (projections common to both sides left out),
best of --repeats, with the maximum difference between the sides (they compute the same thing).

    python -m bench.experiments.attention_forms [--quick] [--out bench/results/attention_forms.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.harness.report import grouped_bars, pyplot, write_json  # noqa: E402

from dsv4_engine.layers.mla import MLA, expanded_is_cheaper  # noqa: E402
from dsv4_engine.models.forward_batch import ForwardBatch  # noqa: E402
from dsv4_kernels import reference  # noqa: E402
from dsv4_kernels.ops_torch import TorchOps  # noqa: E402

H, NOPE, ROPE, V, C = 8, 64, 64, 64, 512
PAGE = 16


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def paged_pool(lens: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool with every request's pages scattered at random, and the block table."""
    npages = [-(-n // PAGE) for n in lens]
    pool = torch.randn(sum(npages) + 1, PAGE, C + ROPE, generator=g) * 0.5
    order = torch.randperm(pool.shape[0] - 1, generator=g) + 1
    table = torch.zeros(len(lens), max(npages), dtype=torch.int32)
    k = 0
    for b, n in enumerate(npages):
        table[b, :n] = order[k : k + n].to(torch.int32)
        k += n
    return pool, table


def decode_row(batch: int, context: int, repeats: int, g: torch.Generator) -> dict:
    lens = [max(1, context - (b * context) // (2 * batch)) for b in range(batch)]  # contexts/2 .. context
    pool, table = paged_pool(lens, g)
    q = torch.randn(batch, H, C + ROPE, generator=g)
    sl = torch.tensor(lens, dtype=torch.int32)
    args = (q, pool, table, sl, (NOPE + ROPE) ** -0.5, C)
    diff = (reference.mla_decode(*args) - reference.mla_decode_gathered(*args)).abs().max().item()
    t_old = best(lambda: reference.mla_decode_gathered(*args), repeats)
    t_new = best(lambda: reference.mla_decode(*args), repeats)
    return {
        "batch": batch,
        "context": context,
        "gathered_ms": round(t_old * 1e3, 3),
        "paged_ms": round(t_new * 1e3, 3),
        "speedup": round(t_old / t_new, 2),
        "max_abs_diff": diff,
    }


def extend_row(requests: int, new: int, context: int, repeats: int, g: torch.Generator) -> dict:
    cfg = SimpleNamespace(
        kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, num_attention_heads=H
    )
    lens = [context] * requests
    pool, table = paged_pool(lens, g)
    w_uk, w_uv = torch.randn(H, NOPE, C, generator=g) * 0.05, torch.randn(H, V, C, generator=g) * 0.05
    # just the attention forms over given weights, on the reference backend (no native passes);
    # the projections around them are not used here
    attn = MLA(cfg, None, None, None, None, None, w_uk, w_uv, {}, None, None, (NOPE + ROPE) ** -0.5, TorchOps())
    q = torch.randn(requests * new, H, NOPE + ROPE, generator=g)
    fb = ForwardBatch(
        input_ids=torch.zeros(requests * new, dtype=torch.long),
        positions=torch.zeros(requests * new, dtype=torch.long),
        slot_mapping=torch.zeros(requests * new, dtype=torch.long),
        block_table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_lens=torch.full((requests,), new, dtype=torch.int32),
        logits_indices=torch.zeros(requests, dtype=torch.long),
        all_decode=False,
        page_size=PAGE,
        seq_lens_host=lens,
        extend_lens_host=[new] * requests,
    )
    expand = [expanded_is_cheaper(new, n, cfg) for n in lens]

    def absorbed():
        return attn.attend_absorbed(q, fb, pool).transpose(0, 1)

    def chosen():
        return attn.attend_mixed_forms(q, fb, pool, expand) if any(expand) else absorbed()

    diff = (absorbed() - chosen()).abs().max().item()
    t_abs = best(absorbed, repeats)
    t_cho = best(chosen, repeats)
    return {
        "requests": requests,
        "new": new,
        "context": context,
        "expanded": any(expand),
        "absorbed_ms": round(t_abs * 1e3, 3),
        "chosen_ms": round(t_cho * 1e3, 3),
        "speedup": round(t_abs / t_cho, 2),
        "max_abs_diff": diff,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes, one repeat: proves the script runs")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench/results/attention_forms.json"))
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    repeats = 1 if a.quick else a.repeats
    decode_shapes = [(4, 64), (8, 128)] if a.quick else [(1, 1024), (8, 512), (32, 256), (32, 1024), (64, 2048)]
    extend_shapes = (
        [(1, 32, 32), (2, 16, 64)]
        if a.quick
        else [(1, 512, 512), (8, 128, 128), (4, 128, 1024), (8, 32, 512), (4, 256, 256)]
    )
    with torch.inference_mode():
        decode = [decode_row(b, n, repeats, g) for b, n in decode_shapes]
        extend = [extend_row(r, e, n, repeats, g) for r, e, n in extend_shapes]
    report = {
        "benchmark": "attention_forms",
        "threads": torch.get_num_threads(),
        "quick": a.quick,
        "decode": decode,
        "extend": extend,
    }
    for row in decode + extend:
        print(row)
    write_json(report, a.out)
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    grouped_bars(
        ax1,
        [f"b{r['batch']}/{r['context']}" for r in decode],
        {"gathered": [r["gathered_ms"] for r in decode], "paged": [r["paged_ms"] for r in decode]},
        "decode attention, one layer (ms, lower is better)",
        "ms",
    )
    grouped_bars(
        ax2,
        [f"{r['requests']}x{r['new']}/{r['context']}" for r in extend],
        {"absorbed": [r["absorbed_ms"] for r in extend], "chosen": [r["chosen_ms"] for r in extend]},
        "extend attention, one layer (ms)",
        "ms",
    )
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
