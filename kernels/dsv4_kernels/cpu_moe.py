"""A MoE layer's experts on the CPU as one native call for a decode step's few tokens
(csrc/cpu_moe.c): the routed experts' SwiGLU and weighted sum over each token's top-k, plus the
shared expert (or, with no routed experts, a dense MLP of the same SwiGLU shape).

At decode sizes the torch form (dsv4_kernels.grouped_moe) is bound by per-expert ops and small-M
GEMM set-up; the step's real floor is reading each used expert's weights once, which is what the
C loop does: a block of weight rows stays in L1 while every token routed to that expert is dotted
with it. Above MAX_TOKENS tokens (prefill chunks) the GEMMs win and callers keep the torch path.

`applies()` is False where the call cannot run: no compiler (dsv4_kernels.native), DSV4_NO_NATIVE=1
or DSV4_NO_NATIVE_MOE=1, weights or activations that are not dense fp32 on the CPU (quantized
experts keep their own path), or more than MAX_TOKENS tokens.

`linear(x, W)` is a dense projection y = x @ W^T through the same loop, for a decode step's
q/kv/o projections, router gate and lm_head: a small-M GEMM with the weights cold in memory (a
step streams more weights than the L3 holds) reads them at a fraction of the memory's speed
(MKL, one thread, [576, 512] fp32: 8.5 GB/s at 1 token, 3.3 GB/s at 32), the loop at close to
a plain read's. `applies_linear()` says where it runs (up to MAX_LINEAR_TOKENS tokens, no
gradient wanted); DSV4_NO_NATIVE_LINEAR=1 turns it off alone."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_wire import switches
from dsv4_kernels.native import F32, I64, P

# Tokens per call up to which the native loop beats the grouped GEMMs (decode steps); 0 turns
# the native path off (bench/ab_decode_step.py's "native-moe" before side).
MAX_TOKENS = 64
# Tokens up to which linear() beats F.linear with the weights cold in memory (measured:
# bench/results/decode_breakdown/14-native-linear.json); 0 turns it off (bench/ab_decode_step.py's
# "native-linear" before side). At 64 tokens the loop is compute-bound and K = 128 rows lost.
MAX_LINEAR_TOKENS = 48

_lib: Optional[ctypes.CDLL] = None


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "cpu_moe",
            ["-march=native"],
            off_env="DSV4_NO_NATIVE_MOE",
            signatures={
                "cpu_moe": ([P, I64, I64, P, P, I64, P, P, I64, I64, P, P, I64, F32, P], ctypes.c_int),
                "cpu_moe_lanes": ([], ctypes.c_int),
                "cpu_linear": ([P, I64, I64, I64, P, I64, P], ctypes.c_int),
            },
        )
        # built without 8-wide vectors (no AVX: SSE-only x86, or another ISA) the loop was slower
        # than torch's GEMMs from 8 tokens an expert on the one machine measured: keep torch there
        if _lib is not None and _lib.cpu_moe_lanes() < 8:
            _lib = None
    return _lib is not None


def _dense_f32(t: Optional[torch.Tensor]) -> bool:
    return t is None or (type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu")


def applies(x: torch.Tensor, *weights: Optional[torch.Tensor]) -> bool:
    """Whether experts(x, ...) / mlp(x, ...) run natively for these tensors (see the module doc)."""
    return (
        0 < x.shape[0] <= MAX_TOKENS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and all(_dense_f32(w) for w in weights)
        and available()
    )


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def experts(
    x: torch.Tensor,
    w13: Optional[torch.Tensor],
    w2: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    topk_ids: Optional[torch.Tensor],
    shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    swiglu_limit: Optional[float] = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * w2[e] @ (silu(gate_e x_t) * (up_e x_t)), e = ids[t,k], plus the
    shared expert's SwiGLU of x_t when `shared` = (s_w13 [2Is, D], s_w2 [D, Is]) is given.

    x [T, D] fp32, w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I] (None with no routed
    experts: then `shared` alone is a dense MLP). An id outside [0, E) adds nothing (another
    rank's expert). swiglu_limit > 0 clamps as DeepSeek-V4 (gate <= limit, |up| <= limit), for
    the shared expert too. Call only where applies() holds."""
    assert _lib is not None, "call applies() / available() first"
    T, D = x.shape
    x = _c(x)
    out = torch.empty(T, D, dtype=torch.float32)
    # (w13, w2, E, I, ids, weights, k): no routed experts is E = k = 0
    routed: tuple = (None, None, 0, 0, None, None, 0)
    if w13 is not None:
        w13, w2 = _c(w13), _c(w2)
        ids = _c(topk_ids.to(torch.int32))
        wts = _c(topk_weights.to(torch.float32))
        routed = (
            w13.data_ptr(),
            w2.data_ptr(),
            w13.shape[0],
            w13.shape[1] // 2,
            ids.data_ptr(),
            wts.data_ptr(),
            ids.shape[1],
        )
    sh: tuple = (None, None, 0)
    if shared is not None:
        s13, s2 = _c(shared[0]), _c(shared[1])
        sh = (s13.data_ptr(), s2.data_ptr(), s13.shape[0] // 2)
    w13p, w2p, n_exp, inter, idp, wtp, k = routed
    limit = float(swiglu_limit or 0.0)
    rc = _lib.cpu_moe(x.data_ptr(), T, D, idp, wtp, k, w13p, w2p, n_exp, inter, *sh, limit, out.data_ptr())
    if rc != 0:
        raise MemoryError("cpu_moe: scratch allocation failed")
    return out


def mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """A dense SwiGLU MLP w2 @ (silu(gate x) * (up x)) (w13 [2I, D], w2 [D, I]) through the same loop."""
    return experts(x, None, None, None, None, (w13, w2), swiglu_limit)


def applies_linear(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether linear(x, w) runs natively: x [T, K] fp32 on the CPU with contiguous channels (rows
    may be strided), w [N, K] fp32 contiguous, 0 < T <= MAX_LINEAR_TOKENS, no gradient wanted
    (the C loop has no backward), the library built and DSV4_NO_NATIVE_LINEAR unset."""
    return (
        type(x) is torch.Tensor
        and type(w) is torch.Tensor
        and x.dim() == 2
        and w.dim() == 2
        and 0 < x.shape[0] <= MAX_LINEAR_TOKENS
        and x.shape[1] == w.shape[1]
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and (x.stride(1) == 1 or x.shape[1] == 1)
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and not switches.on("DSV4_NO_NATIVE_LINEAR")
        and available()
    )


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias as a new [T, N] tensor: fp32 sums in the loop's order, not
    MKL's (rounding differences only). Call only where applies_linear() holds."""
    assert _lib is not None, "call applies_linear() / available() first"
    T, K = x.shape
    out = torch.empty(T, w.shape[0], dtype=torch.float32)
    _lib.cpu_linear(x.data_ptr(), T, K, x.stride(0), w.data_ptr(), w.shape[0], out.data_ptr())
    return out
