"""PD into a decode over several TP ranks (pd.rank_pools), stepped in one process: prefill writes
each decode rank's share into that rank's own pool (here a second pool on the fake fabric, its
notifications relayed to rank 0 by the same `RankRelay` the rank's process runs), and decode
lands a request only once every rank's share is in. Over real NIXL and processes:
tests/integration/test_tp_pd.py."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.pd.messages import RegisterRoom, TransferNote, registration_answer
from dsv4_engine.pd.rank_pools import RankRelay, missing_ranks, rank_refusal
from dsv4_engine.pd.transport import PoolStates
from test_state_machines import Pair, engines, mono_tokens  # noqa: F401  (engines: the fixture)


@pytest.fixture
def ranks(engines):  # noqa: F811
    """A decode of two ranks: rank 0 is the decode engine; rank 1 a pool of its own, mirroring
    rank 0's, behind its own transport, relaying to rank 0 when told to."""
    pair = Pair(engines)
    d = PoolStates.of_pool(pair.d.pool)
    mirror = PoolStates(
        {n: torch.zeros_like(t) for n, t in d.pages.items()},
        {n: torch.zeros_like(t) for n, t in d.slots.items()},
        d.page_size,
        d.tokens_per_entry,
    )
    rank1 = pair.fabric.transport("decode-x-rank1", mirror)
    relay = RankRelay(rank1, pair.dtrans.descriptor(), thread=False)
    pair.d.pd.rank_descs = [rank1.descriptor()]
    yield pair, mirror, relay
    pair.close()


def test_a_request_lands_once_every_rank_has_its_share_and_each_rank_holds_the_state(ranks, engines):  # noqa: F811
    pair, mirror, relay = ranks
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends, dt=0.01)  # prefill wrote into both ranks' pools
    assert pc.end.error is None
    pair.step(3, dt=0.01, sides="d")
    assert ds.pd.room in pair.d.pd.transfer and not dc.outputs  # rank 1's notification is not in yet
    assert list(pair.d.pd.arrived[ds.pd.room]) == [0]
    pages = torch.tensor(ds.pages, dtype=torch.long)
    for name, t in PoolStates.of_pool(pair.d.pool).pages.items():  # the same bytes in rank 1's own pool
        assert torch.equal(mirror.pages[name][pages], t[pages]) and t[pages].abs().sum() > 0, name
    assert relay.relay_once() == 1
    pair.run_until(lambda: dc.ends, dt=0.01, sides="d")
    assert dc.end.error is None and dc.tokens == mono_tokens(engines)
    got, sent = pair.d.pd.bytes_by_rank, pair.p.pd.bytes_by_rank
    assert got == sent and set(got) == {0, 1} and got[0] == got[1] > 0
    pair.assert_clean("p", "d")


@pytest.mark.parametrize("fault", ["fail_transfer", "stall_transfer"])
def test_a_failed_or_stalled_write_into_one_rank_fails_the_request_on_both_sides(ranks, fault):
    pair, _, relay = ranks
    pair.pf.arm(fault, 1, rank=1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends and dc.ends, dt=0.5, limit=60.0)
    relay.relay_once()  # nothing from rank 1: its write never landed
    assert "rank 1" in pc.end.error and dc.end.error is not None
    counter = "num_transfer_failed_reqs" if fault == "fail_transfer" else "num_transfer_timeout_reqs"
    assert pair.moved("p", counter) == 1
    pair.assert_clean("p", "d")


def test_a_rank_whose_notification_never_comes_times_out_naming_it(ranks):
    pair, _, relay = ranks
    pair.pf.arm("drop_notification", 1, rank=1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends, dt=0.01)
    assert relay.relay_once() == 0
    pair.run_until(lambda: dc.ends, dt=0.5, limit=60.0, sides="d")
    assert "did not arrive" in dc.end.error and "(rank 1)" in dc.end.error
    assert pair.moved("d", "num_transfer_timeout_reqs") == 1
    pair.assert_clean("p", "d")


def test_missing_ranks_are_those_without_a_notification():
    assert missing_ranks({}, 1) == [0]
    assert missing_ranks({0: "n"}, 1) == []
    assert missing_ranks({1: "n"}, 3) == [0, 2]


def test_the_rank_descriptors_and_the_notes_rank_travel_on_the_wire():
    msg = RegisterRoom(1, "r", {"agent": "a"}, [3], "http://d", "b", rank_descs=[{"agent": "a-rank1"}])
    assert RegisterRoom.of(msg.wire()).rank_descs == [{"agent": "a-rank1"}]
    older = {k: v for k, v in msg.wire().items() if k != "rank_descs"}
    assert RegisterRoom.of(older).rank_descs == []  # an older decode's registration names none
    with pytest.raises(ValueError, match="rank_descs"):
        RegisterRoom.of({**msg.wire(), "rank_descs": ["x"]})
    assert TransferNote.decode(TransferNote(5, 7, rank=1).encode()).rank == 1
    assert b"rank" not in TransferNote(5, 7).encode()  # rank 0's note reads as before
    with pytest.raises(ValueError, match="rank"):
        TransferNote.decode(b'{"room": 5, "token": 7, "rank": -1}')


def test_a_multi_rank_decode_refuses_a_prefill_that_writes_rank_0_only():
    """A prefill of an earlier release answers without `writes_every_rank`: its registrations
    would leave rank 1 empty and the request waiting for its deadline; decode fails it at once."""
    assert rank_refusal(registration_answer("b"), 2) is None
    assert rank_refusal({"ok": True, "boot_id": "b"}, 1) is None  # one rank: nothing else to write
    assert "earlier release" in rank_refusal({"ok": True, "boot_id": "b"}, 2)
