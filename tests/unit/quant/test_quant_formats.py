"""Quantized checkpoints: which configs load, the encodings, pairing weights with their scales,
and the weight the model holds on GPU (QuantWeight) — everything short of running a model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dsv4_engine.quant import (
    QuantWeight,
    UnsupportedQuantization,
    checkpoint_scheme,
    pair_quantized,
    scheme_from_config,
)
from dsv4_engine.quant.codec import dequantize_fp4, dequantize_fp8_block, quantize_fp4, quantize_fp8_block
from dsv4_engine.quant.scheme import QuantScheme

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


# ---- scheme --------------------------------------------------------------------------------------


def test_v3_and_v4_release_configs_are_accepted():
    assert scheme_from_config({}) is None
    assert scheme_from_config({"quantization_config": FP8_CONFIG}) == QuantScheme()
    v4 = scheme_from_config({"quantization_config": {**FP8_CONFIG, "scale_fmt": "ue8m0"}, "expert_dtype": "fp4"})
    assert (v4.scale_fmt, v4.expert_dtype) == ("ue8m0", "fp4")


@pytest.mark.parametrize(
    "q,named",
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "gptq"}, "'gptq'"),
        ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size None"),
        ({**FP8_CONFIG, "weight_block_size": [64, 64]}, "[64, 64]"),
        ({**FP8_CONFIG, "fmt": "e5m2"}, "'e5m2'"),
        ({**FP8_CONFIG, "activation_scheme": "static"}, "'static'"),
        ({**FP8_CONFIG, "expert_dtype": "int4"}, "'int4'"),
    ],
)
def test_unsupported_configs_fail_with_one_line_naming_them(q, named):
    with pytest.raises(UnsupportedQuantization) as e:
        scheme_from_config({"quantization_config": q})
    assert named in str(e.value) and "\n" not in str(e.value)


def _folder(tmp_path, tensors, config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    q, s = quantize_fp8_block(torch.randn(64, 64))
    d = _folder(
        tmp_path, {"a.weight": q, "a.weight_scale_inv": s, "b.weight": torch.randn(4)}, {"model_type": "deepseek_v3"}
    )
    with pytest.raises(UnsupportedQuantization, match="no quantization_config: refusing to guess"):
        checkpoint_scheme(d)
    d2 = _folder(tmp_path / "plain", {"b.weight": torch.randn(4)}, {"model_type": "deepseek_v3"})
    assert checkpoint_scheme(d2) is None


# ---- codec ---------------------------------------------------------------------------------------


def test_fp8_block_round_trip_with_partial_edge_blocks():
    w = torch.randn(200, 300) * 0.05
    w[130:, 260:] *= 50  # one block far larger than the others: per-block scales keep the rest precise
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = dequantize_fp8_block(q, s)
    # e4m3 rounds to 3 mantissa bits: relative error <= 2**-4 of each block's amax
    for bi in range(2):
        for bj in range(3):
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            assert (back[blk] - w[blk]).abs().max() <= 2**-4 * w[blk].abs().max() + 1e-12
    pq, ps = quantize_fp8_block(w, pow2=True)
    assert torch.equal(torch.exp2(torch.log2(ps).round()), ps)  # ue8m0-representable
    assert (dequantize_fp8_block(pq, ps) - w).abs().max() <= 2**-3 * w.abs().max()


def test_fp4_round_trip_and_grid():
    w = torch.randn(6, 64)
    packed, exps = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32) and exps.shape == (6, 2)
    back = dequantize_fp4(packed, exps)
    scale = torch.exp2(exps.float() - 127).repeat_interleave(32, 1)
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    v = (back / scale).abs()
    assert ((v[..., None] - grid).abs().min(-1).values == 0).all()  # every value on the e2m1 grid
    assert (back - w).abs().max() <= (scale * 1.0).max()  # at most half the widest grid gap (2) per value
    assert v.max() <= 6  # the scale leaves no value clipped


def test_our_encodings_read_the_same_in_transformers():
    fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    deq = fp8_mod.Fp8Dequantize(None)._dequantize_one
    w = torch.randn(256, 384)
    q, s = quantize_fp8_block(w)  # whole blocks: transformers infers the block from the grid
    assert torch.equal(deq(q, s, torch.float32), dequantize_fp8_block(q, s))
    packed, exps = quantize_fp4(torch.randn(8, 64))
    assert torch.equal(deq(packed, exps.view(torch.float8_e8m0fnu), torch.float32), dequantize_fp4(packed, exps))


# ---- pairing ---------------------------------------------------------------------------------------


def test_pairing_reads_both_scale_spellings_and_fp4_experts():
    w = torch.randn(200, 72)
    q, s = quantize_fp8_block(w)
    p4, e4 = quantize_fp4(torch.randn(40, 64))
    raw = {
        "x.scale": s.clone(),
        "x.weight": q,  # V4 release spelling, scale listed first
        "y.weight": q,
        "y.weight_scale_inv": s,  # V3 / transformers spelling
        "z.weight": p4,
        "z.scale": e4.view(torch.float8_e8m0fnu),
        "norm.weight": torch.ones(3),
    }
    out, report = pair_quantized(raw, QuantScheme(expert_dtype="fp4"))
    assert set(out) == {"x.weight", "y.weight", "z.weight", "norm.weight"}
    assert report.counts == {"fp8": 2, "fp4": 1, "float32": 1}
    for k in ("x.weight", "y.weight"):
        # block scales stay as stored: resident bytes are the checkpoint's
        assert out[k].kind == "fp8" and out[k].shape == (200, 72) and out[k].scale.shape == (2, 1)
        assert torch.equal(out[k].dequantize(), dequantize_fp8_block(q, s))
    assert out["z.weight"].kind == "fp4" and out["z.weight"].shape == (40, 64)
    assert torch.equal(out["z.weight"].dequantize(), dequantize_fp4(p4, e4))


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, "no scales for it"),
        (
            {"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(2, 2)},
            r"needs scales \(1, 1\)",
        ),
        ({"a.weight": torch.zeros(4, 4).to(torch.float8_e5m2)}, "e4m3 fp8 weights only"),
    ],
)
def test_pairing_refuses_what_it_would_read_wrong(raw, match):
    with pytest.raises(UnsupportedQuantization, match=match):
        pair_quantized(raw, QuantScheme())


def test_fp4_weights_need_a_scheme_that_declares_them():
    p4, e4 = quantize_fp4(torch.randn(4, 32))
    with pytest.raises(UnsupportedQuantization, match="expert_dtype 'fp8'"):
        pair_quantized({"e.weight": p4, "e.scale": e4}, QuantScheme())


# ---- the resident weight ----------------------------------------------------------------------------


def _qw(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    out, _ = pair_quantized(dict(zip(("w.weight", "w.weight_scale_inv"), quantize_fp8_block(w))), QuantScheme())
    return out["w.weight"]


def test_f_linear_cat_stack_index_and_chunk_on_a_quantized_weight():
    a, b = _qw(72, 200, 0), _qw(40, 200, 1)
    x = torch.randn(3, 5, 200)
    from dsv4_kernels import reference_quant as ref

    y = F.linear(x, a)
    assert y.shape == (3, 5, 72)
    torch.testing.assert_close(y, ref.fp8_linear(x.reshape(15, 200), a.data, a.scale).view(3, 5, 72))
    ab = torch.cat([a, b], 0)  # rows of different 128-blocks: per-row scales make this exact
    assert isinstance(ab, QuantWeight) and ab.shape == (112, 200)
    assert torch.equal(ab.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    stack = torch.stack([ab, ab])
    assert stack.shape == (2, 112, 200) and torch.equal(stack[1].dequantize(), ab.dequantize())
    top, bottom = ab.chunk(2, dim=0)
    assert torch.equal(bottom.dequantize(), ab.dequantize()[56:])
    assert ab.nbytes == 112 * 200 + 112 * 2 * 4  # 72 rows end mid-block: scales repeated per row
    c, d = _qw(128, 200, 2), _qw(40, 200, 3)
    cd = torch.cat([c, d], 0)  # c ends on a block boundary: the block scales stay compact
    assert cd.scale.shape == (2, 2) and torch.equal(cd.dequantize(), torch.cat([c.dequantize(), d.dequantize()]))
    assert torch.equal(F.linear(x, cd), F.linear(x, cd.per_row()))
    with pytest.raises(TypeError, match="not defined on a quantized"):
        torch.matmul(x, a)
