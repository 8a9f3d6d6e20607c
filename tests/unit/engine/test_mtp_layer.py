"""The MTP layer in the checkpoint (DeepSeek-V3's layout), the engine's forward of it, and the
trainable forwards `--train-mtp` and `--train` use: each computes the engine's logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dsv4_engine.checkpoint import init_checkpoint


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return init_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", preset="tiny", seed=0, mtp=True)


def test_mtp_checkpoint_layout(tiny_mtp, tiny_model):
    cfg = json.loads((tiny_mtp / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    n = cfg["num_hidden_layers"]
    with safe_open(str(tiny_mtp / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        p = f"model.layers.{n}."
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "mlp.gate.weight",
            "mlp.experts.0.gate_proj.weight",
            "input_layernorm.weight",
        ):
            assert p + name in keys, name
        assert f.get_slice(p + "eh_proj.weight").get_shape() == [cfg["hidden_size"], 2 * cfg["hidden_size"]]
        # The release keeps copies of the main embedding and head in the block.
        assert torch.equal(f.get_tensor(p + "shared_head.head.weight"), f.get_tensor("lm_head.weight"))
    # The default preset is unchanged: no MTP block.
    assert json.loads((tiny_model / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith(f"model.layers.{n}.") for k in f.keys())


def test_trainable_forward_equals_the_engines(tiny_mtp):
    from safetensors.torch import load_file

    from dsv4_engine.batch_buffers import host_batch
    from dsv4_engine.config import ModelConfig
    from dsv4_engine.model_runner import get_ops
    from dsv4_engine.models.deepseek_v3 import DeepseekV3
    from dsv4_engine.models.forward_batch import ForwardBatch
    from dsv4_engine.spec_decode.mtp_layer import STATE, MTPLayer
    from dsv4_engine.spec_decode.train import TrainableMTP, _hidden_and_logits
    from dsv4_engine.weights import load_weights

    cfg = ModelConfig.from_dir(tiny_mtp)
    model = DeepseekV3(cfg, load_weights(tiny_mtp), get_ops("cpu"), torch.float32, torch.device("cpu"))
    seq = list(range(5, 45))
    hidden, _ = _hidden_and_logits(model, seq)
    with torch.no_grad():
        trained = TrainableMTP(cfg, load_file(str(tiny_mtp / "model.safetensors")), cfg.num_hidden_layers, model)
        a = trained.forward(torch.tensor(seq[1:]), hidden[:-1])
    T, page = len(seq) - 1, 16
    n = -(-T // page)
    states = {STATE: torch.zeros(n, 1, page, cfg.kv_cache_dim)}
    hb = host_batch([0], [T], [list(range(n))], [seq[1:]], [None], page)
    t = {
        k: torch.from_numpy(getattr(hb, k))
        for k in ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "extend_lens", "logits_indices")
    }
    fb = ForwardBatch(**t, all_decode=False, page_size=page, seq_lens_host=[T], extend_lens_host=[T])
    b, _ = MTPLayer(model, tiny_mtp).forward(fb, states, hidden[:-1], rows=torch.arange(T))
    # fp32 through one layer and the head (logits of order 10): summation-order rounding only.
    assert (a - b).abs().max() < 1e-3 * max(1.0, float(b.abs().max()))
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_trainable_main_model_equals_the_engines(tiny_mtp):
    from safetensors.torch import load_file

    from dsv4_engine.config import ModelConfig
    from dsv4_engine.model_runner import get_ops
    from dsv4_engine.models.deepseek_v3 import DeepseekV3
    from dsv4_engine.spec_decode.train import TrainableV3, _hidden_and_logits, corpus_prompts
    from dsv4_engine.weights import load_weights

    cfg = ModelConfig.from_dir(tiny_mtp)
    model = DeepseekV3(cfg, load_weights(tiny_mtp), get_ops("cpu"), torch.float32, torch.device("cpu"))
    seqs = corpus_prompts(tiny_mtp, 2, 24, seed=0)
    assert len(seqs) == 2 and all(len(s) == 24 for s in seqs) and seqs[0] != seqs[1]
    with torch.no_grad():
        a = TrainableV3(cfg, load_file(str(tiny_mtp / "model.safetensors")), model).forward(torch.tensor(seqs))
    for row, seq in zip(a, seqs):
        _, b = _hidden_and_logits(model, seq)
        # fp32 through four layers and the head: summation-order rounding only.
        assert (row - b).abs().max() < 1e-3 * max(1.0, float(b.abs().max()))
        assert torch.equal(row.argmax(-1), b.argmax(-1))


def test_train_base_lowers_the_corpus_loss(tmp_path):
    torch.set_num_threads(1)
    from dsv4_engine.spec_decode.train import train_base

    d = init_checkpoint(tmp_path / "m", preset="tiny", seed=2, mtp=True)
    before = (d / "model.safetensors").read_bytes()
    report = train_base(d, steps=8, batch=2, seq_len=16)
    assert report["loss_last20_mean"] < report["loss_first"], report
    assert (d / "model.safetensors").read_bytes() != before
    # The MTP block's copies of the embedding and head (what the engine's drafter reads) follow.
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for copy, main in (
            ("embed_tokens.weight", "model.embed_tokens.weight"),
            ("shared_head.head.weight", "lm_head.weight"),
        ):
            assert torch.equal(f.get_tensor("model.layers.4." + copy), f.get_tensor(main)), copy


@pytest.mark.slow
def test_train_mtp_raises_agreement(tmp_path):
    torch.set_num_threads(1)
    from dsv4_engine.spec_decode.train import train_mtp

    d = init_checkpoint(tmp_path / "m", preset="tiny", seed=1, mtp=True)
    report = train_mtp(d, steps=60, num_prompts=16, new_tokens=24)
    assert report["held_out_top1_agreement_after"] > report["held_out_top1_agreement_before"]
