"""Checkpoints that claim to be quantized but cannot be read as they are: refused in one line
from the safetensors headers alone (before any weight is read, and at --tp-size > 1 before any
rank starts), never served wrong; and the well-formed edge cases that must load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dsv4_engine.quant import UnsupportedQuantization, checkpoint_scheme, pair_quantized
from dsv4_engine.quant.codec import quantize_fp4, quantize_fp8_block
from dsv4_engine.quant.scheme import QuantScheme, tensor_refusal

V3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
V4_FP4 = {**V3, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
F8, F32 = "F8_E4M3", "F32"


@pytest.mark.parametrize(
    "tensors,named",
    [
        # an fp8 weight whose scales are missing (V3 and V4 spellings expected)
        (
            {"l.wq_b.weight": (F8, (256, 64)), "l.wo.weight": (F8, (64, 256)), "l.wo.scale": (F32, (1, 2))},
            "l.wq_b.weight is fp8 (F8_E4M3) but the checkpoint has no scales",
        ),
        # scales on a block grid other than 128x128 (a [64, 64] checkpoint relabelled)
        ({"a.weight": (F8, (200, 72)), "a.weight_scale_inv": (F32, (4, 2))}, r"needs scales (2, 1) for 128x128"),
        # per-tensor scale
        ({"a.weight": (F8, (200, 72)), "a.weight_scale_inv": (F32, ())}, "needs scales (2, 1)"),
        ({"a.weight": ("F8_E5M2", (4, 4)), "a.weight_scale_inv": (F32, (1, 1))}, "e4m3 fp8 weights only"),
        # fp4 scales per 16 values instead of 32
        ({"e.weight": ("I8", (40, 32)), "e.scale": ("F8_E8M0", (40, 4))}, r"needs one scale per 32 values (40, 2)"),
        # values cast to float with their scales left beside them: dequantized or not?
        ({"a.weight": ("BF16", (4, 4)), "a.weight_scale_inv": (F32, (1, 1))}, "BF16 (not quantized) but"),
    ],
)
def test_tensors_that_cannot_be_read_as_declared_are_refused_in_one_line(tensors, named):
    why = tensor_refusal(tensors, QuantScheme(expert_dtype="fp4"))
    assert why is not None and named in why and "\n" not in why


def test_packed_fp4_experts_need_their_declaration_and_scales_need_a_config():
    fp4 = {"e.weight": ("I8", (40, 32)), "e.scale": ("U8", (40, 2))}
    assert tensor_refusal(fp4, QuantScheme(expert_dtype="fp4")) is None
    assert "expert_dtype 'fp8'" in tensor_refusal(fp4, QuantScheme())
    # int8 values with uint8 scales: no quantized dtype code at all, still not a float checkpoint
    assert "no quantization_config" in tensor_refusal(fp4, None)
    # an int8 tensor without scales is no fp4 weight (V4's tid2eid is int32; ids may be int8)
    assert tensor_refusal({"g.tid2eid": ("I8", (5, 2))}, QuantScheme()) is None


def test_a_float_weight_with_scales_is_refused_with_or_without_a_config():
    t = {"l.wq.weight": ("BF16", (4, 4)), "l.wq.scale": (F32, (1, 1))}  # V4 spelling, config dropped too
    for scheme in (None, QuantScheme()):
        assert "BF16 (not quantized) but the checkpoint also holds scales for it (l.wq.scale)" in tensor_refusal(
            t, scheme
        )


def test_well_formed_edges_load():
    ok = {
        "a.weight": (F8, (200, 72)),
        "a.weight_scale_inv": (F32, (2, 1)),  # partial edge blocks
        "b.weight": (F8, (576, 512)),
        "b.scale": ("F8_E8M0", (5, 4)),  # V4 spelling, 4.5 row blocks
        "ex.gate_up_proj": (F8, (4, 256, 72)),
        "ex.gate_up_proj_scale_inv": (F32, (4, 2, 1)),  # fused experts
        "n.weight": (F32, (72,)),
        "a.weight_alone": (F32, (3,)),
    }
    assert tensor_refusal(ok, QuantScheme()) is None


def _folder(d, tensors, config):
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **config}))
    return d


def test_the_check_reads_the_files_headers_and_skips_what_is_never_loaded(tmp_path):
    q, s = quantize_fp8_block(torch.randn(130, 72))
    good = {"a.weight": q, "a.scale": s.to(torch.float8_e8m0fnu)}
    assert checkpoint_scheme(_folder(tmp_path / "ok", good, {"quantization_config": {**V3, "scale_fmt": "ue8m0"}}))
    # the MTP layer is never read, so its (here broken) tensors do not block serving
    mtp = _folder(tmp_path / "mtp", {**good, "mtp.0.wq.weight": q.clone()}, {"quantization_config": V3})
    assert checkpoint_scheme(mtp) == QuantScheme()
    bad = _folder(
        tmp_path / "bad", {**good, "layers.1.ffn.experts.3.w2.weight": q.clone()}, {"quantization_config": V3}
    )
    with pytest.raises(UnsupportedQuantization, match=r"experts\.3\.w2\.weight is fp8 .* no scales"):
        checkpoint_scheme(bad)
    p4, e4 = quantize_fp4(torch.randn(8, 64))
    undeclared = _folder(tmp_path / "nocfg", {"e.weight": p4, "e.scale": e4}, {})
    with pytest.raises(UnsupportedQuantization, match="model.safetensors holds quantized tensor e.weight"):
        checkpoint_scheme(undeclared)


def test_pairing_refuses_a_float_weight_that_carries_scales():
    q, s = quantize_fp8_block(torch.randn(8, 8))
    with pytest.raises(UnsupportedQuantization, match="not quantized"):
        pair_quantized({"a.weight": q.float(), "a.weight_scale_inv": s}, QuantScheme())


@pytest.mark.slow  # 6-18 s; the default run has tiny's and v4-tiny's oracles and tiny at odd widths
def test_mla512_fp8_gives_transformers_greedy_tokens_on_its_dequantized_twin(tmp_path):
    """The oracle tests cover tiny and v4-tiny; mla512 adds the real 576-wide latent (kv_a's 576
    rows: 4.5 blocks), whole 128-blocks elsewhere and YaRN rope: served on CPU against
    transformers on the float twin."""
    transformers = pytest.importorskip("transformers")
    from test_quant_oracle import NEW_TOKENS, engine_greedy, hf_greedy, prompts

    from dsv4_engine.checkpoint import dequantize_checkpoint, init_checkpoint

    q = init_checkpoint(tmp_path / "fp8", preset="mla512", quant="fp8")
    twin = dequantize_checkpoint(q, tmp_path / "twin")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size, [9, 40], seed=3)
    outs = engine_greedy(q, ps)
    for i, p in enumerate(ps):
        assert outs[i] == hf_greedy(hf, p, NEW_TOKENS), i


# Widths that are multiples of neither 128 nor each other on every layer type: K = 200 / 160
# (hidden), 96 / 72 (q LoRA), 80 (kv LoRA), 72 / 96 (experts), 300 (dense MLP).
V3_ODD = {
    "hidden_size": 200,
    "intermediate_size": 300,
    "moe_intermediate_size": 72,
    "q_lora_rank": 96,
    "kv_lora_rank": 80,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 40,
}
V4_ODD = {"hidden_size": 160, "moe_intermediate_size": 96, "q_lora_rank": 72, "o_lora_rank": 40, "index_head_dim": 24}


@pytest.mark.parametrize(
    "base,odd,quant",
    [
        ("tiny", V3_ODD, "fp8"),
        # V4's oracle decodes token by token in transformers: 5-30 s each on a loaded box
        pytest.param("v4-tiny", V4_ODD, "fp8", marks=pytest.mark.slow),
        pytest.param("v4-tiny", V4_ODD, "fp4-experts", marks=pytest.mark.slow),
    ],
)
def test_odd_widths_on_every_layer_type_match_transformers_and_the_cuda_form(tmp_path, monkeypatch, base, odd, quant):
    """~3 s (V3)."""
    transformers = pytest.importorskip("transformers")
    from test_quant_oracle import engine_greedy, engine_greedy_runner, hf_greedy, hf_v4_greedy, prompts

    from dsv4_engine import checkpoint as ck
    from dsv4_engine.model_runner import ModelRunner
    from dsv4_kernels import reference_quant

    monkeypatch.setitem(ck.PRESETS, "odd", {**ck.PRESETS[base], **odd})
    q = ck.init_checkpoint(tmp_path / "q", preset="odd", quant=quant)
    twin = ck.dequantize_checkpoint(q, tmp_path / "twin")
    v4 = base.startswith("v4")
    hf = (
        (transformers.DeepseekV4ForCausalLM if v4 else transformers.DeepseekV3ForCausalLM)
        .from_pretrained(str(twin), dtype=torch.float32)
        .eval()
    )
    ps = prompts(512, [9, 37], seed=4)
    outs = engine_greedy(q, ps, 12)
    for i, p in enumerate(ps):
        assert outs[i] == (hf_v4_greedy if v4 else hf_greedy)(hf, p, 12), i
    # the CUDA form (kept quantized, references for the kernels) equals the dense model with
    # activation rounding off: concatenated / stacked partial blocks add nothing
    dense = ModelRunner(str(q), "float32", "cpu", "torch")
    monkeypatch.setattr("dsv4_engine.quant.load.keep_quantized", lambda device: True)
    kept = ModelRunner(str(q), "float32", "cpu", "torch")
    monkeypatch.setattr(
        reference_quant,
        "fp8_act_quant",
        lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))),
    )
    prompt = prompts(512, [20], seed=6)[0]
    torch.testing.assert_close(
        engine_greedy_runner(kept, prompt), engine_greedy_runner(dense, prompt), atol=1e-4, rtol=1e-4
    )
