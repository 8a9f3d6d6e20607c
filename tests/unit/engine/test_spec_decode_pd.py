"""PD with speculation (V3 and V4): prefill runs the MTP block over the prompt (its catch-up, as a
monolithic engine's first step does) and the block's state moves with the request like any other
state (V3: the paged `mtp_latent_kv`; V4: the slot row `mtp_swa_kv`); decode drafts from there.
Greedy output through a prefill/decode pair equals a monolithic engine's without speculation, token
for token, with every page and slot row back on both sides; a pair where only one side speculates
is refused (the layouts differ), never run with a missing MTP state."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.common import PDSettings
from dsv4_engine.pd.request_info import PDRequestInfo
from dsv4_engine.pd.decode import DecodeController
from dsv4_engine.pd.fake import FakeFabric
from dsv4_engine.pd.prefill import PrefillController
from dsv4_engine.pd.transport import PoolStates
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from test_spec_decode import _requests

BOOTSTRAP_ADDR = "http://127.0.0.1:9100"
DECODE_URL = "http://127.0.0.1:8200"
PAGES = 64


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    d = tmp_path_factory.mktemp("pdmtp")
    return {
        "v3": init_checkpoint(d / "tiny-mtp", preset="tiny", seed=0, mtp=True),
        "v4": init_checkpoint(d / "v4-tiny-mtp", preset="v4-tiny", seed=0, mtp=True),
    }


def make(model, role: str, spec: bool, **extra) -> Engine:
    if spec:
        extra.update(speculative_algorithm="mtp", speculative_num_steps=3)
    # a decode with no cache drafts past V4's boundaries like the cacheless mono these compare
    # drafts with (a decode serving rounds itself: test_spec_decode_v4_local_pd.py)
    extra.setdefault("decode_local_prefill", 0)
    return Engine(
        EngineArgs(
            model=str(model),
            role=role,
            device="cpu",
            kernel_backend="cpu",
            kv_pages=PAGES,
            page_size=8,
            served_model_name="m",
            max_num_seqs=8,
            **extra,
        )
    )


def run(engines: list[Engine], done, limit: int = 5000) -> None:
    for _ in range(limit):
        if done():
            return
        for e in engines:
            e.step() if (e.scheduler.has_work() or not e.inbox.empty() or (e.pd and e.pd.busy())) else (
                e.pd and e.pd.poll()
            )
    raise AssertionError("no progress")


def pair(model, p_spec: bool, d_spec: bool, engines: tuple = ()):
    p, d = engines or (make(model, "prefill", p_spec), make(model, "decode", d_spec))
    fabric = FakeFabric()
    settings = PDSettings(bootstrap_timeout=30, transfer_timeout=30, waiting_timeout=30, url=DECODE_URL)
    p.pd = PrefillController(
        p, settings, fabric.transport("prefill-x", PoolStates.of_pool(p.pool)), fabric.channel(p.call)
    )
    d.pd = DecodeController(
        d, settings, fabric.transport("decode-x", PoolStates.of_pool(d.pool)), fabric.channel(d.call)
    )
    fabric.serve(BOOTSTRAP_ADDR, p.pd, "prefill")
    fabric.serve(DECODE_URL, d.pd, "decode")
    return p, d


def through_pd(p: Engine, d: Engine, reqs) -> dict:
    """All requests at once (concurrent on both sides): rid -> (tokens, finish reason, error)."""
    got: dict = {}
    ends: dict = {}
    for room, (prompt, params) in enumerate(reqs, start=1):
        for side, eng in (("p", p), ("d", d)):

            def sink(o, side=side, room=room):
                if side == "d":
                    got.setdefault(f"r{room - 1}", []).extend(o.token_ids)
                if o.finished:
                    ends[(side, room)] = o

            s = Sequence(f"{side}{room}", list(prompt), params, sink=sink)
            s.pd = PDRequestInfo("127.0.0.1", 9100, room)
            s.prefill_only = side == "p"
            eng.submit(s)
    run([p, d], lambda: len(ends) == 2 * len(reqs))
    return {
        f"r{room - 1}": (got.get(f"r{room - 1}", []), ends[("d", room)].finish_reason, ends[("d", room)].error)
        for room in range(1, len(reqs) + 1)
    }


def mono(model, reqs, spec: bool = False, prep=None) -> tuple[dict, object]:
    # no prefix cache: with V4's, drafts stop at its boundaries; decode (no cache) drafts past them
    e = make(model, "mono", spec, enable_prefix_cache=False)
    seen = prep(e) if prep is not None else None
    out: dict = {}
    seqs = []

    def sink(o):
        toks, _, _ = out.get(o.rid, ([], None, None))
        out[o.rid] = (toks + list(o.token_ids), o.finish_reason, o.error)

    for i, (prompt, params) in enumerate(reqs):
        seqs.append(Sequence(f"r{i}", list(prompt), params, sink=sink))
        e.submit(seqs[-1])
    run([e], lambda: all(s.finished for s in seqs))
    return out, seen


def record_drafts(engine: Engine, rid_of) -> dict:
    """(request, tokens emitted so far) -> the drafts verified at that point."""
    seen: dict = {}
    spec, original = engine.spec, engine.spec.lookahead

    def lookahead(seq):
        n = original(seq)
        if n:
            seen[(rid_of(seq.rid), len(seq.output_ids))] = list(spec.drafts[seq].tokens[:n])
        return n

    spec.lookahead = engine.scheduler.lookahead = lookahead
    return seen


def all_back(*engines: Engine) -> None:
    for e in engines:
        assert e.pool.allocator.num_free == e.pool.num_pages, "pages not returned"
        if e.pool.slots is not None:
            assert e.pool.slots.num_free == e.pool.slots.total, "slot rows not returned"


@pytest.mark.parametrize("kind", ["v3", "v4"])
def test_pd_with_speculation_equals_mono(models, kind):
    model = models[kind]
    reqs = _requests(5, n=5) + [
        ([7] * 8 + list(range(30, 39)), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    ]
    want, _ = mono(model, reqs)
    same, drafts_mono = mono(model, reqs, spec=True, prep=lambda e: record_drafts(e, lambda rid: int(rid[1:])))
    assert same == want
    p, d = pair(model, True, True)
    drafts_pd = record_drafts(d, lambda rid: int(rid[1:]) - 1)
    got = through_pd(p, d, reqs)
    assert got == want
    assert d.metrics.totals["spec_decode_num_draft_tokens"] > 0  # decode drafted
    assert p.metrics.totals.get("spec_decode_num_draft_tokens", 0) == 0  # prefill never does
    # Decode drafts exactly what a monolithic speculating engine drafts at the same point of the
    # same request: the MTP block's state for the prompt arrived whole (test below: without it,
    # other drafts). Decode's first step has none: prefill ends at its first token and makes no
    # drafts (mono drafts right after it), so the points a request verifies at may differ later.
    common = set(drafts_pd) & set(drafts_mono)
    assert len(common) > 10 and all(drafts_pd[k] == drafts_mono[k] for k in common)
    assert not any(k[1] == 1 for k in drafts_pd)
    all_back(p, d)


def test_pd_where_only_one_side_speculates_fails_the_request_with_the_reason(models):
    p, d = pair(models["v3"], True, False)
    got = through_pd(p, d, [([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
    toks, reason, error = got["r0"]
    assert reason == "error" and not toks and "layout" in error, got
    all_back(p, d)


def test_decode_drafts_from_the_mtp_state_prefill_sent(models, monkeypatch):
    """The draft comparison above has teeth: a decode whose MTP state for the prompt is wiped on
    arrival drafts other tokens (outputs still equal: verification decides)."""
    model = models["v4"]
    reqs = _requests(5, n=3)
    _, drafts_mono = mono(model, reqs, spec=True, prep=lambda e: record_drafts(e, lambda rid: int(rid[1:])))
    p, d = pair(model, True, True)
    drafts_pd = record_drafts(d, lambda rid: int(rid[1:]) - 1)
    accept = d.accept_first_token

    def wiped(seq, tok, logprob=None):
        d.pool.slot_states["mtp_swa_kv"][seq.slot].normal_()
        accept(seq, tok, logprob)

    monkeypatch.setattr(d, "accept_first_token", wiped)
    through_pd(p, d, reqs)
    common = set(drafts_pd) & set(drafts_mono)
    assert common and any(drafts_pd[k] != drafts_mono[k] for k in common)


@pytest.mark.parametrize("kind", ["v3", "v4"])
def test_pd_decode_aborts_mid_speculation_return_everything(models, kind):
    """Decode requests aborted with drafts in flight: their pages and slot rows come back on both
    sides, and the others still equal mono."""
    model = models[kind]
    reqs = _requests(6, n=4)
    for _, p in reqs:
        p.max_tokens = 20
    want, _ = mono(model, reqs)
    p, d = pair(model, True, True)
    ends: dict = {}
    got: dict = {}
    for room, (prompt, params) in enumerate(reqs, start=1):
        for side, eng in (("p", p), ("d", d)):

            def sink(o, side=side, room=room):
                if side == "d":
                    got.setdefault(room - 1, []).extend(o.token_ids)
                    if room in (2, 4) and len(got[room - 1]) >= 4 and not o.finished:
                        d.abort(f"d{room}")
                if o.finished:
                    ends[(side, room)] = o

            s = Sequence(f"{side}{room}", list(prompt), params, sink=sink)
            s.pd = PDRequestInfo("127.0.0.1", 9100, room)
            s.prefill_only = side == "p"
            eng.submit(s)
    run([p, d], lambda: len(ends) == 2 * len(reqs))
    for room in range(1, len(reqs) + 1):
        toks, end = got[room - 1], ends[("d", room)]
        if room in (2, 4):
            assert end.finish_reason == "abort" and toks == want[f"r{room - 1}"][0][: len(toks)] and len(toks) < 20
        else:
            assert (toks, end.finish_reason) == tuple(want[f"r{room - 1}"][:2])
    all_back(p, d)


def nixl_pair(p: Engine, d: Engine) -> tuple[Engine, Engine]:
    """`pair` over real NIXL agents, as `dsv4 serve` wires them: decode's rank 1 (a child
    process) registers its own pool and relays its notifications to rank 0 (pd.rank_pools)."""
    from dsv4_engine.pd.nixl.agent import KVTransferAgent

    fabric = FakeFabric()  # the control channel only
    settings = PDSettings(bootstrap_timeout=30, transfer_timeout=30, waiting_timeout=30, url=DECODE_URL)
    pa = KVTransferAgent("prefill-mtp", PoolStates.of_pool(p.pool), default_timeout_s=None)
    da = KVTransferAgent("decode-mtp", PoolStates.of_pool(d.pool), default_timeout_s=None)
    p.pd = PrefillController(p, settings, pa, fabric.channel(p.call))
    d.pd = DecodeController(d, settings, da, fabric.channel(d.call))
    d.pd.rank_descs = d.tp.gather_rank_pools(da.descriptor())[1:]
    fabric.serve(BOOTSTRAP_ADDR, p.pd, "prefill")
    fabric.serve(DECODE_URL, d.pd, "decode")
    return p, d


def test_v4_pd_with_speculation_into_a_tp2_decode_equals_mono(models):
    """Decode at --tp-size 2 (its rank 1 a real child process; one TP group per process, so
    prefill has one rank here): prefill writes the request's state (the MTP ring's slot row
    included) into each decode rank's own pool over NIXL, then both ranks draft and verify. Greedy
    tokens equal mono, and decode drafts what a one-rank mono engine drafts at the same points
    (rank 1's MTP state arrived: its half of the block's experts computes on it)."""
    model = models["v4"]
    reqs = _requests(5, n=4)
    want, _ = mono(model, reqs)
    _, drafts_mono = mono(model, reqs, spec=True, prep=lambda e: record_drafts(e, lambda rid: int(rid[1:])))
    p, d = make(model, "prefill", True), make(model, "decode", True, tp_size=2)
    try:
        p, d = nixl_pair(p, d)
        drafts_pd = record_drafts(d, lambda rid: int(rid[1:]) - 1)
        assert through_pd(p, d, reqs) == want
        assert d.tp.failed is None and set(d.pd.bytes_by_rank) == {0, 1}
    finally:
        d.tp.close()
        for e in (p, d):
            if e.pd is not None:
                e.pd.transport.close()
    assert all(proc.poll() == 0 for proc in d.tp.procs)
    common = set(drafts_pd) & set(drafts_mono)
    assert len(common) > 5 and all(drafts_pd[k] == drafts_mono[k] for k in common)
    all_back(p, d)
