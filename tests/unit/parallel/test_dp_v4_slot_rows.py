"""DeepSeek-V4's per-request slot rows (window ring, compressor stages) under `--dp-size N`: each
rank's pool holds ceil(--max-num-seqs / N) rows, not --max-num-seqs; rank r's rows are the
engine's ids r * per_rank.. (`dp_pages.DPSlotAllocator`), a request's row is on the rank of its
pages, and placement skips a rank whose rows are all held."""

from __future__ import annotations

import pytest
from test_dp_engine import bounded, drive, prompts  # noqa: F401

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.parallel.dp_pages import DPPageAllocator, DPSlotAllocator, choose_rank, slot_rows_per_rank


def test_slot_ids_number_each_ranks_rows_and_placement_skips_a_rank_with_none_free():
    assert [slot_rows_per_rank(8, 2), slot_rows_per_rank(5, 2), slot_rows_per_rank(3, 4)] == [4, 3, 1]
    books = DPPageAllocator(2, 10)
    books.slots = DPSlotAllocator(2, 2, 10)
    on_1 = books.allocate(3, rank=1)
    assert books.slots.allocate_beside(on_1) in (2, 3), "a row on the rank of the request's pages"
    assert [books.slots.allocate_on(0), books.slots.allocate_on(0), books.slots.allocate_on(0)] == [0, 1, None]
    assert books.rows_free() == [0, 1]
    # rank 0 has more free pages (and holds a prefix) but no free row: rank 1 gets the request
    assert books.least_loaded() == 1
    assert choose_rank([4, 0], [10, 7], need=5, running=[2, 1], rows=[0, 1]) == 1
    assert choose_rank([4, 0], [10, 7], need=5, running=[2, 1], rows=None) == 0  # no slot rows: as before
    books.slots.free(0)
    assert books.rows_free() == [1, 1]
    with pytest.raises(RuntimeError):
        books.slots.free(0)  # twice


def engine(model_dir, tp: int, dp: int = 1) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=24,
            page_size=8,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            tp_size=tp,
            dp_size=dp,
            enable_prefix_cache=False,
        )
    )


def slot_bytes(e: Engine) -> int:
    return sum(t.numel() * t.element_size() for t in e.pool.slot_states.values())


@pytest.mark.slow
def test_v4_dp2_pool_holds_half_the_slot_rows_and_each_request_its_row_on_its_rank(make_model):
    model = make_model("v4-tiny")
    ref = engine(model, 1)
    ref_bytes = slot_bytes(ref)
    ref_out = drive(
        ref, {0: [(f"r{i}", p) for i, p in enumerate(prompts(ref.cfg.vocab_size, [9, 14, 11, 20], seed=3))]}
    )
    e = engine(model, 2, 2)
    placed: list[tuple[int, int]] = []

    def watch(step):
        for seq in e.scheduler.running:
            placed.append((e.pool.allocator.rank_of(seq.pages[0]), seq.slot // e.pool.num_slots))

    try:
        # rank 0's own pool (rank 1 builds its pool from the same announced sizes)
        assert e.pool.num_slots == 4 and ref.pool.num_slots == 8
        assert slot_bytes(e) * 2 == ref_bytes, (slot_bytes(e), ref_bytes)
        loads = e.loads()
        assert loads["kv_slots_total"] == 8  # every rank's rows
        assert [(r["kv_slots_free"], r["kv_slots_total"]) for r in loads["dp_ranks"]] == [(4, 4), (4, 4)]
        arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts(e.cfg.vocab_size, [9, 14, 11, 20], seed=3))]}
        got = bounded(lambda: drive(e, arrivals, watch=watch))
    finally:
        e.tp.close()
    assert got["tokens"] == ref_out["tokens"]
    assert {page_rank for page_rank, _ in placed} == {0, 1}, "both ranks ran requests"
    assert all(page_rank == slot_rank for page_rank, slot_rank in placed), placed
    assert e.pool.slots.num_free == 8, "every row back after the run"
    print(f"v4-tiny slot-state bytes per rank: dp 2 {slot_bytes(e)}, tp (every row) {ref_bytes}")
