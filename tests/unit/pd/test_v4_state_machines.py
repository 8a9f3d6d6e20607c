"""DeepSeek-V4 across prefill and decode, on two real v4-tiny engines over the fake fabric.

A V4 request's state is paged (compressed CSA/HCA entries, indexer keys) AND held in a slot row
(the sliding-window ring, the compressor stage rings). The hand-off must move both, decode must
continue exactly where mono would (window, compression and top-k paths alike), and every fault,
abort and death must give back the pages AND the slot row on both sides (`Pair.assert_clean`).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.common import PDSettings
from dsv4_engine.pd.request_info import PDState
from dsv4_engine.pd.transport import PoolStates
from test_state_machines import (
    BOOTSTRAP_ADDR,
    DEATHS,
    DECODE_URL,
    HEARTBEAT_LIMIT,
    SETTINGS,
    STATES,
    Pair,
    assert_error,
    mono_tokens,
)

# v4-tiny: sliding window 8, CSA compresses every 4 tokens, HCA every 8, the indexer keeps top-4.
LENGTHS = {
    "shorter than the window": 5,
    "at the window": 8,
    "one past the window": 9,
    "mid CSA window": 14,
    "at an HCA boundary": 16,
    "one past an HCA boundary": 17,
    "top-k drops compressed entries": 45,  # 11 CSA entries, the indexer keeps 4
}
CHECKSUM = PDSettings(**{**SETTINGS.__dict__, "transfer_checksum": True})


@pytest.fixture(scope="module")
def v4_engines(make_model):
    model = make_model("v4-tiny")

    def make(role: str) -> Engine:
        return Engine(
            EngineArgs(
                model=str(model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=40,
                page_size=8,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                served_model_name="m",
                # the transfer path under test: decode serving repeats itself is test_decode_local_continuation's
                decode_local_prefill=0,
            )
        )

    return make("prefill"), make("decode"), make("mono")


@pytest.fixture
def pair(v4_engines):
    p = Pair(v4_engines)
    yield p
    p.close()


@pytest.fixture
def checksum_pair(v4_engines):
    p = Pair(v4_engines, settings=CHECKSUM)
    yield p
    p.close()


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(5, 250, (n,), generator=g).tolist()


def slot_bytes(engine: Engine) -> dict[str, int]:
    return engine.pool.bytes_per_request()


# ---- hand-off equals mono ------------------------------------------------------------------------


@pytest.mark.parametrize("where", list(LENGTHS))
def test_hand_off_equals_mono_and_moves_every_page_and_slot_region(pair, v4_engines, where):
    toks = prompt(LENGTHS[where])
    ps, pc, ds, dc = pair.both(prompt=toks, max_tokens=10)  # decoding crosses more boundaries
    pair.run_until(lambda: dc.ends)
    assert pc.end.error is None and dc.end.finish_reason == "length", dc.end.error
    assert dc.tokens == mono_tokens(v4_engines, toks, max_tokens=10), where
    moved = pair.p.pd.bytes_by_state
    assert set(moved) == {*pair.p.pool.states, *pair.p.pool.slot_states}  # every region, slot ones too
    for name, nbytes in slot_bytes(pair.p).items():
        assert moved[name] == nbytes, name  # one row per request
    pages = -(-len(toks) // pair.p.pool.page_size)
    for name, t in pair.p.pool.states.items():
        assert moved[name] == pages * t[0].numel() * t.element_size(), name
    assert pair.moved("d", "kv_transfer_bytes") == sum(moved.values())
    pair.assert_clean("p", "d")


def test_staggered_concurrent_hand_offs_equal_mono(pair, v4_engines):
    """Requests that arrive while others decode share decode's batches (and its slot rows)."""
    prompts = [prompt(n, seed=7) for n in (9, 23, 4, 33)]
    runs = []
    for i, toks in enumerate(prompts):
        runs.append(pair.both(prompt=toks, max_tokens=8 + i))
        pair.step(3, dt=0.01)  # the earlier ones are prefilled / decoding when the next arrives
    pair.run_until(lambda: all(dc.ends for _, _, _, dc in runs))
    for i, ((_, pc, _, dc), toks) in enumerate(zip(runs, prompts)):
        assert pc.end.error is None and dc.end.error is None, (i, dc.end.error)
        assert dc.tokens == mono_tokens(v4_engines, toks, max_tokens=8 + i), i
    pair.assert_clean("p", "d")


def test_growing_conversation_equals_mono(pair, v4_engines):
    """Four rounds, each prompt the previous one plus its answer plus a new turn."""
    history: list[int] = []
    for round_ in range(4):
        history += prompt(6 + 5 * round_, seed=round_)
        _, pc, _, dc = pair.both(prompt=history, max_tokens=6)
        pair.run_until(lambda: dc.ends)
        assert dc.end.error is None and dc.tokens == mono_tokens(v4_engines, history, max_tokens=6), round_
        history += dc.tokens
    assert len(history) > 40
    pair.assert_clean("p", "d")


# ---- faults: every region back on both sides -----------------------------------------------------


FAULTS = {
    # fault -> (armed on, params, prefill status/text or None (succeeds), decode status/text, counter moved)
    "stall_transfer": (
        "p",
        {},
        (504, "KV transfer timed out"),
        (502, "prefill failed"),
        ("p", "num_transfer_timeout_reqs"),
    ),
    "fail_transfer": ("p", {}, (502, "injected fault"), (502, "prefill failed"), ("p", "num_transfer_failed_reqs")),
    "drop_notification": ("p", {}, None, (504, "did not arrive within"), ("d", "num_transfer_timeout_reqs")),
    "delay_bootstrap": (
        "p",
        {"seconds": 10.0},
        (504, "bootstrap timed out"),
        (504, "did not arrive within"),
        ("p", "num_bootstrap_failed_reqs"),
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_ends_within_its_deadline_and_frees_pages_and_slot_rows(pair, fault):
    side, params, p_end, d_end, (c_side, counter) = FAULTS[fault]
    (pair.pf if side == "p" else pair.df).arm(fault, 1, **params)
    ps, pc, ds, dc = pair.both(prompt=prompt(21))
    spent = pair.run_until(lambda: pc.ends and dc.ends, dt=0.1)
    assert spent < SETTINGS.waiting_timeout + 0.5
    if p_end is None:
        assert pc.end.error is None
    else:
        assert_error(pc, *p_end)
    assert_error(dc, *d_end)
    assert pair.moved(c_side, counter) == 1
    pair.run_until(lambda: pair.p.pd.registrations.empty(), dt=0.5)
    pair.assert_clean("p", "d")


@pytest.mark.parametrize("state", [None, "swa_kv", "csa_index_stage", "hca_kv"])
def test_corrupt_transfer_is_caught_by_the_checksum_in_any_region(checksum_pair, state):
    pair = checksum_pair
    pair.pf.arm("corrupt_transfer", 1, **({"state": state} if state else {}))
    ps, pc, ds, dc = pair.both(prompt=prompt(21))
    before = PoolStates.of_pool(pair.p.pool)
    pair.run_until(lambda: pc.ends and dc.ends)
    assert pc.end.error is None  # prefill's part went through: what landed differs
    name = state or next(iter(before.pages))
    assert_error(dc, 502, f"checksum mismatch in region(s) {name}")
    assert pair.moved("d", "kv_transfer_checksum_failed") == 1 and pair.moved("d", "num_transfer_failed_reqs") == 1
    assert pair.moved("d", "kv_transfers_completed") == 0
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 0  # prefill's room is already done
    pair.assert_clean("p", "d")
    # the next hand-off is clean (the flipped byte was put back on prefill) and checks out
    _, pc2, _, dc2 = pair.both(prompt=prompt(21))
    pair.run_until(lambda: dc2.ends)
    assert dc2.end.error is None and pair.moved("d", "kv_transfer_checksum_failed") == 1
    assert pair.p.pd.checksum_seconds > 0
    pair.assert_clean("p", "d")


def test_decode_asks_for_checksums_when_only_it_has_the_flag(pair):
    """Only decode has --transfer-checksum: its registration asks prefill to send them."""
    pair.d.pd.settings = CHECKSUM
    pair.pf.arm("corrupt_transfer", 1, state="swa_kv")
    _, pc, _, dc = pair.both(prompt=prompt(12))
    pair.run_until(lambda: pc.ends and dc.ends)
    assert_error(dc, 502, "checksum mismatch in region(s) swa_kv")
    pair.assert_clean("p", "d")


def test_prefill_crash_mid_transfer_fails_decode_by_heartbeat(pair):
    pair.pf.arm("crash", 1)
    pair.ptrans.stall_next()
    ps, pc, ds, dc = pair.both(prompt=prompt(17))
    pair.run_until(lambda: pair.exits["prefill"])
    pair.kill("p")
    spent = pair.run_until(lambda: dc.ends, sides="d", dt=0.1)
    assert spent <= HEARTBEAT_LIMIT + 1.5
    assert_error(dc, 502, "stopped answering")
    pair.assert_clean("d")


@pytest.mark.parametrize("state", list(DEATHS))
def test_peer_death_in_every_state_gives_back_slot_rows(pair, state):
    ps, pc, ds, dc = STATES[state](pair)
    dies, status, text, counter, _ = DEATHS[state]
    pair.kill(dies)
    survivor, client = ("p", pc) if dies == "d" else ("d", dc)
    pair.run_until(lambda: client.ends, sides=survivor, dt=0.1)
    assert_error(client, status, text)
    assert pair.moved(survivor, counter) == 1
    pair.assert_clean(survivor)


@pytest.mark.parametrize("abort_side", ["p", "d"])
@pytest.mark.parametrize("state", list(STATES))
def test_client_abort_in_every_state_gives_back_slot_rows(pair, state, abort_side):
    ps, pc, ds, dc = STATES[state](pair)
    held = pair.d.pool.slots.num_free < pair.d.pool.slots.total or pair.p.pool.slots.num_free < pair.p.pool.slots.total
    assert held or state in ("prefill-bootstrap", "decode-prealloc")  # the state holds rows somewhere
    (pair.p if abort_side == "p" else pair.d).abort((ps if abort_side == "p" else ds).rid, reason="client went away")
    pair.run_until(lambda: pc.ends and dc.ends, dt=0.05, limit=10.0)
    assert_error(pc if abort_side == "p" else dc, 503, "client went away")
    pair.run_until(lambda: pair.p.pd.registrations.empty(), dt=0.5)
    pair.assert_clean("p", "d")


# ---- bootstrap-time refusals and slot-row waits --------------------------------------------------


def test_a_decode_whose_slot_state_differs_is_refused_at_bootstrap(pair):
    d = pair.d.pool
    wider = {n: torch.zeros(t.shape[0], *t.shape[1:-1], t.shape[-1] * 2) for n, t in d.slot_states.items()}
    odd = PoolStates(d.states, wider, d.page_size, {n: s.tokens_per_entry for n, s in d.specs.items()})
    pair.d.pd.transport = pair.fabric.transport("decode-x", odd)
    ps, pc, ds, dc = pair.both(prompt=prompt(9))
    pair.run_until(lambda: pc.ends and dc.ends)
    assert_error(pc, 502, "incompatible KV layout: slot region swa_kv: slot shape")
    assert_error(dc, 502, "incompatible KV layout")
    assert pair.moved("p", "num_bootstrap_failed_reqs") == 1
    pair.assert_clean("p", "d")


def test_a_decode_with_another_page_size_is_refused_at_bootstrap(pair):
    d = pair.d.pool
    other = PoolStates(d.states, d.slot_states, 2 * d.page_size, {n: s.tokens_per_entry for n, s in d.specs.items()})
    pair.d.pd.transport = pair.fabric.transport("decode-x", other)
    _, pc, _, dc = pair.both(prompt=prompt(9))
    pair.run_until(lambda: pc.ends and dc.ends)
    assert_error(pc, 502, "page size 8 != 16 tokens")
    pair.assert_clean("p", "d")


def test_decode_waits_for_a_slot_row_without_holding_pages(pair, v4_engines):
    slots = pair.d.pool.slots
    taken = [slots.allocate() for _ in range(slots.num_free)]  # every row held by running requests
    ps, pc, ds, dc = pair.both(prompt=prompt(9))
    pair.step(5, dt=0.1)
    assert ds in pair.d.pd.prealloc and pair.d.pool.allocator.num_free == pair.d.pool.num_pages
    for s in taken:
        slots.free(s)
    pair.run_until(lambda: dc.ends)
    assert dc.end.error is None and dc.tokens == mono_tokens(v4_engines, prompt(9))
    pair.assert_clean("p", "d")


def test_deadlines_off_a_stalled_v4_transfer_wedges_until_aborted(v4_engines):
    pair = Pair(v4_engines, deadlines=False)
    try:
        pair.pf.arm("stall_transfer", 1)
        ps, pc, ds, dc = pair.both(prompt=prompt(21))
        pair.run_until(lambda: ps.pd.room in pair.p.pd.inflight and ds.pd.room in pair.d.pd.transfer)
        pair.step(40, dt=10.0)  # 400 s
        assert not pc.ends and not dc.ends and ps.pd.state is PDState.TRANSFERRING
        queues, extra = pair.p.pd.loads()
        assert queues["inflight"] == 1 and extra["prefill_inflight_oldest_age_seconds"] >= 400
        assert pair.p.pool.slots.num_free == pair.p.pool.slots.total - 1  # the wedge pins a slot row too
        assert pair.d.pool.slots.num_free == pair.d.pool.slots.total - 1
        pair.p.abort(all_=True, reason="operator")
        pair.run_until(lambda: pc.ends and dc.ends)
        assert_error(pc, 503, "request aborted")
        assert_error(dc, 502, "prefill failed")
        assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 1
        pair.assert_clean("p", "d")
    finally:
        pair.close()
