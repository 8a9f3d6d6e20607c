"""EPLB on a built DeepSeek-V4 model (v4-moe32 weights, in memory): the V4 MoE hook counts the
loads of the learned and the hash-routed layers alike, and with a copy of each layer's hottest
expert every layer's output stays as it was (dsv4_engine.parallel.eplb_apply, docs/eplb.md)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.checkpoint import PRESETS, init_v4_weights
from dsv4_engine.models.deepseek_v4 import DeepseekV4
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
from dsv4_engine.parallel.eplb_apply import attach_eplb, loads_from_table, moe_layers


@pytest.fixture(scope="module")
def built():
    config = PRESETS["v4-moe32"]
    return DeepseekV4Config.from_dict(config), init_v4_weights(config, seed=0)


def model_of(built, ops=None, device="cpu"):
    cfg, weights = built
    return DeepseekV4(cfg, dict(weights), ops, torch.float32, device)


def check_a_copy_keeps_every_layer_output(built, ops=None, device="cpu", atol=1e-5):
    cfg = built[0]
    model = model_of(built, ops, device)
    counter = attach_eplb(model, "unused")  # counters only
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, cfg.hidden_size, generator=g).to(device)
    ids = torch.randint(0, cfg.vocab_size, (32,), generator=g).to(device)
    reference = [m(x, ids) for _, m in moe_layers(model)]
    # then the same model placed (tp 1: every expert is local, placing reads no checkpoint)
    placer = attach_eplb(model, "unused", redundant=1)
    assert [i for i, _ in placer.layers] == [0, 1, 2, 3]
    table = counter.table()
    assert [table["layers"][str(i)]["routing"] for i in range(4)] == ["hash", "learned", "learned", "learned"]
    loads = loads_from_table(table)
    assert all(sum(v) == 32 * cfg.num_experts_per_tok for v in loads.values())
    placer.apply(placer.plan(loads))
    for ref, (i, P) in zip(reference, placer.layers):
        hot = max(range(32), key=lambda e: (loads[i][e], -e))
        assert P.w13.shape[0] == 33 and placer.placement.layers[i].count(hot) == 2
        torch.testing.assert_close(P(x, ids), ref, rtol=0, atol=atol)
    # the copies share their expert's tokens to within one, in a hash-routed layer too
    for row, (i, _) in enumerate(placer.layers):
        hot = max(range(32), key=lambda e: (loads[i][e], -e))
        per_slot = placer.loads.physical[row].tolist()
        copies = [per_slot[s] for s, e in enumerate(placer.placement.layers[i]) if e == hot]
        n = int(loads[i][hot])
        assert sorted(copies) == sorted([(n + 1) // 2, n // 2]), (i, n, copies)


def test_v4_moe_layers_are_counted_and_a_copy_leaves_every_layer_output_unchanged(built):
    check_a_copy_keeps_every_layer_output(built)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_kernels.sh runs it)")
def test_on_the_v4_kernel_path_a_copy_leaves_every_layer_output_unchanged(built):
    """The Triton backend's V4 route and experts kernels (v4_moe_route, v4_moe_experts) on slot ids."""
    from dsv4_kernels.api import get_ops

    check_a_copy_keeps_every_layer_output(built, get_ops("triton"), "cuda", atol=1e-4)
