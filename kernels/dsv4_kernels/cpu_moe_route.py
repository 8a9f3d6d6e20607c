"""DeepSeek-V3 noaux_tc routing for a decode step on the CPU with the expert choice as one native
call (csrc/moe_route_cpu.c) instead of ~12 torch ops (reference.moe_route). The sigmoid and
the weights (gather, normalise, scale) stay in torch, so their bits are torch's; the C choice
is the same as torch.topk's wherever the values are distinct, and wherever a tie or NaN could
decide it the call falls back to reference.moe_route whole: the result is always the torch
form's, bit for bit.

Where no compiler works, or DSV4_NO_NATIVE_ROUTE=1 or DSV4_NO_NATIVE=1, `available()` is False."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_kernels.native import I64, P
from dsv4_kernels import reference as ref

_lib: Optional[ctypes.CDLL] = None


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "moe_route_cpu",
            ["-march=native", "-ffp-contract=off"],
            off_env="DSV4_NO_NATIVE_ROUTE",
            signatures={
                "moe_route_select": ([P, P, I64, I64, I64, I64, I64, P], ctypes.c_int),
            },
        )
    return _lib is not None


def supports(router_logits: torch.Tensor, correction_bias: torch.Tensor) -> bool:
    """fp32 CPU logits [T, E] and bias [E]."""
    return (
        router_logits.device.type == "cpu"
        and router_logits.dtype == torch.float32
        and router_logits.dim() == 2
        and correction_bias.dtype == torch.float32
        and correction_bias.is_contiguous()
        and correction_bias.shape == (router_logits.shape[1],)
    )


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.moe_route (same arguments, same results)."""
    assert _lib is not None, "call available() first"
    T, E = router_logits.shape
    scores = router_logits.float().sigmoid()
    ids = torch.empty(T, top_k, dtype=torch.int64)
    rc = _lib.moe_route_select(
        scores.data_ptr(), correction_bias.data_ptr(), T, E, n_group, topk_group, top_k, ids.data_ptr()
    )
    if rc:
        return ref.moe_route(
            router_logits, correction_bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor
        )
    return ref.route_weights(scores, ids, norm_topk_prob, routed_scaling_factor)
