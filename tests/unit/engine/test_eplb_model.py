"""EPLB on a built DeepSeek-V3 model (moe32 weights, in memory): the MoE hook maps logical
experts to physical copies without changing the layer's output, counts the loads, and the
counters reach Prometheus (dsv4_engine.parallel.eplb_apply, dsv4_engine.expert_loads)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.checkpoint import PRESETS, init_weights
from dsv4_engine.config import ModelConfig
from dsv4_engine.metrics import EngineMetrics
from dsv4_engine.models.deepseek_v3 import DeepseekV3
from dsv4_engine.parallel import eplb
from dsv4_engine.parallel.eplb_apply import attach_eplb, loads_from_table, placement_message, unpack_placement
from dsv4_kernels.api import get_ops


@pytest.fixture(scope="module")
def built():
    config = PRESETS["moe32"]
    weights = init_weights(config, seed=0)
    cfg = ModelConfig.from_dict(config)
    return cfg, weights


def model_of(built):
    cfg, weights = built
    return DeepseekV3(cfg, dict(weights), get_ops("cpu"), torch.float32, torch.device("cpu"))


def test_replicas_leave_every_moe_layer_output_unchanged_and_spread_tokens_over_copies(built):
    plain, placed = model_of(built), model_of(built)
    # at tp 1 every expert is local: placing reads no checkpoint ("unused")
    counter = attach_eplb(plain, "unused")  # counters only: identity routes
    placer = attach_eplb(placed, "unused", redundant=1)
    x = torch.randn(32, built[0].hidden_size, generator=torch.Generator().manual_seed(0))
    moe_plain = [L for L in plain.layers if "gate" in L]
    reference = [plain._moe(L, x) for L in moe_plain]
    # a rebalance from those loads: each layer's busiest expert gets the copy
    loads = {
        i: [float(n) for n in row["experts"]] for i, row in ((int(k), v) for k, v in counter.table()["layers"].items())
    }
    placer.apply(placer.plan(loads))
    for ref, (i, P) in zip(reference, placer.layers):
        hot = max(range(32), key=lambda e: (loads[i][e], -e))
        assert P["w13"].shape[0] == 33  # 32 experts + the hot one's copy
        assert placer.placement.layers[i].count(hot) == 2
        torch.testing.assert_close(placed._moe(P, x), ref, rtol=0, atol=1e-6)
    first = placer.layers[0][0]
    table = placer.table()
    row = table["layers"][str(first)]
    assert sum(row["experts"]) == 32 * built[0].num_experts_per_tok
    hot = max(range(32), key=lambda e: (loads[first][e], -e))
    n = row["experts"][hot]
    assert n > 1
    slots = placer.loads.physical[0].tolist()
    copies = [s for s, e in enumerate(placer.placement.layers[first]) if e == hot]
    # a replicated expert's tokens split over its copies to within one
    assert sorted(slots[s] for s in copies) == sorted([(n + 1) // 2, n // 2]), (n, [slots[s] for s in copies])
    assert loads_from_table(table)[first] == [float(n) for n in row["experts"]]


def test_loads_of_another_model_are_refused(built):
    placer = attach_eplb(model_of(built), "unused", redundant=1)
    layers = [i for i, _ in placer.layers]
    with pytest.raises(ValueError, match="16 experts"):
        placer.plan({i: [1.0] * 16 for i in layers})
    with pytest.raises(ValueError, match="no MoE layer"):
        placer.plan({layers[0]: [1.0] * 32})


def test_counters_reach_prometheus_as_deltas(built):
    model = model_of(built)
    placer = attach_eplb(model, "unused")
    metrics = EngineMetrics("mono", "m")
    metrics.before_render.append(placer.loads.publish)
    L = placer.layers[0][1]
    x = torch.randn(8, built[0].hidden_size, generator=torch.Generator().manual_seed(1))
    model._moe(L, x)
    first = metrics.render().decode()
    model._moe(L, x)
    text = metrics.render().decode()
    layer = placer.layers[0][0]
    routed = [ln for ln in text.splitlines() if ln.startswith(f'dsv4:moe_layer_routed_tokens_total{{layer="{layer}"')]
    assert routed and float(routed[0].split()[-1]) == 2 * 8 * built[0].num_experts_per_tok
    assert f'dsv4:moe_expert_tokens_total{{expert="0",layer="{layer}"' in text
    assert "dsv4:moe_rank_load_imbalance" in first


def test_a_placement_crosses_the_step_channel_whole():
    p = eplb.plan({1: [float(e) for e in range(8)], 3: [1.0] * 8}, 2, 2)
    header, payload = placement_message(p)
    assert unpack_placement(payload) == p


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_kernels.sh runs it)")
def test_the_route_replays_from_a_cuda_graph_as_it_runs_eagerly():
    """No host read in the hook: a decode graph captures it, and a replay over new ids maps and
    counts them as the eager call does."""
    from dsv4_engine.expert_loads import ExpertLoads
    from dsv4_engine.parallel.eplb_apply import LayerRoute

    dev = torch.device("cuda")
    slots = eplb.place_layer([50.0, 1.0, 1.0, 30.0, 1.0, 1.0, 1.0, 1.0], 2, 2)

    def route_on(device):
        loads = ExpertLoads([1], 8, 10, [0] * 5 + [1] * 5, device)
        r = LayerRoute(loads, 0, 8, 2, device)
        r.set_slots(slots)
        return r, loads

    eager, eager_loads = route_on(dev)
    graphed, graphed_loads = route_on(dev)
    ids = torch.zeros(16, 2, dtype=torch.int32, device=dev)
    out = graphed(ids)  # warm-up outside the capture
    for t in (graphed_loads.plain, graphed_loads.placed_logical, graphed_loads.placed_physical):
        t.zero_()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            out = graphed(ids)
    torch.cuda.current_stream().wait_stream(stream)
    new = torch.randint(0, 8, (16, 2), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    new[:, 0] = 0  # the hot expert in every token
    ids.copy_(new.to(dev))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager(new.to(dev)))
    assert torch.equal(graphed_loads.physical, eager_loads.physical)


def test_the_route_reads_nothing_back_to_the_host():
    """No host read and no value-shaped op in the hook, with and without copies (the host-sync
    probe that guards the whole forward, tests/unit/engine/test_host_syncs.py)."""
    from host_sync_probe import count_host_syncs

    from dsv4_engine.expert_loads import ExpertLoads
    from dsv4_engine.parallel.eplb_apply import LayerRoute

    loads = ExpertLoads([1], 8, 10, [0] * 5 + [1] * 5, "cpu")
    route = LayerRoute(loads, 0, 8, 2, "cpu")
    ids = torch.randint(0, 8, (16, 2), dtype=torch.int32)
    with count_host_syncs() as hits:
        route(ids)  # plain: slot = expert
    route.set_slots(eplb.place_layer([50.0, 1.0, 1.0, 30.0, 1.0, 1.0, 1.0, 1.0], 2, 2))
    with count_host_syncs() as more:
        route(ids)
    assert hits == [] and more == [], hits + more
