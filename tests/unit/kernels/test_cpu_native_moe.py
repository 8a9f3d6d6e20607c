"""The native CPU MoE call (dsv4_kernels.cpu_moe) against an fp64 evaluation of the same experts,
within the worst-case rounding bound of fp32 dot products, and against the torch form."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels import cpu_moe
from dsv4_kernels.reference import moe_experts

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="no native MoE here (no C compiler, or no AVX)")

U = 2.0**-24  # fp32 unit roundoff


def _swiglu64(x, w13, w2, limit):
    inter = w13.shape[0] // 2
    gu = x @ w13.t()
    g, u = gu[:, :inter], gu[:, inter:]
    if limit:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.silu(g) * u @ w2.t()


def _abs_bound(x, w13, w2):
    """sum_i |W2[d, i]| * G_i * U_i with G, U = |W_gate| |x|, |W_up| |x|: bounds |h| and
    the magnitudes every rounding error below scales with."""
    inter = w13.shape[0] // 2
    a = x.abs() @ w13.abs().t()
    return (a[:, :inter] * a[:, inter:]) @ w2.abs().t()


def _want(x, w13, w2, wts, ids, shared, limit):
    """(fp64 result, fp64 magnitude), expert by expert over its pairs; ids outside [0, E) skip."""
    x64 = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    if w13 is not None:
        for e in range(w13.shape[0]):
            t, j = (ids == e).nonzero(as_tuple=True)
            if len(t):
                a, b, w = w13[e].double(), w2[e].double(), wts[t, j].double()[:, None]
                out.index_add_(0, t, w * _swiglu64(x64[t], a, b, limit))
                mag.index_add_(0, t, w.abs() * _abs_bound(x64[t], a, b))
    if shared is not None:
        a, b = shared[0].double(), shared[1].double()
        out += _swiglu64(x64, a, b, limit)
        mag += _abs_bound(x64, a, b)
    return out, mag


def _tolerance(mag, D, inter, k):
    """Worst-case fp32 error, any summation order (|dot error| <= n u sum|a b| for length n):
    gate and up rows (length D) perturb h by <= (1.1 + 1) D u G U (|silu'| <= 1.1, |silu(g)| <= G)
    plus a few roundings of silu and the product; the down rows (length inter) add inter u; the
    weighting and the sum over k + the shared expert add k + 2."""
    return (2.1 * D + inter + 3 + k + 2) * U * mag + 1e-30


def _case(T, D, E, inter, k, *, seed, limit=None, shared_inter=0, hits="spread"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, inter, generator=g) / inter**0.5
    if hits == "spread":  # k distinct experts per token: some hit often, some never (E > k T)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:  # every token on the same k experts: one expert sees all T tokens
        ids = torch.arange(k).repeat(T, 1)
    ids = ids.int()
    wts = torch.rand(T, k, generator=g) + 0.1
    shared = None
    if shared_inter:
        shared = (
            torch.randn(2 * shared_inter, D, generator=g) / D**0.5,
            torch.randn(D, shared_inter, generator=g) / shared_inter**0.5,
        )
    return x, w13, w2, wts, ids, shared


@pytest.mark.parametrize(
    "T,D,E,inter,k,shared_inter,hits",
    [
        (1, 512, 8, 256, 2, 256, "spread"),  # mla512's shape at one stream
        (8, 512, 8, 256, 2, 256, "spread"),
        (64, 512, 8, 256, 2, 0, "spread"),
        (5, 72, 16, 40, 3, 24, "spread"),  # row lengths off the 16-lane vectors, rows off 4 / 8
        (33, 24, 64, 9, 8, 0, "spread"),  # k = 8 of 64: most experts hit 0-5 times
        (17, 48, 4, 20, 1, 12, "same"),  # one expert takes every token (4-wide token tiles + 1)
        (64, 96, 8, 32, 8, 16, "same"),  # every expert takes all 64 tokens
        # experts of 1-4 tokens read their rows one after another, two sums a token for 1 or 2:
        (1, 176, 8, 44, 2, 20, "same"),  # rows of 11 vectors (an odd one after the pairs) and 2 + 12 floats
        (2, 200, 4, 30, 1, 0, "same"),  # 12 vectors + 8 floats; 30 = 1 vector + 14 floats
        (3, 136, 8, 52, 2, 36, "same"),
        (4, 160, 8, 52, 2, 36, "same"),  # 4 tokens: the last one-pass width with AVX-512
        # 4 x 4 tiles and what is left (1-3 tokens), matrices past the prefetch distance (32 KB)
        (5, 520, 8, 100, 2, 0, "same"),
        (6, 520, 8, 100, 2, 36, "same"),
        (7, 136, 6, 28, 2, 0, "same"),
    ],
)
def test_experts_within_fp32_bound(T, D, E, inter, k, shared_inter, hits):
    x, w13, w2, wts, ids, shared = _case(T, D, E, inter, k, seed=T * 31 + k, shared_inter=shared_inter, hits=hits)
    got = cpu_moe.experts(x, w13, w2, wts, ids, shared)
    want, mag = _want(x, w13, w2, wts, ids, shared, None)
    err = (got.double() - want).abs()
    tol = _tolerance(mag, D, max(inter, shared_inter), k)
    assert (err <= tol).all(), f"max err {err.max():.3g}, at its tolerance {tol.flatten()[err.argmax()]:.3g}"
    if shared is None:  # and the torch form agrees to the same rounding
        ref = moe_experts(x, w13, w2, wts, ids)
        assert ((got.double() - ref.double()).abs() <= 2 * tol).all()


def test_other_ranks_experts_add_nothing():
    x, w13, w2, wts, ids, _ = _case(9, 64, 8, 32, 2, seed=5)
    ids[::2, 1] = -1  # tensor parallelism marks another rank's expert with -1
    ids[1, 0] = 8  # and an id past E is skipped too
    got = cpu_moe.experts(x, w13, w2, wts, ids)
    want, mag = _want(x, w13, w2, wts, ids, None, None)
    assert ((got.double() - want).abs() <= _tolerance(mag, 64, 32, 2)).all()


def test_v4_clamped_swiglu():
    x, w13, w2, wts, ids, shared = _case(6, 64, 8, 32, 2, seed=7, shared_inter=16)
    x = x * 8  # so that gate and up cross the limit
    got = cpu_moe.experts(x, w13, w2, wts, ids, shared, swiglu_limit=2.0)
    want, mag = _want(x, w13, w2, wts, ids, shared, 2.0)
    assert ((got.double() - want).abs() <= _tolerance(mag, 64, 32, 2)).all()
    unclamped, _ = _want(x, w13, w2, wts, ids, shared, None)
    assert (unclamped - want).abs().max() > 1.0  # the limit mattered in this case


def test_dense_mlp():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 128, generator=g)
    w13 = torch.randn(2 * 96, 128, generator=g) / 128**0.5
    w2 = torch.randn(128, 96, generator=g) / 96**0.5
    got = cpu_moe.mlp(x, w13, w2)
    want, mag = _want(x, None, None, None, None, (w13, w2), None)
    assert ((got.double() - want).abs() <= _tolerance(mag, 128, 96, 0)).all()
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, w2), rtol=1e-5, atol=1e-5)


def test_applies_only_to_small_fp32_cpu_batches(monkeypatch):
    w = torch.zeros(2, 8, 4)
    assert cpu_moe.applies(torch.zeros(cpu_moe.MAX_TOKENS, 4), w, w)
    assert not cpu_moe.applies(torch.zeros(cpu_moe.MAX_TOKENS + 1, 4), w, w)  # prefill: the GEMMs
    assert not cpu_moe.applies(torch.zeros(1, 4, dtype=torch.bfloat16), w, w)
    assert not cpu_moe.applies(torch.zeros(1, 4), w.bfloat16(), w)
    assert not cpu_moe.applies(torch.zeros(0, 4), w, w)
    monkeypatch.setattr(cpu_moe, "MAX_TOKENS", 0)
    assert not cpu_moe.applies(torch.zeros(1, 4), w, w)


@pytest.mark.parametrize("env", ["DSV4_NO_NATIVE_MOE", "DSV4_NO_NATIVE"])
def test_switches_turn_it_off(env, monkeypatch):
    from dsv4_kernels import native

    monkeypatch.setattr(native, "_loaded", {})  # as in a fresh process
    monkeypatch.setattr(cpu_moe, "_lib", None)
    monkeypatch.setenv(env, "1")
    assert not cpu_moe.available()
    assert not cpu_moe.applies(torch.zeros(1, 4), torch.zeros(2, 8, 4), torch.zeros(2, 4, 4))
