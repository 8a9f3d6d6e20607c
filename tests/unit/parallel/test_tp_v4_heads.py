"""DeepSeek-V4's attention split over TP ranks by query heads and output groups (issue 49): each
rank computes its heads and groups, the output projection's partial sums meet in one all-reduce,
and the two ranks' logits are the single model's. The ranks run in two threads of this process
over an in-process all-reduce, so every step's logits can be compared, not only greedy tokens
(tests/unit/parallel/test_tp_engine.py runs the same over gloo, two processes, greedy tokens)."""

from __future__ import annotations

import threading

import pytest
import torch

from dsv4_engine.checkpoint import PRESETS, init_checkpoint
from dsv4_engine.models.deepseek_v4 import DeepseekV4, allocate_states
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
from dsv4_engine.models.deepseek_v4_weights import load_v4_weights
from dsv4_engine.models.forward_batch import V4Batch
from dsv4_engine.parallel.plan import Shard, v4_splits_attention
from dsv4_engine.parallel.sharded import build_sharded
from dsv4_kernels.api import get_ops

PAGE = 4


class ThreadPair:
    """Two ranks in two threads: all_reduce sums both ranks' tensors in rank order (the same
    bytes on both), and counts the calls."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=60)
        self.parts: list = [None, None]
        self.calls = [0, 0]

    def rank(self, r: int):
        pair = self

        class Rank:
            shard = Shard(r, 2)

            def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
                pair.parts[r] = x
                pair.calls[r] += 1
                pair.barrier.wait()
                out = pair.parts[0] + pair.parts[1]
                pair.barrier.wait()
                return out

        return Rank()


def test_the_plan_splits_attention_where_the_groups_divide_and_the_blocks_allow():
    tiny = DeepseekV4Config.from_dict(PRESETS["v4-tiny"])  # 4 heads, 2 groups
    assert v4_splits_attention(tiny, 2)
    assert not v4_splits_attention(tiny, 1) and not v4_splits_attention(tiny, 4)  # a group's heads stay together
    flash = DeepseekV4Config.from_dict(
        {**PRESETS["v4-flash-shape"], "quantization_config": {"weight_block_size": [128, 128]}}
    )
    assert v4_splits_attention(flash, 8)  # 8 heads of 512 and one group of 1024 a rank
    off_blocks = DeepseekV4Config.from_dict(
        {**PRESETS["v4-tiny"], "quantization_config": {"weight_block_size": [128, 128]}}
    )
    assert not v4_splits_attention(off_blocks, 2)  # one group of 32 rows a rank: off the fp8 blocks


def _steps(model: DeepseekV4, plans: list[dict[int, tuple[list[int], int]]]) -> list[torch.Tensor]:
    """Run steps (request -> (its tokens this step, first position)) over fresh states."""
    states = allocate_states(DeepseekV4.state_specs(model.cfg), 32, PAGE, 2, torch.float32)
    out = []
    for plan in plans:
        ids, pos, lens, last, table, slots = [], [], [], [], [], []
        for rid, (toks, start) in plan.items():
            ids += toks
            pos += range(start, start + len(toks))
            lens.append(len(toks))
            last.append(len(ids) - 1)
            table.append([rid * 16 + p for p in range(16)])
            slots.append(rid)
        fb = V4Batch(
            torch.tensor(ids),
            torch.tensor(pos),
            torch.tensor(lens),
            torch.tensor(last),
            torch.tensor(table, dtype=torch.int32),
            torch.tensor(slots),
            PAGE,
        )
        out.append(model.forward(fb, states))
    return out


@pytest.mark.usefixtures("one_torch_thread")
def test_two_ranks_of_half_the_heads_give_the_single_models_logits(tmp_path):
    d = init_checkpoint(tmp_path / "v4", preset="v4-tiny", seed=3)
    cfg = DeepseekV4Config.from_dir(d)
    full = DeepseekV4(cfg, load_v4_weights(d))
    pair = ThreadPair()
    ranks = [
        build_sharded(DeepseekV4, "deepseek_v4", cfg, d, get_ops("cpu"), torch.float32, "cpu", pair.rank(r))
        for r in range(2)
    ]
    for r in ranks:  # half the query heads and output groups; the one KV head whole
        assert r.cfg.num_attention_heads == 2 and r.layers[1].attn.sink.shape == (2,)
        assert r.layers[1].attn.wo_b.shape[1] * 2 == full.layers[1].attn.wo_b.shape[1]
        assert torch.equal(r.layers[1].attn.wkv, full.layers[1].attn.wkv)
    assert torch.equal(torch.cat([r.layers[2].attn.wq_b for r in ranks]), full.layers[2].attn.wq_b)
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randint(3, cfg.vocab_size, (19,), generator=g).tolist(),
        torch.randint(3, cfg.vocab_size, (9,), generator=g).tolist(),
    )
    # a prompt in chunks that split windows, a second one joining, then decode steps together
    plans = [{0: (a[:7], 0)}, {0: (a[7:19], 7), 1: (b, 0)}, {0: ([5], 19), 1: ([6], 9)}, {0: ([7], 20), 1: ([8], 10)}]
    want = _steps(full, plans)
    got: list = [None, None]
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, _steps(ranks[r], plans))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got[0] is not None and got[1] is not None, "a rank failed (see the thread's traceback)"
    for w, g0, g1 in zip(want, *got):
        assert torch.equal(g0, g1)
        torch.testing.assert_close(g0, w, rtol=1e-4, atol=1e-4)
        assert torch.equal(g0.argmax(-1), w.argmax(-1))
    # two all-reduces a layer a step: after attention's output projection, after the MoE
    assert pair.calls == [2 * cfg.num_hidden_layers * len(plans)] * 2
