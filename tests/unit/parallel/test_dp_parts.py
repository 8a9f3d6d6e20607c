"""The pure parts of data-parallel attention: the per-rank page books, the batch cut into each
rank's share and the logits put back, the step's message, the weight plan, the refusals."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.config import ModelConfig
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel.dp_attention import dp_refusal, pack_shares, unpack_share
from dsv4_engine.parallel.dp_batch import merge_logits, request_ranks, split_batch
from dsv4_engine.parallel.dp_pages import DPPageAllocator
from dsv4_engine.parallel.plan import Shard, dp_v3_local_config, dp_v3_slicer


def test_a_request_takes_every_page_on_one_rank_the_least_loaded_first():
    books = DPPageAllocator(2, 4)
    a = books.allocate_beside([], 3)  # both empty: rank 0
    b = books.allocate_beside([], 1)  # rank 1 has more free pages
    assert a == [0, 1, 2] and b == [4]
    assert books.allocate_beside(a, 1) == [3]  # a grows on its own rank
    assert books.allocate_beside(a, 1) is None  # rank 0 is full, rank 1's pages are not a's
    assert books.allocate_beside(b, 3) == [5, 6, 7]
    assert books.held_per_rank() == [4, 4] and books.num_free == 0
    assert not books.same_pool(a, b) and books.same_pool([5], b)
    books.free(a + [3])
    assert books.held_per_rank() == [0, 4] and books.num_free == 4
    with pytest.raises(RuntimeError):
        books.free([0])  # freed twice: loud, as one pool's books


def batch() -> ForwardBatch:
    """Three requests: r0 on rank 1 (pages 5, 6; a 3-token chunk), r1 on rank 0 (page 1, decode),
    r2 on rank 1 (page 4, 2 tokens); 4 pages a rank, 4 tokens a page."""
    ext = [3, 1, 2]
    slots = [5 * 4 + 3, 6 * 4, 6 * 4 + 1, 1 * 4 + 2, 4 * 4, 4 * 4 + 1]
    return ForwardBatch(
        input_ids=torch.tensor([10, 11, 12, 20, 30, 31]),
        positions=torch.tensor([3, 4, 5, 2, 0, 1]),
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([[5, 6], [1, 0], [4, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3, 2], dtype=torch.int32),
        extend_lens=torch.tensor(ext, dtype=torch.int32),
        logits_indices=torch.tensor([2, 3, 5]),
        all_decode=False,
        page_size=4,
    )


def test_a_batch_splits_into_each_ranks_local_share_and_the_logits_merge_back():
    fb = batch()
    ranks = request_ranks(fb, 4)
    assert ranks == [1, 0, 1]
    r0, r1, r2 = split_batch(fb, ranks, 3, 4, 4)
    assert r2 is None  # a rank with no request this step
    assert r0.input_ids.tolist() == [20] and r0.all_decode and r0.slot_mapping.tolist() == [6]
    assert r0.block_table.tolist() == [[1, 0]] and r0.logits_indices.tolist() == [0]
    assert r1.input_ids.tolist() == [10, 11, 12, 30, 31] and not r1.all_decode
    assert r1.block_table.tolist() == [[1, 2], [0, 0]]  # local page ids of rank 1's pool
    assert r1.slot_mapping.tolist() == [1 * 4 + 3, 2 * 4, 2 * 4 + 1, 0, 1]
    assert r1.logits_indices.tolist() == [2, 4] and r1.seq_lens_host == [6, 2]
    logits = merge_logits([torch.tensor([[1.0]]), torch.tensor([[0.0], [2.0]]), None], ranks)
    assert logits.tolist() == [[0.0], [1.0], [2.0]]


def test_the_step_message_carries_every_share_and_the_counts():
    fb = batch()
    shares = split_batch(fb, request_ranks(fb, 4), 3, 4, 4)
    header, payload = pack_shares(shares)
    for rank, want in enumerate(shares):
        got, tokens, reqs = unpack_share(header, payload, rank, torch.device("cpu"))
        assert tokens == [1, 5, 0] and reqs == [1, 2, 0]
        if want is None:
            assert got is None
        else:
            assert got.input_ids.tolist() == want.input_ids.tolist()
            assert got.block_table.tolist() == want.block_table.tolist()
            assert got.logits_indices.tolist() == want.logits_indices.tolist()


def test_dp_ranks_keep_attention_and_dense_mlps_whole_and_split_the_moe():
    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=4,
        num_hidden_layers=2,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        num_experts_per_tok=2,
        num_attention_heads=3,
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=8,
        intermediate_size=12,
    )
    s = dp_v3_slicer(cfg, Shard(1, 2))
    assert s("model.layers.0.self_attn.q_b_proj.weight", (3 * 8, 4)) == ("model.layers.0.self_attn.q_b_proj.weight", ())
    assert s("model.layers.0.mlp.down_proj.weight", (4, 12)) == ("model.layers.0.mlp.down_proj.weight", ())
    assert s("model.layers.1.mlp.experts.1.up_proj.weight", (8, 4)) is None
    assert s("model.layers.1.mlp.experts.3.up_proj.weight", (8, 4))[0] == "model.layers.1.mlp.experts.1.up_proj.weight"
    name, idx = s("model.layers.1.mlp.shared_experts.down_proj.weight", (4, 8))
    assert idx == (slice(None), slice(4, 8))  # shared experts: split as under TP
    local = dp_v3_local_config(cfg, Shard(1, 2))
    assert (local.num_attention_heads, local.intermediate_size, local.n_routed_experts) == (3, 12, 2)


def args(**kw) -> EngineArgs:
    base = dict(model="m", tp_size=2, dp_size=2, cuda_graph_max_bs=0)
    return EngineArgs(**{**base, **kw})


@pytest.mark.parametrize(
    "kw,model_type,flag",
    [
        ({"tp_size": 4}, "deepseek_v3", "--tp-size 2"),
        ({}, "llama", "model_type 'llama'"),
        ({"host_cache_gb": 1.0}, "deepseek_v3", "--host-cache-gb"),
        ({"disk_cache_dir": "/tmp/kv"}, "deepseek_v3", "--disk-cache-dir"),
    ],
)
def test_what_dp_attention_does_not_do_yet_is_refused_by_name(kw, model_type, flag):
    line = dp_refusal(args(**kw), model_type)
    assert line is not None and flag in line and "--dp-size" in line
    assert dp_refusal(args(), "deepseek_v3") is None and dp_refusal(args(), "deepseek_v4") is None


def test_dp_speculation_runs_v3s_and_v4s_mtp():
    assert dp_refusal(args(speculative_algorithm="mtp"), "deepseek_v3") is None
    assert dp_refusal(args(speculative_algorithm="mtp"), "deepseek_v4") is None  # parallel/dp_spec.py's V4 path


def test_dp_size_without_tp_size_is_refused_before_any_rank_starts(make_model):
    with pytest.raises(ValueError, match="--dp-size 2 needs --tp-size 2"):
        Engine(EngineArgs(model=str(make_model("tiny")), device="cpu", dp_size=2))
