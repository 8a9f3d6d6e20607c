"""The compiled kernels against the torch oracles on a GPU, at real widths and many tokens,
with tolerances that admit the device's approximate math: `tl.exp`/`exp2`, `rsqrt`, `sigmoid`
and `/` compile to approximate instructions (ex2.approx, rsqrt.approx, div.full: a few ulp),
where the interpreter (the CPU tests) computes them exactly. A routing choice may therefore
differ from the oracle's where two experts' scores tie to within that error; elsewhere the
chosen experts must be the same and their weights close. Skipped without CUDA
(bench/gpu_kernels.sh runs them)."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference
from dsv4_kernels import reference_v4 as ref_v4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA device")

# A few ulp of fp32 on scores of order 1: what ex2.approx / rsqrt.approx / div.full may move them.
SCORE_TIE = 1e-5


def assert_same_choices_up_to_ties(choice: torch.Tensor, got_ids, want_ids, got_w, want_w, top_k: int) -> None:
    """Per token: the same set of experts, or sets that differ only among experts whose choice
    score is within SCORE_TIE of the k-th best (a near-tie the device may break either way).
    Weights are compared on the tokens whose sets agree."""
    choice = choice.double().cpu()
    got_ids, want_ids = got_ids.long().cpu(), want_ids.long().cpu()
    kth = choice.topk(top_k, dim=-1).values[:, -1]
    agree = []
    for t in range(choice.shape[0]):
        a, b = set(got_ids[t].tolist()), set(want_ids[t].tolist())
        if a == b:
            agree.append(t)
            continue
        for e in a ^ b:
            assert abs(float(choice[t, e]) - float(kth[t])) <= SCORE_TIE, (
                f"token {t}: expert {e} (score {float(choice[t, e]):.8f}) is no near-tie of the k-th "
                f"choice ({float(kth[t]):.8f})"
            )
    assert len(agree) >= 0.95 * choice.shape[0], f"only {len(agree)} of {choice.shape[0]} tokens agree"
    idx = torch.tensor(agree)
    order_g = got_ids[idx].argsort(-1)
    order_w = want_ids[idx].argsort(-1)
    torch.testing.assert_close(
        got_w.float().cpu()[idx].gather(1, order_g), want_w.float().cpu()[idx].gather(1, order_w), atol=1e-5, rtol=1e-4
    )


def test_v3_routing_at_deepseek_v3_width(device):
    from dsv4_kernels import triton_ops

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4096, 256, generator=gen) * 2).to(device)
    bias = (torch.rand(256, generator=gen) * 0.1).to(device)
    want_w, want_ids = reference.moe_route(logits, bias, 8, 4, 8, True, 2.5)
    got_w, got_ids = triton_ops.moe_route(logits, bias, 8, 4, 8, True, 2.5)
    choice = logits.float().sigmoid() + bias  # groups are kept or dropped as a whole: compare within kept ones
    assert_same_choices_up_to_ties(choice, got_ids, want_ids, got_w, want_w, 8)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_v4_routing_at_v4_flash_width(device, scoring):
    from dsv4_kernels.triton_kernels import v4_moe_route as route_k

    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4096, 256, generator=gen) * 3).to(device)
    bias = (torch.randn(256, generator=gen) * 0.05).to(device)
    ids_in = torch.randint(0, 1000, (4096,), generator=gen).to(device)
    want_w, want_ids = ref_v4.v4_moe_route(logits, bias, None, ids_in, 6, 1.5, scoring)
    got_w, got_ids = route_k.v4_moe_route(logits, bias, None, ids_in, 6, 1.5, scoring)
    scores = torch.nn.functional.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else logits.sigmoid()
    assert_same_choices_up_to_ties(scores + bias, got_ids, want_ids, got_w, want_w, 6)


def test_experts_at_decode_and_prefill_sizes_in_bf16(device):
    """bf16 operands on tensor cores, fp32 accumulation: within bf16 rounding of the output."""
    from dsv4_kernels import triton_ops

    for tokens in (4, 512):
        gen = torch.Generator().manual_seed(tokens)
        E, H, inter, k = 64, 1024, 256, 8
        x = torch.randn(tokens, H, generator=gen).to(device, torch.bfloat16)
        w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(device, torch.bfloat16)
        w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(device, torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(device, torch.int32)
        w = torch.rand(tokens, k, generator=gen).to(device)
        want = reference.moe_experts(x.float(), w13.float(), w2.float(), w, ids)
        got = triton_ops.moe_experts(x, w13, w2, w, ids)
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
