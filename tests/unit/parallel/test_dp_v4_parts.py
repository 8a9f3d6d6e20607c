"""The pure parts of DeepSeek-V4 under data-parallel attention: the weight plan (everything whole
but the routed experts), the shares' slot rows, and every rank's token ids read from the step's
message (V4's hash-routed layers pick experts by them)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from dsv4_engine.checkpoint import PRESETS
from dsv4_engine.models.deepseek_v4 import DeepseekV4
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel.dp_attention import pack_shares, step_token_ids, unpack_share
from dsv4_engine.parallel.dp_batch import request_ranks, split_batch
from dsv4_engine.parallel.plan import Shard, dp_plan_for, dp_v4_local_config, dp_v4_slicer
from dsv4_engine.parallel.sharded import DPComm, ShardComm, rank_slicer
from dsv4_kernels.api import get_ops


def tensor_names(model_dir: Path) -> list[str]:
    names = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names += list(st.keys())
    return names


def test_v4_dp_ranks_keep_attention_and_its_states_whole_and_split_the_routed_experts(make_model):
    cfg = DeepseekV4Config.from_dict(PRESETS["v4-tiny"])  # 4 routed experts, 2 hash-routed layers
    assert dp_plan_for("deepseek_v4").slicer is dp_v4_slicer
    s = dp_v4_slicer(cfg, Shard(1, 2))
    split = {}
    for name in tensor_names(make_model("v4-tiny")):
        got = s(name, ())
        if got != (name, ()):
            split[name] = got
    assert split, "the routed experts are split"
    for name, got in split.items():
        assert ".experts." in name and "shared" not in name, name  # attention, indexer, compressor, mHC whole
        e = int(name.split(".experts.")[1].split(".")[0])
        if e < 2:
            assert got is None  # rank 0's block
        else:
            assert got[0] == name.replace(f".experts.{e}.", f".experts.{e - 2}.")  # local ids
    local = dp_v4_local_config(cfg, Shard(1, 2))
    assert (local.num_attention_heads, local.o_groups, local.attention_tp_size) == (4, 2, 1)
    assert local.n_routed_experts == 2


def test_shares_carry_their_slot_rows_and_every_rank_reads_all_token_ids():
    """r0 on rank 1 (3 tokens, slot row 5), r1 on rank 0 (decode, row 0), r2 on rank 1 (row 2)."""
    fb = ForwardBatch(
        input_ids=torch.tensor([10, 11, 12, 20, 30, 31]),
        positions=torch.tensor([3, 4, 5, 2, 0, 1]),
        slot_mapping=torch.tensor([23, 24, 25, 6, 16, 17]),
        block_table=torch.tensor([[5, 6], [1, 0], [4, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3, 2], dtype=torch.int32),
        extend_lens=torch.tensor([3, 1, 2], dtype=torch.int32),
        logits_indices=torch.tensor([2, 3, 5]),
        all_decode=False,
        slot_ids=torch.tensor([5, 0, 2]),
        page_size=4,
    )
    shares = split_batch(fb, request_ranks(fb, 4), 3, 4, 4)
    header, payload = pack_shares(shares)
    cpu = torch.device("cpu")
    r0, tokens, _ = unpack_share(header, payload, 0, cpu)
    r1, _, _ = unpack_share(header, payload, 1, cpu)
    assert r0.slot_ids.tolist() == [0] and r1.slot_ids.tolist() == [5, 2]  # global rows: each rank has them all
    assert r1.page_size == 4
    ids = step_token_ids(header, payload, cpu)
    assert tokens == [1, 5, 0] and ids.tolist() == [20, 10, 11, 12, 30, 31]  # rank order, as the MoE gathers


def test_weights_read_besides_the_model_follow_the_dp_plan(make_model):
    """The MTP block's weights are cut by `rank_slicer`: under --dp-size its attention stays whole,
    as the target's does (TP's plan would split v4-tiny's query heads over 2 ranks)."""
    model_dir = make_model("v4-tiny")
    wq_b = next(n for n in tensor_names(model_dir) if n.endswith("attn.wq_b.weight"))
    rank = SimpleNamespace(shard=Shard(1, 2))
    dp = rank_slicer(SimpleNamespace(tp=DPComm(rank, (2, 4), 4)), model_dir)
    tp = rank_slicer(SimpleNamespace(tp=ShardComm(rank, (2, 4), 4)), model_dir)
    assert dp(wq_b, ()) == (wq_b, ()) and tp(wq_b, ()) != (wq_b, ())


def test_the_routed_sum_and_the_shared_expert_add_up_to_v4s_moe(make_model):
    """Under --dp-size each rank adds the shared expert to its own rows after the gathered routed
    sum: the two parts are the whole MoE, hash-routed layer and learned-routing layer alike."""
    model_dir = make_model("v4-tiny")
    cfg = DeepseekV4Config.from_dir(model_dir)
    model = DeepseekV4(cfg, DeepseekV4.load_weights(model_dir), get_ops("cpu"))
    torch.manual_seed(0)
    x, ids = torch.randn(6, cfg.hidden_size), torch.randint(3, cfg.vocab_size, (6,))
    for layer in (model.layers[0], model.layers[-1]):
        moe = layer.ffn
        parts = moe(x, ids, with_shared=False) + moe.shared_expert(x)
        assert torch.allclose(parts, moe(x, ids), atol=1e-5, rtol=1e-4)
        assert not torch.allclose(moe(x, ids, with_shared=False), moe(x, ids), atol=1e-3)
