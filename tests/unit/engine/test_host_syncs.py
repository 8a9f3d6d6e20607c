"""No host syncs inside the model's forward on the GPU path (the Triton backend, here under the
CPU interpreter): prefill, decode and a mixed batch each run with zero reads of device values
by the host and zero ops whose shape depends on values. The probe itself is shown to catch one.
"""

from __future__ import annotations

import pytest
import torch
from host_sync_probe import count_blocking_uploads, count_host_syncs

from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import ScheduledSeq
from dsv4_engine.sequence import Sequence


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(tiny_model, "float32", str(DEVICE), "triton")


def _seq(rid: str, prompt: list[int], computed: int, pages: list[int], out: list[int] = ()) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(max_tokens=8, temperature=0))
    s.output_ids = list(out)
    s.num_computed = computed
    s.pages = pages
    return s


def _forward_syncs(runner, pool, batch) -> list[str]:
    fb = runner.build_batch(batch, pool.page_size)  # building may read the host's own lists
    with count_host_syncs() as hits, count_blocking_uploads() as uploads:
        runner.model.forward(fb, pool.all_states)
    return hits + uploads


def test_probe_sees_a_blocking_upload_and_not_a_staged_one():
    from dsv4_engine.devices import upload

    with count_blocking_uploads() as hits:
        torch.tensor([1, 2], device="cpu")
        torch.as_tensor([3], device="cpu")
        upload([1, 2], torch.long, torch.device("cpu"))
    assert len(hits) == 2, hits


def test_probe_sees_a_host_read():
    with count_host_syncs() as hits:
        torch.ones(3).sum().item()
        torch.arange(4)[torch.arange(4) > 1]
    assert len(hits) >= 2


def test_forward_has_no_host_syncs_in_prefill_decode_and_mixed(runner):
    pool = KVPool(runner.state_specs, 12, 8, torch.float32, DEVICE)
    a = _seq("a", list(range(3, 14)), 0, [0, 1])
    b = _seq("b", [9, 3, 250], 0, [2])
    assert _forward_syncs(runner, pool, [ScheduledSeq(a, 11), ScheduledSeq(b, 3)]) == []  # prefill
    a.num_computed, b.num_computed = 11, 3
    a.output_ids, b.output_ids = [7], [8]
    assert _forward_syncs(runner, pool, [ScheduledSeq(a, 1), ScheduledSeq(b, 1)]) == []  # decode
    a.num_computed, b.num_computed = 12, 4
    a.output_ids, b.output_ids = [7, 5], [8, 6]
    c = _seq("c", [11, 12, 13, 14, 15], 0, [3])
    hits = _forward_syncs(runner, pool, [ScheduledSeq(a, 1), ScheduledSeq(c, 5), ScheduledSeq(b, 1)])  # mixed
    assert hits == [], "\n".join(hits)


def test_v4_forward_has_no_host_syncs_on_the_kernel_path(make_model):
    """DeepSeek-V4 on the Triton backend: which compression windows close in a step, how many
    entries a request can see and which rows its ring keeps all come from the batch's host
    lengths, never from device values. v4-tiny: window 8, CSA every 4 tokens, HCA every 8."""
    v4 = ModelRunner(make_model("v4-tiny"), "float32", str(DEVICE), "triton")
    pool = KVPool(v4.state_specs, 16, 8, torch.float32, DEVICE, max_num_seqs=4)

    def seq(rid, prompt, pages, slot):
        s = _seq(rid, prompt, 0, pages)
        s.slot = slot
        return s

    a = seq("a", [(7 * k) % 500 + 3 for k in range(21)], [0, 1, 2, 3], 0)  # closes CSA and HCA windows
    b = seq("b", [9, 3, 250], [4], 1)  # closes none
    assert _forward_syncs(v4, pool, [ScheduledSeq(a, 21), ScheduledSeq(b, 3)]) == []  # prefill
    for step, out in enumerate(([7], [7, 5], [7, 5, 2])):  # a's 22nd..24th tokens: 24 closes both kinds
        a.num_computed, b.num_computed = 21 + step, 3 + step
        a.output_ids, b.output_ids = list(out), [8] * len(out)
        assert _forward_syncs(v4, pool, [ScheduledSeq(a, 1), ScheduledSeq(b, 1)]) == []  # decode
    a.num_computed, b.num_computed = 24, 6
    a.output_ids, b.output_ids = [7, 5, 2, 4], [8] * 4
    c = seq("c", list(range(40, 53)), [5, 6], 2)  # a chunk that crosses windows
    hits = _forward_syncs(v4, pool, [ScheduledSeq(a, 1), ScheduledSeq(c, 13), ScheduledSeq(b, 1)])  # mixed
    assert hits == [], "\n".join(hits)


def test_torch_backend_decode_attention_has_no_host_syncs():
    from dsv4_kernels import reference

    kv = torch.randn(6, 4, 80)
    table = torch.tensor([[0, 3, 5], [1, 2, -1]], dtype=torch.int32)
    with count_host_syncs() as hits:
        reference.mla_decode(torch.randn(2, 3, 80), kv, table, torch.tensor([10, 6], dtype=torch.int32), 0.1, 64)
    assert hits == [], "\n".join(hits)


def test_vectorised_batch_equals_the_per_request_reading():
    """host_batch over all requests at once gives what a per-token loop over each request gives,
    chunked prefills that cross into generated tokens included."""
    import random

    from dsv4_engine.model_runner import _new_tokens

    rng = random.Random(0)
    page_size = 4
    seqs, news = [], []
    next_page = 0
    for i in range(7):
        prompt = [rng.randrange(2, 99) for _ in range(rng.randint(1, 20))]
        s = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=8))
        s.output_ids = [rng.randrange(2, 99) for _ in range(rng.randint(0, 5))]
        s.num_computed = rng.randint(0, s.num_tokens - 1)
        n = rng.randint(1, s.num_tokens - s.num_computed)
        npages = -(-(s.num_computed + n) // page_size)
        s.pages = list(range(next_page + npages - 1, next_page - 1, -1))  # not in order
        next_page += npages
        s.slot = i
        seqs.append(s)
        news.append(n)
    from dsv4_engine.batch_buffers import host_batch

    hb = host_batch(
        [s.num_computed for s in seqs],
        news,
        [s.pages for s in seqs],
        [_new_tokens(s, s.num_computed, n) for s, n in zip(seqs, news)],
        [s.slot for s in seqs],
        page_size,
    )
    ids, pos, slots, last = [], [], [], []
    for s, n in zip(seqs, news):
        for j in range(s.num_computed, s.num_computed + n):
            ids.append(s.token_at(j))
            pos.append(j)
            slots.append(s.pages[j // page_size] * page_size + j % page_size)
        last.append(len(ids) - 1)
    assert hb.input_ids.tolist() == ids and hb.positions.tolist() == pos and hb.slot_mapping.tolist() == slots
    assert hb.logits_indices.tolist() == last
    assert hb.seq_lens.tolist() == [s.num_computed + n for s, n in zip(seqs, news)]
    for b, s in enumerate(seqs):
        assert hb.block_table[b, : len(s.pages)].tolist() == s.pages
        assert not hb.block_table[b, len(s.pages) :].any()
    assert hb.slot_ids.tolist() == list(range(7))
