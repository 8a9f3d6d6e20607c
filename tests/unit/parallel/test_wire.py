"""The per-step batch channel: a fixed header and one int64 payload round-trip a ForwardBatch."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel import wire


def batch(slots: bool) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.tensor([5, 6, 7, 9], dtype=torch.int64),
        positions=torch.tensor([0, 1, 2, 7]),
        slot_mapping=torch.tensor([16, 17, 18, 39]),
        block_table=torch.tensor([[2, 0], [3, 4]], dtype=torch.int32),
        seq_lens=torch.tensor([3, 8], dtype=torch.int32),
        extend_lens=torch.tensor([3, 1], dtype=torch.int32),
        logits_indices=torch.tensor([2, 3]),
        all_decode=False,
        slot_ids=torch.tensor([1, 0]) if slots else None,
        page_size=8 if slots else None,
    )


@pytest.mark.parametrize("slots", [False, True])
def test_a_batch_round_trips(slots):
    fb = batch(slots)
    header, payload = wire.pack(fb)
    assert header.shape == (wire.HEADER_LEN,) and header.dtype == payload.dtype == torch.int64
    assert wire.payload_len(header) == payload.numel()
    back = wire.unpack(header, payload, torch.device("cpu"))
    for f in ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "extend_lens", "logits_indices"):
        a, b = getattr(fb, f), getattr(back, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
    assert back.all_decode == fb.all_decode and back.page_size == fb.page_size
    assert back.seq_lens_host == [3, 8] and back.extend_lens_host == [3, 1]  # host copies: no device read
    assert (back.slot_ids is None) == (fb.slot_ids is None)
    if slots:
        assert torch.equal(back.slot_ids, fb.slot_ids)


def test_a_payload_that_does_not_match_its_header_is_refused():
    header, payload = wire.pack(batch(False))
    with pytest.raises(ValueError, match="does not match"):
        wire.unpack(header, payload[:-1], torch.device("cpu"))


def test_the_stop_header_is_an_operation_of_its_own():
    assert int(wire.stop_header()[wire.OP]) == wire.OP_STOP != wire.OP_FORWARD


def test_an_operation_without_payload_is_a_header_alone():
    header = wire.op_header(wire.OP_PD_POOLS)
    assert int(header[wire.OP]) == wire.OP_PD_POOLS and wire.payload_len(header) == 0


def test_a_snapshot_copy_message_names_its_direction_snapshot_and_row():
    for kind in ("save", "restore"):
        header, payload = wire.snapshot_message(kind, 7, 2)
        assert int(header[wire.OP]) == wire.OP_SNAPSHOT and wire.payload_len(header) == payload.numel()
        assert wire.unpack_snapshot(payload) == (kind, 7, 2)
    with pytest.raises(ValueError):
        wire.snapshot_message("swap", 0, 0)


def test_a_snapshot_copy_moves_every_slot_state_one_way():
    from dsv4_engine.kv_cache import copy_snapshot

    rows = {"ring": torch.arange(12.0).view(3, 4), "stage": torch.arange(6.0).view(3, 2)}
    snaps = {"ring": torch.zeros(2, 4), "stage": torch.zeros(2, 2)}
    copy_snapshot(snaps, rows, "save", 1, 2)
    assert torch.equal(snaps["ring"][1], rows["ring"][2]) and torch.equal(snaps["stage"][1], rows["stage"][2])
    assert not snaps["ring"][0].any()
    copy_snapshot(snaps, rows, "restore", 1, 0)
    assert torch.equal(rows["ring"][0], rows["ring"][2]) and torch.equal(rows["stage"][0], rows["stage"][2])


@pytest.mark.parametrize("slots", [False, True])
def test_a_captured_decode_step_round_trips_from_host_arrays(slots):
    """The header of a replayed step is built from the step's numpy arrays: nothing is read
    back from the device (the eager `pack` copies the batch off it, one sync per step)."""
    import numpy as np

    from dsv4_engine.batch_buffers import host_batch

    hb = host_batch([3, 7], [1, 1], [[2], [3, 4]], [[9], [11]], [1, 0] if slots else [None, None], 4, width=5)
    header, payload = wire.pack_host(hb)
    assert int(header[wire.OP]) == wire.OP_GRAPH and wire.payload_len(header) == payload.numel()
    back = wire.unpack_host(header, payload)
    for f in (
        "input_ids",
        "positions",
        "slot_mapping",
        "block_table",
        "seq_lens",
        "extend_lens",
        "logits_indices",
        "slot_ids",
    ):
        a, b = getattr(hb, f), getattr(back, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(a, b), f
    assert back.block_table.shape == (2, 5)
    # A speculator's replayed step (a V4 verify: requests of several tokens) keeps its operation.
    hb = host_batch([3, 7], [2, 3], [[2], [3, 4]], [[9, 1], [11, 5, 6]], [1, 0], 8)
    header, payload = wire.pack_host(hb, wire.OP_SPEC_VERIFY_GRAPH)
    back = wire.unpack_host(header, payload)
    assert int(header[wire.OP]) == wire.OP_SPEC_VERIFY_GRAPH
    assert np.array_equal(back.input_ids, hb.input_ids) and np.array_equal(back.extend_lens, [2, 3])


def test_the_capture_header_names_the_largest_bucket():
    h = wire.capture_header(48)
    assert int(h[wire.OP]) == wire.OP_CAPTURE and int(h[wire.REQS]) == 48


def test_speculative_messages_round_trip():
    """A speculative step's batch keeps its operation; ring rollbacks carry their rings and rows
    and positions (save) or first rejected positions, or none: put back all (restore); hidden
    states announce their dtype and shape."""
    header, _ = wire.pack(batch(True), wire.OP_SPEC_MTP)
    assert int(header[wire.OP]) == wire.OP_SPEC_MTP
    ops = {wire.OP_FORWARD, wire.OP_STOP, wire.OP_PD_POOLS, wire.OP_CAPTURE, wire.OP_GRAPH, wire.OP_SNAPSHOT}
    spec_ops = {wire.OP_SPEC_TARGET, wire.OP_SPEC_MTP, wire.OP_RING_SAVE, wire.OP_RING_RESTORE}
    graph_ops = {wire.OP_SPEC_VERIFY_GRAPH, wire.OP_SPEC_DRAFT_GRAPH, wire.OP_SPEC_CATCH_UP_GRAPH}
    assert len(ops | spec_ops | graph_ops) == 13
    header, payload = wire.ring_message(wire.OP_RING_SAVE, [0, 2], [1, 1, 7, 8])
    assert int(header[wire.OP]) == wire.OP_RING_SAVE and wire.payload_len(header) == payload.numel()
    assert wire.unpack_ring(payload) == ([0, 2], [1, 1, 7, 8])
    assert wire.unpack_ring(wire.ring_message(wire.OP_RING_RESTORE, [3], None)[1]) == ([3], None)
    assert wire.unpack_ring(wire.ring_message(wire.OP_RING_RESTORE, [3], [])[1]) == ([3], [])
    for x in (torch.zeros(5, 16), torch.zeros(3, 2, 8, dtype=torch.bfloat16), torch.zeros(0, 4)):
        y = wire.empty_hidden(wire.hidden_meta(x), torch.device("cpu"))
        assert y.shape == x.shape and y.dtype == x.dtype
