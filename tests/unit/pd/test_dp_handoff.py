"""PD with data-parallel attention (pd.dp_handoff, pd.dp_sender): which rank's pool a request's KV
is read from and lands in, and the hand-off naming both ranks. The sender part runs three real
NIXL agents in this process: prefill's rank 0 and rank 1 (each its own pool) and a decode pool;
rank 0 asks rank 1 to write rank 1's pages, as a DP prefill does between its processes. Engines
over real processes: tests/integration/test_dp_pd.py."""

from __future__ import annotations

import time

import pytest
import torch

from dsv4_engine.parallel.dp_pages import DPPageAllocator
from dsv4_engine.pd.checksum import region_checksums
from dsv4_engine.pd.dp_handoff import awaited_ranks, dp_rank_refusal, locate
from dsv4_engine.pd.messages import RegisterRoom, TransferNote, registration_answer
from dsv4_engine.pd.transport import PoolStates, TransferState

P = 8  # pages per rank


def test_a_requests_pages_are_located_on_one_rank_in_its_local_ids():
    assert locate([9, 8, 15], P) == (1, [1, 0, 7])
    assert locate([0, 3], P) == (0, [0, 3])
    with pytest.raises(ValueError, match="span ranks"):
        locate([7, 8], P)


def test_a_dp_decode_receives_on_the_least_loaded_rank_and_awaits_that_rank_alone():
    books = DPPageAllocator(2, P)
    first = books.allocate_to_receive(3)
    assert locate(first, P)[0] == 0  # both empty: the lower rank
    second = books.allocate_to_receive(2)
    assert locate(second, P)[0] == 1  # rank 0 holds 3 now: rank 1
    assert awaited_ranks(1, 2) == [1]  # DP: the KV is in that rank's pool only
    assert awaited_ranks(None, 3) == [0, 1, 2]  # TP: every rank mirrors it


def test_the_hand_off_names_both_ranks_and_an_earlier_prefill_is_refused_at_once():
    reg = RegisterRoom.of(RegisterRoom(1, "r", {"agent": "d"}, [2, 3], "http://d", "boot", decode_dp_rank=1).wire())
    assert reg.decode_dp_rank == 1 and RegisterRoom.of({**reg.wire(), "decode_dp_rank": None}).decode_dp_rank is None
    with pytest.raises(ValueError, match="decode_dp_rank"):
        RegisterRoom.of({**reg.wire(), "decode_dp_rank": -1})
    note = TransferNote.decode(TransferNote(1, 7, "b", rank=1, prefill_dp_rank=0).encode())
    assert (note.rank, note.prefill_dp_rank) == (1, 0)
    assert TransferNote.decode(TransferNote(1, 7).encode()).prefill_dp_rank is None
    assert dp_rank_refusal(registration_answer("b")) is None
    assert "earlier release" in dp_rank_refusal({"ok": True, "boot_id": "b", "writes_every_rank": True})


def pool(seed: int) -> PoolStates:
    g = torch.Generator().manual_seed(seed)
    return PoolStates({"kv": torch.randn(P, 2, 4, 16, generator=g)}, page_size=4)


def until(cond, sender, decode, notes: list, limit: float = 20.0):
    """Drive every agent (none has a progress thread) until `cond()`; decode's notifications go
    to `notes`."""
    deadline = time.monotonic() + limit
    while not cond():
        sender.serve_once()
        notes.extend(decode.poll_notifs())
        assert time.monotonic() < deadline, "nothing moved"
        time.sleep(0.002)


def test_rank_1s_pages_are_written_by_rank_1_from_its_own_pool_with_its_checksums():
    from dsv4_engine.pd.dp_sender import DPSendTransport, RankSender
    from dsv4_engine.pd.nixl.agent import KVTransferAgent

    r0, r1 = pool(1), pool(2)
    dst = PoolStates({"kv": torch.zeros(P, 2, 4, 16)}, page_size=4)
    with (
        KVTransferAgent("dp-prefill-r0", r0) as a0,
        KVTransferAgent("dp-prefill-r1", r1) as a1,
        KVTransferAgent("dp-decode", dst) as ad,
    ):
        sender = RankSender(a1, a0.descriptor(), r1, thread=False)
        t = DPSendTransport(a0, [a1.descriptor()], P)
        peer = t.add_peer(ad.descriptor())
        note = TransferNote(5, 42, "boot", prefill_dp_rank=1).encode()
        h = t.write_pages(peer, [P + 3, P + 1], [6, 0], note, checksum=True)  # rank 1's local pages 3, 1
        notes: list = []
        until(lambda: t.poll(h) is not TransferState.PENDING, sender, ad, notes)
        assert t.poll(h) is TransferState.DONE, t.error(h)
        assert t.info(h).nbytes == 2 * r1.pages["kv"][0].numel() * 4
        assert torch.equal(dst.pages["kv"][[6, 0]], r1.pages["kv"][[3, 1]])  # rank 1's bytes, not rank 0's
        until(lambda: notes, sender, ad, notes)
        landed = TransferNote.decode(notes[0][1])
        assert (landed.room, landed.token, landed.prefill_dp_rank) == (5, 42, 1)
        assert landed.checksums == region_checksums(r1, [3, 1], None)  # summed by rank 1
        t.release(h)
        # a rank-0 page goes through rank 0's own agent
        h0 = t.write_pages(peer, [2], [7], b"")
        until(lambda: t.poll(h0) is not TransferState.PENDING, sender, ad, notes)
        assert t.poll(h0) is TransferState.DONE and torch.equal(dst.pages["kv"][7], r0.pages["kv"][2])
        t.release(h0)
        # a write rank 1 cannot start (its decode peer unknown to it: a bad descriptor) ends FAILED on rank 0
        t.descs[peer] = {"agent": "nobody"}
        hf = t.write_pages(peer, [P], [1], b"")
        until(lambda: t.poll(hf) is not TransferState.PENDING, sender, ad, notes)
        assert t.poll(hf) is TransferState.FAILED and "rank could not start" in t.error(hf)


def test_pd_roles_start_at_dp_size_n_and_a_checksumming_dp_decode_is_refused_by_name():
    from dsv4_engine.parallel.dp_attention import dp_refusal
    from dsv4_serve.server_args import ServerArgs

    def refusal(**kw):
        return dp_refusal(ServerArgs(model="m", tp_size=2, dp_size=2, cuda_graph_max_bs=0, **kw), "deepseek_v3")

    assert refusal(role="prefill") is None and refusal(role="decode") is None
    assert refusal(role="prefill", transfer_checksum=True) is None  # rank p sums what it sends
    line = refusal(role="decode", transfer_checksum=True)
    assert line is not None and "--transfer-checksum" in line and "--dp-size" in line
    line = refusal(role="prefill", speculative_algorithm="mtp")  # each built at --dp-size, not yet together
    assert line is not None and "PD" in line and "--speculative-algorithm" in line
