"""The prefill and decode state machines over the in-process fake transport and control channel,
on real tiny engines, with a fake clock. The test drives both engine loops by calling step().

Every PD state x every fault (stall, fail, dropped notification, peer death, crash, bootstrap
delay past its deadline, deadlines off) x abort from either side: the client of each side hears
one end with the right status, pages come back on both sides, the right counter moves, each
peer is told at most once, and every queue ends empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.common import HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES, PDSettings
from dsv4_engine.pd.request_info import PDRequestInfo, PDState
from dsv4_engine.pd.decode import DecodeController
from dsv4_engine.pd.fake import FakeFabric
from dsv4_engine.pd.faults import Deadlines, FaultInjector, FaultyChannel, FaultyTransport
from dsv4_engine.pd.prefill import PrefillController
from dsv4_engine.pd.transport import KVTransport, PoolStates
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.request_output import RequestOutput

BOOTSTRAP_ADDR = "http://127.0.0.1:9100"
DECODE_URL = "http://127.0.0.1:8200"
SETTINGS = PDSettings(bootstrap_timeout=4.0, transfer_timeout=3.0, waiting_timeout=8.0, url=DECODE_URL)
HEARTBEAT_LIMIT = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES
PROMPT = list(range(10, 45))  # 35 tokens: 3 pages of 16
KV_PAGES = 24


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engines(tiny_model):
    def make(role: str) -> Engine:
        return Engine(
            EngineArgs(
                model=str(tiny_model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=KV_PAGES,
                page_size=16,
                served_model_name="m",
                # the transfer path under test: decode serving repeats itself is test_decode_local_continuation's
                decode_local_prefill=0,
            )
        )

    return make("prefill"), make("decode"), make("mono")


@dataclass
class Client:
    """What one side's HTTP client would hear."""

    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def ends(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]

    @property
    def end(self) -> RequestOutput:
        assert len(self.ends) == 1, self.outputs
        return self.ends[0]

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]


class Pair:
    """A prefill and a decode engine linked through a fake fabric, with fault injectors armed
    the way /admin/faults arms them, and exit functions that record instead of exiting."""

    def __init__(self, engines, deadlines: bool = True, settings: PDSettings = SETTINGS):
        self.p, self.d, self.mono = engines
        self.clock = Clock()
        self.fabric = FakeFabric()
        self.exits: dict[str, list[int]] = {"prefill": [], "decode": []}
        self.pf, self.df = FaultInjector(), FaultInjector()
        pstates, dstates = PoolStates.of_pool(self.p.pool), PoolStates.of_pool(self.d.pool)
        self.ptrans = self.fabric.transport("prefill-x", pstates)
        self.dtrans = self.fabric.transport("decode-x", dstates)
        common = dict(clock=self.clock)
        self.p.pd = PrefillController(
            self.p,
            settings,
            FaultyTransport(self.ptrans, self.pf, self.exits["prefill"].append, states=pstates),
            FaultyChannel(self.fabric.channel(self.p.call), self.pf, self.exits["prefill"].append),
            deadlines=Deadlines(deadlines, self.pf),
            faults=self.pf,
            boot_id="pboot",
            **common,
        )
        self.d.pd = DecodeController(
            self.d,
            settings,
            FaultyTransport(self.dtrans, self.df, self.exits["decode"].append, states=dstates),
            FaultyChannel(self.fabric.channel(self.d.call), self.df, self.exits["decode"].append),
            deadlines=Deadlines(deadlines, self.df),
            faults=self.df,
            boot_id="dboot",
            **common,
        )
        self.fabric.serve(BOOTSTRAP_ADDR, self.p.pd, "prefill")
        self.fabric.serve(DECODE_URL, self.d.pd, "decode")
        self.counters = {"p": dict(self.p.metrics.totals), "d": dict(self.d.metrics.totals)}
        self.room = 100
        self.dead: set[str] = set()

    # ---- requests -----------------------------------------------------------------------------

    def request(
        self, side: str, prompt=PROMPT, max_tokens: int = 4, room: Optional[int] = None
    ) -> tuple[Sequence, Client]:
        self.room += 1
        client = Client()
        seq = Sequence(
            rid=f"{side}-{self.room}",
            prompt_ids=list(prompt),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            sink=client.outputs.append,
        )
        seq.pd = PDRequestInfo("127.0.0.1", 9100, room if room is not None else self.room)
        seq.prefill_only = side == "p"
        (self.p if side == "p" else self.d).submit(seq)
        return seq, client

    def both(self, **kw) -> tuple[Sequence, Client, Sequence, Client]:
        ps, pc = self.request("p", **kw)
        ds, dc = self.request("d", room=ps.pd.room, **kw)
        return ps, pc, ds, dc

    # ---- driving the loops --------------------------------------------------------------------

    def step(self, n: int = 1, dt: float = 0.0, sides: str = "pd") -> None:
        for _ in range(n):
            self.clock.now += dt
            if "p" in sides and "p" not in self.dead:
                self._step(self.p)
            if "d" in sides and "d" not in self.dead:
                self._step(self.d)

    @staticmethod
    def _step(e: Engine) -> None:
        if e.inbox.empty() and not e.scheduler.has_work() and not e.pd.busy():
            e.pd.poll()  # all an idle step does, without its 20 ms wait for input
        else:
            e.step()

    def run_until(self, cond: Callable[[], bool], dt: float = 0.05, limit: float = 30.0, sides: str = "pd") -> float:
        """Step both loops, moving the clock dt per step, until cond(); returns fake seconds spent."""
        start = self.clock.now
        while not cond():
            assert self.clock.now - start < limit, "condition not reached"
            self.step(dt=dt, sides=sides)
        return self.clock.now - start

    def stage(self, side: str) -> None:
        """Take in new messages and run the controller's poll, but schedule no forward pass."""
        e = self.p if side == "p" else self.d
        e._drain_inbox(0)
        e.pd.poll()

    def kill(self, side: str) -> None:
        """The process dies: its transport and its endpoints stop answering, its loop stops."""
        self.dead.add(side)
        self.fabric.die(*(("prefill-x", BOOTSTRAP_ADDR) if side == "p" else ("decode-x", DECODE_URL)))

    # ---- what must hold at the end ---------------------------------------------------------------

    def moved(self, side: str, name: str) -> float:
        e = self.p if side == "p" else self.d
        return e.metrics.totals.get(name, 0) - self.counters[side].get(name, 0)

    def assert_clean(self, *sides: str) -> None:
        self.step(3, dt=0.01, sides="".join(sides))  # aborts in flight land
        for side in sides:
            e = self.p if side == "p" else self.d
            assert e.pool.allocator.num_free == e.pool.num_pages, f"{side} holds pages"
            assert e.pool.slots is None or e.pool.slots.num_free == e.pool.slots.total, f"{side} holds slot rows"
            assert not e.seqs and not e.scheduler.has_work() and e.inbox.empty(), side
            assert not e.pd.busy(), side
            if side == "p":
                assert not e.pd.pending
            else:
                assert not e.pd.prefills

    def close(self) -> None:
        """Leave the shared engines empty for the next test (a killed side is revived)."""
        for e in (self.p, self.d):
            e.abort(all_=True, reason="test teardown")
            e._drain_inbox(0)
            e.pd = None
            e._drain_inbox(0)
            assert e.pool.allocator.num_free == e.pool.num_pages
            assert e.pool.slots is None or e.pool.slots.num_free == e.pool.slots.total


@pytest.fixture
def pair(engines):
    p = Pair(engines)
    yield p
    p.close()


@pytest.fixture
def pair_without_deadlines(engines):
    p = Pair(engines, deadlines=False)
    yield p
    p.close()


def mono_tokens(engines, prompt=PROMPT, max_tokens: int = 4) -> list[int]:
    mono = engines[2]
    client = Client()
    mono.submit(
        Sequence(
            rid=f"mono-{len(prompt)}-{max_tokens}",
            prompt_ids=list(prompt),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            sink=client.outputs.append,
        )
    )
    while not client.ends:
        mono.step()
    return client.tokens


def assert_error(client: Client, status: int, text: str = "") -> None:
    end = client.end
    assert end.finish_reason in ("error", "abort") and end.error_code == status, (end.error_code, end.error)
    assert text in end.error, end.error


# ---- the happy path and the two recovery fixes --------------------------------------------------


def test_hand_off_equals_mono_and_moves_every_region(pair, engines):
    ps, pc, ds, dc = pair.both(max_tokens=6)
    pair.run_until(lambda: dc.ends)
    assert pc.end.finish_reason == "stop" and pc.end.error is None
    assert dc.end.finish_reason == "length" and dc.tokens == mono_tokens(engines, max_tokens=6)
    assert pair.moved("p", "kv_transfers_completed") == 1 and pair.moved("d", "kv_transfers_completed") == 1
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 0 and pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 0
    pair.assert_clean("p", "d")


def test_first_request_after_an_idle_spell_succeeds(pair):
    """Issue 11: the decode's view of the prefill's heartbeats went stale while idle, so the
    first request after a few idle seconds failed once."""
    for idle in (0.0, 3 * HEARTBEAT_LIMIT, 60.0):
        pair.step(5, dt=idle / 5)  # both loops run, nothing to do
        ps, pc, ds, dc = pair.both()
        pair.step(2, dt=0.01, sides="d")  # registered, waiting for the KV: liveness is judged now
        assert ds.pd.room in pair.d.pd.transfer, (idle, dc.outputs)
        pair.run_until(lambda: dc.ends, dt=0.05)
        assert dc.end.error is None and dc.end.finish_reason == "length", (idle, dc.end.error)
        assert pc.end.error is None
    assert pair.moved("d", "num_transfer_failed_reqs") == 0
    pair.assert_clean("p", "d")


def test_kv_that_lands_before_decode_hears_its_registration_answer_is_not_lost(pair, engines):
    """Under load prefill can prefill and write before decode's engine thread has taken in the
    answer to its registration: the notification then arrives for a room still registering.
    It must be kept and applied, not dropped (the request would wait for its deadline)."""
    ps, pc, ds, dc = _decode_registering(pair)  # the answer waits in decode's inbox
    pair.run_until(lambda: pc.ends, sides="p")  # prefill forwards and writes the KV meanwhile
    assert pc.end.error is None and ds.pd.room in pair.d.pd.registering
    pair.d.pd.poll()  # decode reads the notification before its inbox
    assert ds.pd.room in pair.d.pd.arrived and not dc.outputs
    pair.run_until(lambda: dc.ends, dt=0.01, limit=1.0, sides="d")  # far inside the 8 s deadline
    assert dc.end.error is None and dc.end.finish_reason == "length"
    assert dc.tokens == mono_tokens(engines)
    assert pair.moved("d", "num_transfer_timeout_reqs") == 0 and not pair.d.pd.arrived
    pair.assert_clean("p", "d")


def test_logprobs_of_the_first_token_travel_in_the_notification(pair, monkeypatch):
    """When the serving layer records logprobs, the prefill's entry reaches decode's engine."""
    entry = {"token_id": 0, "logprob": -0.5, "top": [[0, -0.5], [1, -1.5]]}
    got = []
    real = pair.d.accept_first_token

    def accept(seq, tok, logprobs=None):
        got.append((tok, logprobs))
        seq.__dict__.pop("output_logprobs", None)
        return real(seq, tok)

    monkeypatch.setattr(pair.d, "accept_first_token", accept)
    ps, pc, ds, dc = pair.both()
    ps.output_logprobs, ds.output_logprobs = [], []
    real_write = pair.ptrans.write_pages
    notes = []

    def write(peer, src, dst, notif):
        notes.append(json.loads(notif))
        return real_write(peer, src, dst, notif)

    pair.ptrans.write_pages = write

    real_on_done = pair.p.pd.on_prefill_done

    def on_done(seq):
        seq.output_logprobs.append(dict(entry, token_id=seq.output_ids[-1]))
        real_on_done(seq)

    pair.p.pd.on_prefill_done = on_done
    pair.run_until(lambda: dc.ends)
    assert notes[0]["logprobs"]["logprob"] == -0.5 and notes[0]["logprobs"]["token_id"] == notes[0]["token"]
    assert got == [(notes[0]["token"], notes[0]["logprobs"])]
    pair.assert_clean("p", "d")


# ---- transfer faults (prefill inflight, decode transfer) -----------------------------------------


def test_stalled_transfer_fails_at_the_prefill_deadline_and_decode_hears_it(pair):
    pair.pf.arm("stall_transfer", 1)
    ps, pc, ds, dc = pair.both()
    spent = pair.run_until(lambda: pc.ends and dc.ends)
    assert SETTINGS.transfer_timeout <= spent < SETTINGS.transfer_timeout + 0.5
    assert_error(pc, 504, "KV transfer timed out")
    assert_error(dc, 502, "prefill failed this request")
    assert pair.moved("p", "num_transfer_timeout_reqs") == 1 and pair.moved("d", "num_transfer_failed_reqs") == 1
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 1 and pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 0
    pair.assert_clean("p", "d")


def test_failed_transfer_fails_both_at_once(pair):
    pair.pf.arm("fail_transfer", 1)
    ps, pc, ds, dc = pair.both()
    spent = pair.run_until(lambda: pc.ends and dc.ends)
    assert spent < 0.5
    assert_error(pc, 502, "injected fault fail_transfer")
    assert_error(dc, 502, "prefill failed this request")
    assert pair.moved("p", "num_transfer_failed_reqs") == 1 and pair.moved("d", "num_transfer_failed_reqs") == 1
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 1 and pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 0
    pair.assert_clean("p", "d")


def test_transport_failure_from_the_fabric_itself(pair):
    pair.ptrans.fail_next("nixlBackendError: link down")
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends and dc.ends)
    assert_error(pc, 502, "link down")
    assert_error(dc, 502, "prefill failed")
    pair.assert_clean("p", "d")


def test_dropped_notification_fails_decode_at_its_deadline(pair):
    pair.pf.arm("drop_notification", 1)
    ps, pc, ds, dc = pair.both()
    spent = pair.run_until(lambda: dc.ends, dt=0.2)
    assert SETTINGS.waiting_timeout <= spent < SETTINGS.waiting_timeout + 0.5
    assert pc.end.error is None  # prefill's part went through: the data landed
    assert_error(dc, 504, "did not arrive within")
    assert pair.moved("d", "num_transfer_timeout_reqs") == 1 and pair.moved("p", "num_transfer_failed_reqs") == 0
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 1 and pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 0
    pair.assert_clean("p", "d")


def test_decode_death_mid_transfer_fails_prefill_at_once(pair):
    pair.ptrans.stall_next()  # the transfer is on the wire when decode dies
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ps.pd.room in pair.p.pd.inflight)
    pair.kill("d")
    spent = pair.run_until(lambda: pc.ends, sides="p")
    assert spent < 0.2
    assert_error(pc, 502, "remote disconnect")
    assert pair.moved("p", "num_transfer_failed_reqs") == 1
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 1  # tried once; nobody answers
    pair.assert_clean("p")


def test_silent_decode_is_declared_dead_by_heartbeat(pair):
    pair.pf.arm("stall_transfer", 1)  # the transfer neither ends nor fails: only liveness can tell
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ps.pd.room in pair.p.pd.inflight and ds.pd.room in pair.d.pd.transfer)
    pair.kill("d")
    spent = pair.run_until(lambda: pc.ends, sides="p", dt=0.1)
    assert HEARTBEAT_LIMIT - 1.0 <= spent <= HEARTBEAT_LIMIT + 0.5 or spent <= SETTINGS.transfer_timeout + 0.2
    assert_error(pc, 504 if spent >= SETTINGS.transfer_timeout else 502)
    pair.assert_clean("p")


def test_prefill_death_while_decode_waits_fails_decode_by_heartbeat(pair):
    pair.pf.arm("stall_transfer", 1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ds.pd.room in pair.d.pd.transfer and ps.pd.room in pair.p.pd.inflight)
    pair.kill("p")
    spent = pair.run_until(lambda: dc.ends, sides="d", dt=0.1)
    assert HEARTBEAT_LIMIT <= spent < HEARTBEAT_LIMIT + 1.5 and spent < SETTINGS.waiting_timeout
    assert_error(dc, 502, "stopped answering")
    assert pair.moved("d", "num_transfer_failed_reqs") == 1
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ds.pd.room) == 1
    pair.assert_clean("d")


def test_prefill_restart_is_seen_by_its_new_boot_id(pair):
    pair.pf.arm("stall_transfer", 1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ds.pd.room in pair.d.pd.transfer and ps.pd.room in pair.p.pd.inflight)
    pair.p.pd.boot_id = "pboot-2"  # the same address answers as another process
    spent = pair.run_until(lambda: dc.ends and pc.ends)
    assert spent < HEARTBEAT_INTERVAL_S + 0.5
    assert_error(dc, 502, "restarted")
    pair.assert_clean("p", "d")


def test_a_registration_whose_answer_is_lost_is_aborted_on_prefill_too(pair):
    """Prefill took the registration but decode never heard its answer (its call timed out):
    decode frees the reserved pages, so it must tell prefill, or prefill would later write this
    room's KV into pages another request may own by then."""
    channel = pair.d.pd.channel
    real_register = channel.register

    def register_answer_lost(addr, body, done):
        real_register(addr, body, lambda res, err: done(None, "POST /bootstrap/register failed: ReadTimeout"))

    channel.register = register_answer_lost
    try:
        ps, pc, ds, dc = pair.both()
        pair.run_until(lambda: dc.ends and pc.ends, dt=0.05)
    finally:
        channel.register = real_register
    assert_error(dc, 502, "cannot register")
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 1
    assert pc.end.error is not None  # prefill dropped the room instead of writing into freed pages
    assert pair.moved("p", "kv_transfers_completed") == 0
    pair.assert_clean("p", "d")


def test_decode_dies_before_registering_prefill_fails_at_bootstrap_deadline(pair):
    ps, pc = pair.request("p")
    pair.kill("d")
    spent = pair.run_until(lambda: pc.ends, sides="p", dt=0.1)
    assert SETTINGS.bootstrap_timeout <= spent < SETTINGS.bootstrap_timeout + 0.3
    assert_error(pc, 504, "bootstrap timed out")
    assert pair.moved("p", "num_bootstrap_failed_reqs") == 1
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 0  # it never knew a decode
    pair.assert_clean("p")


def test_unreachable_prefill_fails_registration_at_once(pair):
    pair.kill("p")
    ds, dc = pair.request("d")
    spent = pair.run_until(lambda: dc.ends, sides="d")
    assert spent < 0.2
    assert_error(dc, 502, "cannot register with prefill")
    assert pair.moved("d", "num_bootstrap_failed_reqs") == 1
    pair.assert_clean("d")


# ---- crash (at the seam: the exit function is recorded instead of exiting) -----------------------


def test_prefill_crash_fires_with_the_transfer_started(pair):
    pair.pf.arm("crash", 1)
    pair.ptrans.stall_next()
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pair.exits["prefill"])
    assert pair.exits == {"prefill": [17], "decode": []} and ps.pd.handle is not None
    pair.kill("p")  # what os._exit(17) does
    pair.run_until(lambda: dc.ends, sides="d", dt=0.1)
    assert_error(dc, 502, "stopped answering")
    pair.assert_clean("d")


def test_decode_crash_fires_once_its_room_is_registered(pair):
    pair.df.arm("crash", 1)
    pair.pf.arm("stall_transfer", 1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pair.exits["decode"])
    assert pair.exits == {"prefill": [], "decode": [17]} and ds.pd.room in pair.d.pd.transfer
    pair.kill("d")
    pair.run_until(lambda: pc.ends, sides="p", dt=0.1)
    assert_error(pc, 504, "KV transfer timed out")  # the stalled transfer's deadline comes before the heartbeat's
    pair.assert_clean("p")


# ---- bootstrap delay ------------------------------------------------------------------------------


def test_short_bootstrap_delay_still_succeeds(pair):
    pair.pf.arm("delay_bootstrap", 1, seconds=1.0)
    _, pc, _, dc = pair.both()
    spent = pair.run_until(lambda: dc.ends)
    assert 1.0 <= spent < 1.5 and dc.end.error is None and pc.end.error is None
    pair.assert_clean("p", "d")


def test_bootstrap_delay_past_the_deadline_fails_both_and_tells_each_once(pair):
    pair.pf.arm("delay_bootstrap", 1, seconds=10.0)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends and dc.ends, dt=0.1)
    assert_error(pc, 504, "bootstrap timed out")
    assert_error(dc, 504, "did not arrive within")
    assert pair.moved("p", "num_bootstrap_failed_reqs") == 1 and pair.moved("d", "num_transfer_timeout_reqs") == 1
    pair.run_until(lambda: pair.p.pd.registrations.empty(), dt=0.5)  # the late registration is applied...
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 0  # ...and not answered: decode knows already
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 1
    pair.assert_clean("p", "d")


def test_registration_for_a_room_prefill_already_failed_tells_decode_once(pair):
    pair.pf.arm("delay_bootstrap", 1, seconds=4.5)  # after prefill's deadline, before decode's
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends and dc.ends, dt=0.1)
    assert_error(pc, 504, "bootstrap timed out")
    assert_error(dc, 502, "prefill failed")
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 1 and pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 0
    pair.assert_clean("p", "d")


# ---- deadlines off: the production wedge, and how an operator's abort clears it ------------------


@pytest.mark.parametrize("abort_side", ["p", "d"])
def test_deadlines_off_a_stalled_transfer_waits_until_aborted(pair_without_deadlines, abort_side):
    pair = pair_without_deadlines
    pair.pf.arm("stall_transfer", 1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ps.pd.room in pair.p.pd.inflight and ds.pd.room in pair.d.pd.transfer)
    pair.step(40, dt=10.0)  # 400 s: far past every deadline and heartbeat limit
    assert not pc.ends and not dc.ends and ps.pd.state is PDState.TRANSFERRING
    assert pair.p.pd.loads()[1]["prefill_inflight_oldest_age_seconds"] >= 400
    (pair.p if abort_side == "p" else pair.d).abort(all_=True, reason="operator")
    pair.run_until(lambda: pc.ends and dc.ends)
    aborted, told = (pc, dc) if abort_side == "p" else (dc, pc)
    assert_error(aborted, 503, "request aborted")
    assert_error(told, 502 if abort_side == "p" else 503)
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == (abort_side == "p")
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == (abort_side == "d")
    pair.assert_clean("p", "d")


def test_a_wedged_hand_off_shows_its_timeline_in_loads(pair_without_deadlines):
    """What the watchdog's evidence keeps of a stuck request: each side's PD events in order,
    with their ages, and how long since it last made progress."""
    pair = pair_without_deadlines
    pair.pf.arm("stall_transfer", 1)
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ps.pd.room in pair.p.pd.inflight and ds.pd.room in pair.d.pd.transfer)
    pair.step(40, dt=10.0)
    (p_view,) = [v for v in pair.p.pd.loads()[1]["requests"] if v["rid"] == ps.rid]
    (d_view,) = [v for v in pair.d.pd.loads()[1]["requests"] if v["rid"] == ds.rid]
    assert [e["event"] for e in p_view["events"]] == [
        "arrival",
        "Bootstrapping",
        "WaitingForInput",
        "forward_done",
        "Transferring",
    ]
    assert [e["event"] for e in d_view["events"]] == ["arrival", "Bootstrapping", "Transferring"]
    for v in (p_view, d_view):
        assert v["state"] == "Transferring" and v["room"] == ps.pd.room and v["deadline_in_seconds"] is None
        assert v["last_progress_seconds_ago"] >= 400 and v["in_state_seconds"] >= 400
        ages = [e["seconds_ago"] for e in v["events"]]
        assert ages == sorted(ages, reverse=True)  # in the order they happened
    pair.p.abort(all_=True, reason="operator")
    pair.run_until(lambda: pc.ends and dc.ends)
    assert pair.p.pd.loads()[1]["requests"] == [] and pair.d.pd.loads()[1]["requests"] == []


def test_timelines_put_unfinished_hand_offs_first():
    from dsv4_engine.pd.request_info import PDRequestInfo, stuck_first, timeline_view

    views = []
    for rid, state, t in (
        ("landed", PDState.SUCCESS, 1.0),
        ("slow", PDState.TRANSFERRING, 5.0),
        ("stuck", PDState.TRANSFERRING, 2.0),
    ):
        info = PDRequestInfo("h", 1, 7)
        info.mark("arrival", 0.0)
        info.enter(state, None, t)
        views.append(timeline_view(rid, info, None, 0, 10.0, 1000.0))
    assert [v["rid"] for v in stuck_first(views)] == ["stuck", "slow", "landed"]
    assert views[2]["events"][1] == {"event": "Transferring", "seconds_ago": 8.0, "at": 992.0}
    assert [v["rid"] for v in stuck_first(views, 1)] == ["stuck"]


def test_disable_deadlines_fault_switches_the_policy(pair):
    assert pair.p.pd.deadlines.on
    pair.pf.arm("disable_deadlines", -1)
    assert not pair.p.pd.deadlines.on and pair.p.pd.loads()[1]["deadlines"] is False
    ps, pc = pair.request("p")
    pair.step(20, dt=1.0, sides="p")
    assert not pc.ends and ps.pd.deadline is None
    pair.pf.clear()
    assert pair.p.pd.deadlines.on


# ---- abort from either side, in every state ------------------------------------------------------


def _prefill_bootstrap(pair):
    ps, pc = pair.request("p")
    pair.step(sides="p")
    ds, dc = pair.request("d", room=ps.pd.room)
    pair.pf.arm("delay_bootstrap", 1, seconds=2.0)
    pair.step(sides="d")  # decode registers; prefill holds the registration back
    pair.stage("p")
    assert ps.pd.room in pair.p.pd.bootstrap
    return ps, pc, ds, dc


def _prefill_waiting_for_input(pair):
    ps, pc, ds, dc = pair.both()
    pair.step(sides="d")
    pair.stage("d")
    pair.stage("p")  # registration applied: the request is an ordinary prefill in the scheduler
    assert ps.pd.state is PDState.WAITING_FOR_INPUT and ps in pair.p.scheduler.waiting
    return ps, pc, ds, dc


def _prefill_inflight(pair):
    pair.ptrans.stall_next()
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: ps.pd.room in pair.p.pd.inflight and ds.pd.room in pair.d.pd.transfer)
    return ps, pc, ds, dc


def _decode_prealloc(pair):
    ps, pc, ds, dc = pair.both()
    pair.d._drain_inbox(0)
    pair.step(sides="p")
    assert ds in pair.d.pd.prealloc
    return ps, pc, ds, dc


def _decode_registering(pair):
    ps, pc, ds, dc = pair.both()
    pair.step(sides="p")
    pair.stage("d")  # the registration is sent; its answer waits in decode's inbox
    assert ds.pd.room in pair.d.pd.registering
    return ps, pc, ds, dc


STATES = {
    "prefill-bootstrap": _prefill_bootstrap,
    "prefill-waiting-for-input": _prefill_waiting_for_input,
    "prefill-inflight/decode-transfer": _prefill_inflight,
    "decode-prealloc": _decode_prealloc,
    "decode-registering": _decode_registering,
}


@pytest.mark.parametrize("abort_side", ["p", "d"])
@pytest.mark.parametrize("state", list(STATES))
def test_client_abort_in_every_state(pair, state, abort_side):
    ps, pc, ds, dc = STATES[state](pair)
    aborted_seq = ps if abort_side == "p" else ds
    (pair.p if abort_side == "p" else pair.d).abort(aborted_seq.rid, reason="client went away")
    spent = pair.run_until(lambda: pc.ends and dc.ends, dt=0.05, limit=10.0)
    aborted, other = (pc, dc) if abort_side == "p" else (dc, pc)
    assert_error(aborted, 503, "client went away")
    if abort_side == "p":
        assert_error(other, 502, "prefill failed this request")
        assert pair.moved("p", "num_aborted_reqs") == 1 and pair.moved("d", "num_transfer_failed_reqs") == 1
    else:
        assert_error(other, 503, "aborted by decode")
        assert pair.moved("d", "num_aborted_reqs") == 1 and pair.moved("p", "num_aborted_reqs") == 1
    # The other side heard at once (not at a deadline), and each side was told at most once.
    assert spent < 2.5, spent
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == (abort_side == "p")
    assert pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == (abort_side == "d")
    pair.run_until(lambda: pair.p.pd.registrations.empty(), dt=0.5)
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == (abort_side == "p")
    pair.assert_clean("p", "d")


def test_decode_abort_before_the_request_reaches_prefill(pair):
    ds, dc = pair.request("d")
    pair.step(sides="d")
    pair.d.abort(ds.rid, reason="client went away")
    pair.step(3, sides="d")
    assert_error(dc, 503)
    pair.step(sides="p")  # the abort lands on prefill before its request does
    ps, pc = pair.request("p", room=ds.pd.room)
    pair.run_until(lambda: pc.ends, sides="p")
    assert_error(pc, 503, "aborted by decode")
    assert pair.fabric.aborts_to(DECODE_URL, ds.pd.room) == 0
    pair.assert_clean("p", "d")


# ---- the seam objects themselves -----------------------------------------------------------------


def test_fake_fabric_moves_every_region_and_obeys_commands():
    fabric = FakeFabric()
    g = torch.Generator().manual_seed(1)
    src_states = {"latent": torch.randn(8, 2, 4, 3, generator=g), "ring": torch.randn(8, 3, 2, generator=g).bfloat16()}
    dst_states = {k: torch.zeros_like(v) for k, v in src_states.items()}
    a, b = fabric.transport("a", src_states), fabric.transport("b", dst_states)
    assert isinstance(a, KVTransport) and isinstance(FaultyTransport(a, FaultInjector()), KVTransport)
    assert a.add_peer(b.descriptor()) == "b"
    h = a.write_pages("b", [1, 5], [7, 0], b"n1")
    assert a.poll(h).value == "done" and b.poll_notifs() == [("a", b"n1")]
    for k in src_states:
        assert torch.equal(dst_states[k][[7, 0]], src_states[k][[1, 5]])
    assert a.info(h).nbytes == 2 * sum(v[0].numel() * v.element_size() for v in src_states.values())
    a.drop_next_notification()
    assert a.poll(a.write_pages("b", [2], [2], b"n2")).value == "done" and b.poll_notifs() == []
    a.fail_next("boom")
    h = a.write_pages("b", [2], [2], b"n3")
    assert a.poll(h).value == "failed" and a.error(h) == "boom"
    a.stall_next()
    h = a.write_pages("b", [3], [3], b"n4")
    assert a.poll(h).value == "pending"
    fabric.die("b")
    assert a.poll(h).value == "failed" and "remote disconnect" in a.error(h)
    assert a.poll(a.write_pages("b", [3], [3], b"n5")).value == "failed" and b.poll_notifs() == []
    with pytest.raises(ValueError):
        a.write_pages("b", [9], [0], b"x")  # outside the pool, before anything starts
    c = fabric.transport("c", {"latent": torch.zeros(8, 2, 4, 3)})
    with pytest.raises(ValueError, match="incompatible KV layout"):
        a.add_peer(c.descriptor())


def test_fake_fabric_moves_slot_rows_with_the_pages():
    """The contract for pools with slot regions: one row of each slot region moves with the
    pages, named on both sides; a pool with slots refuses a write without them."""
    fabric = FakeFabric()
    g = torch.Generator().manual_seed(2)
    src = PoolStates(
        {"csa": torch.randn(6, 2, 3, generator=g)},
        {"ring": torch.randn(4, 5, 2, generator=g), "stage": torch.randn(4, 3, generator=g).bfloat16()},
        page_size=8,
        tokens_per_entry={"csa": 4},
    )
    dst = PoolStates(
        {"csa": torch.zeros(9, 2, 3)},
        {"ring": torch.zeros(2, 5, 2), "stage": torch.zeros(2, 3).bfloat16()},
        page_size=8,
        tokens_per_entry={"csa": 4},
    )
    a, b = fabric.transport("a", src), fabric.transport("b", dst)
    a.add_peer(b.descriptor())
    h = a.write_pages("b", [5, 0], [8, 1], b"n", src_slot=3, dst_slot=1)
    assert a.poll(h).value == "done" and b.poll_notifs() == [("a", b"n")]
    assert torch.equal(dst.pages["csa"][[8, 1]], src.pages["csa"][[5, 0]])
    for name in ("ring", "stage"):
        assert torch.equal(dst.slots[name][1], src.slots[name][3]) and not dst.slots[name][0].any()
    assert a.info(h).nbytes_by_state == {"csa": 2 * 24, "ring": 40, "stage": 6}
    for bad in ({}, {"src_slot": 3, "dst_slot": 2}, {"src_slot": 4, "dst_slot": 0}):
        with pytest.raises(ValueError):
            a.write_pages("b", [0], [0], b"", **bad)
    # another compress rate, page size or slot shape is refused before anything moves
    for other in (
        PoolStates(dst.pages, dst.slots, 8, {"csa": 8}),
        PoolStates(dst.pages, dst.slots, 16, {"csa": 4}),
        PoolStates(dst.pages, {**dst.slots, "ring": torch.zeros(2, 6, 2)}, 8, {"csa": 4}),
    ):
        with pytest.raises(ValueError, match="incompatible KV layout"):
            a.add_peer(fabric.transport("c", other).descriptor())


def test_corrupt_transfer_flips_one_sent_byte_and_puts_it_back():
    fabric = FakeFabric()
    src = PoolStates({"kv": torch.ones(4, 8)}, {"ring": torch.ones(2, 6)})
    a = fabric.transport("a", src)
    b = fabric.transport("b", PoolStates({"kv": torch.zeros(4, 8)}, {"ring": torch.zeros(2, 6)}))
    faults = FaultInjector()
    t = FaultyTransport(a, faults, states=src)
    t.add_peer(b.descriptor())
    for state, landed in (("ring", lambda: b._pool.slots["ring"][1]), (None, lambda: b._pool.pages["kv"][2])):
        faults.arm("corrupt_transfer", 1, **({"state": state} if state else {}))
        h = t.write_pages("b", [3], [2], b"x", src_slot=0, dst_slot=1)
        assert not torch.equal(landed(), torch.ones_like(landed()))  # one byte differs in what landed
        assert t.poll(h).value == "done"
        assert torch.equal(src.pages["kv"], torch.ones(4, 8)) and torch.equal(src.slots["ring"], torch.ones(2, 6))
        t.release(h)
    faults.arm("corrupt_transfer", 1, state="nope")
    with pytest.raises(ValueError, match="not sent by this transfer"):
        t.write_pages("b", [3], [2], b"x", src_slot=0, dst_slot=1)


def test_faulty_transport_consumes_each_armed_fault_once():
    fabric = FakeFabric()
    a = fabric.transport("a", {"kv": torch.ones(4, 2)})
    b = fabric.transport("b", {"kv": torch.zeros(4, 2)})
    faults, exits = FaultInjector(), []
    t = FaultyTransport(a, faults, exits.append)
    t.add_peer(b.descriptor())
    faults.arm("fail_transfer", 1)
    h = t.write_pages("b", [0], [0], b"x")
    assert t.poll(h).value == "failed" and "injected fault fail_transfer" in t.error(h)
    assert t.poll(t.write_pages("b", [0], [0], b"y")).value == "done" and b.poll_notifs() == [("a", b"y")]
    faults.arm("stall_transfer", 2)
    for _ in range(2):
        assert t.poll(t.write_pages("b", [1], [1], b"s")).value == "pending"
    assert not faults.active("stall_transfer")
    faults.arm("crash", 1)
    t.write_pages("b", [2], [2], b"c")
    assert exits == [17]
    with pytest.raises(ValueError):
        faults.arm("no_such_fault", 1)


# ---- peer death in every state ---------------------------------------------------------------------

# state -> (side that dies, status the survivor's client hears, text, counter, aborts sent to the dead)
DEATHS = {
    "prefill-bootstrap": ("d", 502, "remote disconnect", "num_transfer_failed_reqs", 1),
    "prefill-waiting-for-input": ("d", 502, "remote disconnect", "num_transfer_failed_reqs", 1),
    "prefill-inflight/decode-transfer": ("d", 502, "remote disconnect", "num_transfer_failed_reqs", 1),
    # a failed registration is always told (best effort): decode cannot know whether it landed
    "decode-prealloc": ("p", 502, "cannot register with prefill", "num_bootstrap_failed_reqs", 1),
    "decode-registering": ("p", 502, "stopped answering", "num_transfer_failed_reqs", 1),
}


@pytest.mark.parametrize("state", list(DEATHS))
def test_peer_death_in_every_state(pair, state):
    ps, pc, ds, dc = STATES[state](pair)
    dies, status, text, counter, aborts = DEATHS[state]
    pair.kill(dies)
    survivor, client, seq = ("p", pc, ps) if dies == "d" else ("d", dc, ds)
    spent = pair.run_until(lambda: client.ends, sides=survivor, dt=0.1)
    assert spent <= HEARTBEAT_LIMIT + 1.5 and spent < SETTINGS.waiting_timeout
    assert_error(client, status, text)
    assert pair.moved(survivor, counter) == 1
    dead_addr = DECODE_URL if dies == "d" else BOOTSTRAP_ADDR
    assert pair.fabric.aborts_to(dead_addr, seq.pd.room) == aborts
    pair.assert_clean(survivor)


def test_layout_mismatch_is_refused_at_bootstrap_and_both_sides_hear_why(pair):
    odd = {name: torch.zeros(*t.shape[:-1], t.shape[-1] + 1) for name, t in pair.d.pool.states.items()}
    pair.d.pd.transport = pair.fabric.transport("decode-x", odd)  # a decode whose state has another shape
    ps, pc, ds, dc = pair.both()
    pair.run_until(lambda: pc.ends and dc.ends)
    assert_error(pc, 502, "incompatible KV layout")
    assert_error(dc, 502, "incompatible KV layout")
    assert pair.moved("p", "num_bootstrap_failed_reqs") == 1
    assert pair.fabric.aborts_to(DECODE_URL, ps.pd.room) == 1 and pair.fabric.aborts_to(BOOTSTRAP_ADDR, ps.pd.room) == 0
    pair.assert_clean("p", "d")
