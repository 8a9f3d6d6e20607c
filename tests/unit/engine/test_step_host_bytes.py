"""A graphed decode step's host work follows the batch, not the model's context: the block table
goes as wide as the batch's longest request (not the captured width, the model's whole context:
8,192 columns for V4-Flash), to the device and, at --tp-size > 1, to the other ranks; a narrower
step after a wider one still reads a zero-padded table (the stale columns are zeroed on the
device)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.cuda_graphs import DecodeGraphs, bucket_for, pad_decode
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.parallel import wire
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import ScheduledSeq
from dsv4_engine.sequence import Sequence


def _decoding(rid: str, prompt: list[int], out: list[int], pages: list[int]) -> ScheduledSeq:
    s = Sequence(rid, prompt, SamplingParams(max_tokens=64, temperature=0))
    s.output_ids = out
    s.num_computed = len(prompt) + len(out) - 1
    s.pages = pages
    return ScheduledSeq(s, 1)


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(tiny_model, "float32", "cpu", "torch")


def test_graph_steps_send_the_used_width_and_read_a_zero_padded_table(runner, monkeypatch):
    pool = KVPool(runner.state_specs, 64, 4, torch.float32, runner.device)
    torch.manual_seed(0)
    pool.states[runner.model.LATENT_KV].normal_()
    graphs = runner.decode_graphs(pool.page_size, pool.num_pages, capture=False)
    assert graphs.width == 64  # the captured width: every page one request could hold
    monkeypatch.setattr(DecodeGraphs, "captured", property(lambda self: True))  # eager replay of the same step
    runner.cuda_graph_max_bs = 8
    sent = []
    step = graphs.step
    monkeypatch.setattr(graphs, "step", lambda hb: sent.append(hb) or step(hb))
    long = [_decoding("long", list(range(3, 40)), [7], list(range(10, 20)))]  # 38 tokens: 10 pages
    runner.forward(long, pool)
    short = [_decoding("a", [5, 6, 7], [8], [0]), _decoding("b", [9, 10, 11, 12, 13], [4], [1, 2])]
    snapshot = pool.states[runner.model.LATENT_KV].clone()
    graphed = runner.forward(short, pool)
    assert [hb.block_table.shape for hb in sent] == [(1, 10), (2, 2)]  # never 64 columns
    # At --tp-size > 1 the same arrays go to the other ranks: the payload follows the batch too.
    header, payload = wire.pack_host(sent[1])
    assert payload.numel() == 3 * 2 + 2 * 2 + 3 * 2  # ids, positions, slots; the table; lens, logit rows
    # The static table reads as the zero-padded one (the long step's columns 2..9 zeroed).
    bs = bucket_for(2, graphs.buckets)
    table = graphs.inputs.dev["block_table"]
    assert table[:bs, 2:].eq(0).all() and table[0, :1].tolist() == [0] and table[1, :2].tolist() == [1, 2]
    pool.states[runner.model.LATENT_KV].copy_(snapshot)
    plain = runner.model.forward(runner.build_batch(short, pool.page_size), pool.all_states)
    torch.testing.assert_close(graphed, plain, atol=1e-5, rtol=1e-5)
    full = pad_decode(runner.host_batch(short, pool.page_size, graphs.width), bs)
    assert torch.equal(table[:bs], torch.from_numpy(full.block_table))


def test_v4_mixed_steps_run_their_decode_rows_through_the_graphs(make_model, monkeypatch):
    """A mixed step of V4 (decode rows run apart from the prefill rows) replays the decode graphs
    for its decode rows when they fit, with the logits and state writes of the eager step."""
    v4 = ModelRunner(make_model("v4-tiny"), "float32", "cpu", "torch")
    pool = KVPool(v4.state_specs, 16, 8, torch.float32, v4.device, max_num_seqs=4)
    torch.manual_seed(0)
    for t in pool.all_states.values():
        t.normal_()

    def seq(rid, prompt, out, pages, slot):
        b = _decoding(rid, prompt, out, pages)
        b.seq.slot = slot
        return b

    a = seq("a", [(7 * k) % 500 + 3 for k in range(21)], [7, 5], [0, 1, 2], 0)
    b = seq("b", [9, 3, 250], [8, 8], [3], 1)
    c = _decoding("c", list(range(40, 53)), [], [4, 5])
    c.seq.num_computed, c.seq.slot = 0, 2
    c = ScheduledSeq(c.seq, 13)  # a 13-token prefill chunk in the same step
    batch = [a, c, b]
    snapshot = {k: t.clone() for k, t in pool.all_states.items()}
    plain = v4.forward(batch, pool)  # no graphs: two eager forwards
    after_plain = {k: t.clone() for k, t in pool.all_states.items()}
    for k, t in pool.all_states.items():
        t.copy_(snapshot[k])
    graphs = v4.decode_graphs(pool.page_size, pool.num_pages, capture=False)
    monkeypatch.setattr(DecodeGraphs, "captured", property(lambda self: True))  # eager replay of the same step
    v4.cuda_graph_max_bs = 8
    replayed = []
    step = graphs.step
    monkeypatch.setattr(graphs, "step", lambda hb: replayed.append(hb.seq_lens.tolist()) or step(hb))
    mixed = v4.forward(batch, pool)
    assert replayed == [[23, 5]]  # the two decode rows (their context lengths), through the graph
    torch.testing.assert_close(mixed, plain, atol=1e-4, rtol=1e-4)
    for k, t in pool.all_states.items():
        torch.testing.assert_close(t, after_plain[k], atol=1e-4, rtol=1e-4, msg=k)
