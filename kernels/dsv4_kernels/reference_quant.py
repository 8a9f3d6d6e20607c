"""Torch references for the quantized-weight kernels (fp32 math), and the dequantization they share
with the engine's loader.

Formats, as the engine keeps them resident (one row of scales per weight row, so rows can be
concatenated, chunked and stacked freely):
- fp8: e4m3 weights [..., N, K] and fp32 scales per 128-wide group of K, either one row of scales
  per 128 weight rows ([..., ceil(N/128), ceil(K/128)], the checkpoint's 128x128 blocks as they
  are) or one per weight row ([..., N, ceil(K/128)], what concatenating weights whose row count
  is not a multiple of 128 needs); `scale_row_block` tells which. Activations are quantized per
  token and 128-wide group of K (w8a8, as DeepSeek's inference does), so y = sum over K-groups
  of (qa . qw) * sa * sw.
- fp4: e2m1 codes packed two per byte along K (element 2j in the low nibble), uint8 [..., N, K/2],
  and power-of-two scales as e8m0 exponent bytes uint8 [..., N, K/32] (2**(e-127)); activations
  stay in their dtype (w4a16).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
FP8_GROUP = 128
FP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude; bit 3 is the sign


def unpack_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """KV rows as `dtype` values: packed FP8 rows (--kv-cache-dtype fp8_e4m3, uint8 [..., D + 4]:
    D e4m3 bytes, then the row's float32 scale; dsv4_engine.kv_quant writes them) are converted,
    any other rows cast."""
    if rows.dtype != torch.uint8:
        return rows.to(dtype)
    d = rows.shape[-1] - 4
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].contiguous().view(torch.float8_e4m3fn).float() * scale).to(dtype)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales as fp32, from exponent bytes (uint8) or float8_e8m0fnu."""
    if s.dtype == torch.uint8:
        return torch.exp2(s.float() - 127.0)
    return s.float()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., K/2] (uint8, int8 or float4_e2m1fn_x2) -> fp32 [..., K]."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    lo, hi = lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def scale_row_block(w: torch.Tensor, scale: torch.Tensor) -> int:
    """Weight rows per row of fp8 scales: 1 (per-row scales) or 128 (block scales)."""
    n, sn = w.shape[-2], scale.shape[-2]
    if sn == n:
        return 1
    if sn == -(-n // FP8_GROUP):
        return FP8_GROUP
    raise ValueError(f"fp8 scales {tuple(scale.shape)} fit neither rows nor 128-row blocks of weight {tuple(w.shape)}")


def dequantize_fp8_rows(
    q: torch.Tensor, row_scale: torch.Tensor, group: int = FP8_GROUP, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """e4m3 [..., N, K] with scales [..., N or ceil(N/128), ceil(K/group)] -> dtype [..., N, K]."""
    N, K = q.shape[-2:]
    s = row_scale.float().repeat_interleave(scale_row_block(q, row_scale), dim=-2)[..., :N, :]
    s = s.repeat_interleave(group, dim=-1)[..., :K]
    return (q.float() * s).to(dtype)


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] with power-of-two scales [..., N, K/group] -> dtype [..., N, K]."""
    v = unpack_fp4(packed)
    s = e8m0_to_float(scale).repeat_interleave(group, dim=-1)[..., : v.shape[-1]]
    return (v * s).to(dtype)


def fp8_act_quant(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/group)]), scale = group amax / 448."""
    M, K = x.shape
    G = -(-K // group)
    padded = torch.zeros(M, G * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.float()
    g = padded.view(M, G, group)
    amax = g.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(M, G * group)[:, :K]
    return q.contiguous(), s


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with x quantized per token-group (w8a8); x [M, K], w e4m3 [N, K]."""
    q, s = fp8_act_quant(x)
    xa = dequantize_fp8_rows(q, s)
    return (xa @ dequantize_fp8_rows(w, w_scale).T).to(x.dtype)


def fp4_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with W in packed fp4 (w4a16)."""
    return (x.float() @ dequantize_fp4(w, w_scale).T).to(x.dtype)


def swiglu(gate_up: torch.Tensor, limit: Optional[float] = None) -> torch.Tensor:
    """silu(gate) * up over the two halves; with a limit, gate is capped above and up clamped
    to [-limit, limit] first (DeepSeek-V4's experts)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _moe(x, topk_weights, topk_ids, expert_linear13, expert_linear2, swiglu_limit, num_experts):
    T, hidden = x.shape
    out = torch.zeros(T, hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < num_experts:  # another rank's expert (tensor parallel): not ours to compute
            continue
        tok, k = torch.where(topk_ids == e)
        h = swiglu(expert_linear13(x[tok], e).float(), swiglu_limit).to(x.dtype)
        out.index_add_(0, tok, expert_linear2(h, e).float() * topk_weights[tok, k, None].float())
    return out.to(x.dtype)


def fp8_moe_experts(x, w13, s13, w2, s2, topk_weights, topk_ids, swiglu_limit: Optional[float] = None):
    """Routed experts with fp8 weights [E, 2I, H] / [E, H, I] and per-row scales; activations
    quantized before each GEMM (the intermediate too)."""
    return _moe(
        x,
        topk_weights,
        topk_ids,
        lambda a, e: fp8_linear(a, w13[e], s13[e]),
        lambda a, e: fp8_linear(a, w2[e], s2[e]),
        swiglu_limit,
        w13.shape[0],
    )


def fp4_moe_experts(x, w13, s13, w2, s2, topk_weights, topk_ids, swiglu_limit: Optional[float] = None):
    """Routed experts with packed fp4 weights [E, 2I, H/2] / [E, H, I/2] and e8m0 scales."""
    return _moe(
        x,
        topk_weights,
        topk_ids,
        lambda a, e: fp4_linear(a, w13[e], s13[e]),
        lambda a, e: fp4_linear(a, w2[e], s2[e]),
        swiglu_limit,
        w13.shape[0],
    )
