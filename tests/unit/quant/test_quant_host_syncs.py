"""The quantized GPU path adds no host syncs: the fp8/fp4 linears and expert launchers (what a
CUDA engine's F.linear and expert calls run) read no device value on the host and make no op whose
shape depends on values, so decode steps stay capturable in CUDA graphs. Interpreter on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from host_sync_probe import count_host_syncs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantized_linears_and_experts_make_no_host_syncs():
    from dsv4_kernels.triton_kernels.fp4_gemm import fp4_linear, fp4_moe_experts
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_linear, fp8_moe_experts

    g = torch.Generator().manual_seed(0)
    E, H, inter, T = 4, 128, 64, 3
    x = torch.randn(T, H, generator=g).to(DEV)
    q8 = lambda *s: (torch.randn(*s, generator=g) * 20).to(torch.float8_e4m3fn).to(DEV)  # noqa: E731
    sc = lambda *s: torch.rand(*s, generator=g).to(DEV) * 0.01  # noqa: E731
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.int64).to(torch.uint8).to(DEV)  # noqa: E731
    exps = lambda *s: torch.full(s, 124, dtype=torch.uint8, device=DEV)  # noqa: E731
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], device=DEV)
    wts = torch.rand(T, 2, generator=g).to(DEV)
    with count_host_syncs() as hits:
        fp8_linear(x, q8(96, H), sc(1, 1))
        fp8_moe_experts(x, q8(E, 2 * inter, H), sc(E, 1, 1), q8(E, H, inter), sc(E, 1, 1), wts, ids, 1.5)
        fp4_linear(x, u8(96, H // 2), exps(96, H // 32))
        fp4_moe_experts(
            x,
            u8(E, 2 * inter, H // 2),
            exps(E, 2 * inter, H // 32),
            u8(E, H, inter // 2),
            exps(E, H, inter // 32),
            wts,
            ids,
            1.5,
        )
    assert hits == [], "\n".join(hits)
    # the probe sees what the CPU reference does (a per-expert loop reads the expert ids)
    from dsv4_kernels import reference_quant as ref

    with count_host_syncs() as ref_hits:
        ref.fp8_moe_experts(x, q8(E, 2 * inter, H), sc(E, 1, 1), q8(E, H, inter), sc(E, 1, 1), wts, ids, 1.5)
    assert ref_hits
