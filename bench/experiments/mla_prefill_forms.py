"""What the prefill's attention costs in MLA's two algebraically equal forms, at the mla512
shapes, in plain torch on this CPU (evidence for an engine change; the engine is not touched):

  absorbed  what the engine runs for every token today: q_nope folded through W_UK into the
            512-wide latent space, scores over the 576-wide cached latent + rope key, values =
            the latent, lifted back through W_UV (cheap per token for decode, 4.5x / 8x wider
            dot products than the per-head form for prefill);
  expanded  the per-head form vLLM and SGLang use for prefill: the latent of every context token
            expanded through W_UK / W_UV into per-head keys (64 + 64 rope) and values (64), then
            causal scaled-dot-product attention per request.
Both compute the same output (checked here to 1e-4); projections common to both (q_a, q_b, kv_a,
o_proj) are left out. Best of --repeats.

    python -m bench.experiments.mla_prefill_forms [--requests 8] [--new 128] [--context 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

H, NOPE, ROPE, V, C = 8, 64, 64, 64, 512  # mla512 preset


def absorbed(q_nope, q_rope, latent, k_rope, w_uk, w_uv, new: int, scale: float):
    """q_* [B, n, H, *], latent [B, S, C], k_rope [B, S, R] -> [B, n, H, V]."""
    B, n = q_nope.shape[:2]
    S = latent.shape[1]
    q_lat = torch.einsum("bnhd,hdc->bnhc", q_nope, w_uk)  # [B, n, H, C]
    q = torch.cat([q_lat, q_rope], -1)  # [B, n, H, C+R]
    kv = torch.cat([latent, k_rope], -1)  # [B, S, C+R]
    scores = torch.einsum("bnhd,bsd->bhns", q, kv) * scale
    future = torch.arange(S)[None, :] > (torch.arange(n) + S - new)[:, None]
    scores.masked_fill_(future, float("-inf"))
    o_lat = torch.einsum("bhns,bsc->bnhc", scores.softmax(-1), latent)  # [B, n, H, C]
    return torch.einsum("bnhc,hvc->bnhv", o_lat, w_uv)


def expanded(q_nope, q_rope, latent, k_rope, w_uk, w_uv, new: int, scale: float):
    B, n = q_nope.shape[:2]
    S = latent.shape[1]
    k_nope = torch.einsum("bsc,hdc->bhsd", latent, w_uk)  # [B, H, S, NOPE]
    v = torch.einsum("bsc,hvc->bhsv", latent, w_uv)  # [B, H, S, V]
    k = torch.cat([k_nope, k_rope[:, None].expand(B, H, S, ROPE)], -1)
    q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)  # [B, H, n, NOPE+R]
    mask = torch.arange(S)[None, :] <= (torch.arange(n) + S - new)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new", type=int, default=128, help="new tokens per request (the extend)")
    p.add_argument("--context", type=int, default=128, help="tokens in cache after the step (>= --new)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    B, n, S = a.requests, a.new, a.context
    q_nope, q_rope = torch.randn(B, n, H, NOPE, generator=g), torch.randn(B, n, H, ROPE, generator=g)
    latent, k_rope = torch.randn(B, S, C, generator=g), torch.randn(B, S, ROPE, generator=g)
    w_uk, w_uv = torch.randn(H, NOPE, C, generator=g) * 0.05, torch.randn(H, V, C, generator=g) * 0.05
    scale = (NOPE + ROPE) ** -0.5
    args = (q_nope, q_rope, latent, k_rope, w_uk, w_uv, n, scale)
    with torch.inference_mode():
        diff = (absorbed(*args) - expanded(*args)).abs().max().item()
        t_abs = best(lambda: absorbed(*args), a.repeats)
        t_exp = best(lambda: expanded(*args), a.repeats)
    print(
        json.dumps(
            {
                "requests": B,
                "new": n,
                "context": S,
                "threads": torch.get_num_threads(),
                "absorbed_ms_per_layer": round(t_abs * 1000, 2),
                "expanded_ms_per_layer": round(t_exp * 1000, 2),
                "speedup": round(t_abs / t_exp, 2),
                "max_abs_diff": diff,
            }
        )
    )


if __name__ == "__main__":
    main()
