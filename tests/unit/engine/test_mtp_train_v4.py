"""`--train` / `--train-mtp` on a DeepSeek-V4 preset: the differentiable whole-sequence forwards
(dsv4_engine.spec_decode.train_v4) compute what the engine computes, main model and MTP block,
and a short distillation lowers the block's loss and raises its agreement with the target."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dsv4_engine.checkpoint import init_checkpoint
from dsv4_engine.models.deepseek_v4 import DeepseekV4, allocate_states
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
from dsv4_engine.models.deepseek_v4_weights import load_v4_weights
from dsv4_engine.models.forward_batch import V4Batch
from dsv4_engine.spec_decode.mtp_v4 import V4MTPLayer, V4Target, v4_mtp_state_spec
from dsv4_engine.spec_decode.train_v4 import TrainableV4, TrainableV4MTP

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAGE = 16


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    return init_checkpoint(tmp_path_factory.mktemp("v4t") / "m", preset="v4-tiny", seed=0, mtp=True)


def _engine_streams(model: DeepseekV4, layer: V4MTPLayer, seq: list[int]):
    """The engine's streams at every position of `seq` (one prefill from position 0) and its MTP
    block's logits there (inputs: token i+1 and the streams at i)."""
    cfg, T = model.cfg, len(seq)
    specs = DeepseekV4.state_specs(cfg) + [v4_mtp_state_spec(cfg)]
    pages = -(-T // PAGE)
    states = allocate_states(specs, pages, PAGE, 1, torch.float32)
    for t in states.values():
        t.normal_()  # nothing may read state it did not write

    def batch(ids):
        n = len(ids)
        return V4Batch(
            torch.tensor(ids),
            torch.arange(n),
            torch.tensor([n]),
            torch.tensor([n - 1]),
            torch.arange(pages, dtype=torch.int32)[None],
            torch.tensor([0]),
            PAGE,
        )

    streams = V4Target(model).hidden(batch(seq), states)
    logits, _ = layer.forward(batch(seq[1:]), states, streams[:-1], rows=torch.arange(T - 1))
    return streams, logits


def test_trainable_v4_forwards_equal_the_engines(v4_mtp):
    cfg = DeepseekV4Config.from_dir(v4_mtp)
    model = DeepseekV4(cfg, load_v4_weights(v4_mtp))
    layer = V4MTPLayer(model, v4_mtp)
    # 40 tokens: past the window (8), several CSA (4) and HCA (8) windows, the indexer's top-4 bites
    seq = [(7 * i + 3) % 500 + 2 for i in range(40)]
    streams, mtp_logits = _engine_streams(model, layer, seq)
    w = load_file(str(v4_mtp / "model.safetensors"))
    with torch.no_grad():
        main = TrainableV4(cfg, w)
        ours = main.streams(torch.tensor([seq]))[0]
        ours_mtp, _ = TrainableV4MTP(cfg, w).forward_with_hidden(torch.tensor([seq[1:]]), ours[None, :-1])
    # fp32 through four layers: summation-order rounding only (streams and logits are O(1..10)).
    assert (ours - streams).abs().max() < 1e-3 * max(1.0, float(streams.abs().max()))
    lg, ref = main.logits(ours), V4Target(model).logits(streams)
    assert (lg - ref).abs().max() < 1e-3 * max(1.0, float(ref.abs().max()))
    assert torch.equal(lg.argmax(-1), ref.argmax(-1))
    assert (ours_mtp[0] - mtp_logits).abs().max() < 1e-3 * max(1.0, float(mtp_logits.abs().max()))
    assert torch.equal(ours_mtp[0].argmax(-1), mtp_logits.argmax(-1))
    # the forward is differentiable end to end: every trained tensor of a layer gets a gradient
    main.forward(torch.tensor([seq[:24]])).logsumexp(-1).sum().backward()
    assert main.w["layers.1.attn.compressor.wkv.weight"].grad.abs().sum() > 0
    assert main.w["layers.0.hc_attn_fn"].grad.abs().sum() > 0
    assert main.w["embed.weight"].grad.abs().sum() > 0


def test_v4_distillation_lowers_its_loss_and_trains_only_the_block(tmp_path):
    """A short `--train-mtp` on v4-tiny (untrained main model, a tiny budget): the distillation
    loss falls, the block's tensors change and nothing else does, and the checkpoint still loads
    in the engine's drafter. (An untrained model's continuations are close to a hash of the
    context: held-out agreement needs `--train` first; docs/speculative-decoding.md has the
    acceptance the full recipe reaches.)"""
    from dsv4_engine.spec_decode.train import train_mtp

    d = init_checkpoint(tmp_path / "m", preset="v4-tiny", seed=1, mtp=True)
    before = load_file(str(d / "model.safetensors"))
    report = train_mtp(d, steps=30, num_prompts=8, new_tokens=16, batch=7)
    assert report["loss_last20_mean"] < 0.9 * report["loss_first"], report
    after = load_file(str(d / "model.safetensors"))
    assert after.keys() == before.keys()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(k.startswith("mtp.0.") for k in changed), sorted(changed)[:5]
    assert all(after[k].dtype == before[k].dtype for k in after)
    V4MTPLayer(DeepseekV4(DeepseekV4Config.from_dir(d), load_v4_weights(d)), d)


def test_v4_chained_distillation_lowers_both_steps_loss(tmp_path):
    """`chain=True`: the block also learns the draft chain's second step, from its
    own output streams; the summed loss of both steps falls and the report has the chained
    agreement. The block still loads in the engine's drafter."""
    from dsv4_engine.spec_decode.train import train_mtp

    d = init_checkpoint(tmp_path / "m", preset="v4-tiny", seed=4, mtp=True)
    report = train_mtp(d, steps=30, num_prompts=8, new_tokens=16, batch=7, chain=True)
    assert report["loss_last20_mean"] < 0.9 * report["loss_first"], report
    assert 0.0 <= report["held_out_chained_agreement_after"] <= 1.0
    assert (report["lr"], report["hard_weight"]) == (5e-3, 1.0)  # V4's recipe (V4Kit)
    V4MTPLayer(DeepseekV4(DeepseekV4Config.from_dir(d), load_v4_weights(d)), d)


def test_v4_base_training_lowers_the_corpus_loss_and_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dsv4_engine.spec_decode.train import train_base

    d = init_checkpoint(tmp_path / "m", preset="v4-tiny", seed=2, mtp=True)
    report = train_base(d, steps=20, batch=4, seq_len=24)
    assert report["loss_last20_mean"] < report["loss_first"], report
    # what the engine and transformers compute from the trained checkpoint still agree
    cfg = DeepseekV4Config.from_dir(d)
    seq = list(range(5, 35))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([seq])).logits[0]
        ours = TrainableV4(cfg, load_file(str(d / "model.safetensors"))).forward(torch.tensor([seq]))[0]
    assert (ours - theirs).abs().max() < 1e-3 * max(1.0, float(theirs.abs().max()))


def test_num_layers_deepens_a_v4_preset_into_a_checkpoint_the_engine_and_transformers_run(tmp_path):
    """`--num-layers 6` on v4-tiny (4 layers listed): the attention types go on alternating
    CSA / HCA after the preset's layers, the hash-routed layers stay the preset's first two, and
    the checkpoint (MTP block included) loads in the engine and in transformers with the same
    logits."""
    transformers = pytest.importorskip("transformers")
    from dsv4_engine.checkpoint import PRESETS

    d = init_checkpoint(tmp_path / "m", preset="v4-tiny", seed=3, mtp=True, num_layers=6)
    cfg = DeepseekV4Config.from_dir(d)
    assert cfg.num_hidden_layers == 6
    assert cfg.layer_types == PRESETS["v4-tiny"]["layer_types"] + [
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert cfg.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"]
    hf_cfg = transformers.AutoConfig.from_pretrained(str(d))
    assert list(hf_cfg.layer_types) == cfg.layer_types and list(hf_cfg.mlp_layer_types) == cfg.mlp_layer_types
    model = DeepseekV4(cfg, load_v4_weights(d))
    seq = [(11 * i + 5) % 500 + 2 for i in range(30)]
    streams, _ = _engine_streams(model, V4MTPLayer(model, d), seq)
    ours = V4Target(model).logits(streams)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([seq])).logits[0]
    assert (ours - theirs).abs().max() < 1e-3 * max(1.0, float(theirs.abs().max()))
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_num_layers_keeps_the_release_spelling_of_a_v4_preset():
    from dsv4_engine.checkpoint import PRESETS, v4_with_depth

    c = v4_with_depth(PRESETS["v4-flash-shape"], 6)
    assert c["compress_ratios"] == [0, 4, 128, 4, 128, 4] and c["num_hash_layers"] == 1
    assert DeepseekV4Config.from_dict(c).num_hidden_layers == 6
    short = v4_with_depth(PRESETS["v4-tiny"], 2)
    assert DeepseekV4Config.from_dict(short).layer_types == PRESETS["v4-tiny"]["layer_types"][:2]


@pytest.mark.parametrize("steps", range(1, 41))
def test_the_one_cycle_schedule_takes_any_step_count(steps):
    # `--train-base-steps 10` used to end in OneCycleLR's ZeroDivisionError
    from dsv4_engine.spec_decode.train import warmup_fraction

    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=warmup_fraction(steps))
    for _ in range(steps):
        opt.step()
        sched.step()
