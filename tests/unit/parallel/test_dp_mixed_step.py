"""The mixed step under data-parallel attention (`--tp-size 4 --dp-size 4`, ranks 1-3 real child
processes, gloo on 127.0.0.1): steps where one rank prefills (a long prompt in 16-token chunks),
another decodes and the others idle, every rank still entering every MoE layer's collectives;
one request aborted mid-prefill, another mid-decode. It never hangs (the run is
bounded by a deadline: a rank that skipped a collective would block the others forever), every
page comes back, and the greedy tokens of the requests that ran to the end equal `--tp-size 1`."""

from __future__ import annotations

import pytest

from dsv4_engine.parallel import dp_attention

from test_dp_engine import bounded, drive, engine, one_thread, prompts  # noqa: F401  (one_thread: autouse)


def mixed(e) -> dict:
    """d: short, alone at first (rank 0: prefill, then decode); p and x: long prompts that arrive
    while d decodes (chunked prefills on their own ranks beside d's decode); p is aborted mid-
    prefill (holding pages), d mid-decode; e arrives after the aborts."""
    v = e.cfg.vocab_size
    d, p, x, late = prompts(v, [5, 50, 40, 9], seed=3)
    arrivals = {0: [("d", d)], 1: [("p", p)], 2: [("x", x)], 6: [("e", late)]}
    return drive(e, arrivals, aborts={3: ["p"], 5: ["d"]})


def kind(share) -> str:
    if share is None:
        return "idle"
    return "decode" if all(n == 1 for n in share.extend_lens.tolist()) else "prefill"


@pytest.mark.slow  # four ranks (three spawned processes) on 2 cores: ~20 s
def test_dp4_prefill_decode_and_idle_ranks_in_one_step_with_aborts_never_hang(make_model, monkeypatch):
    model = make_model("tiny")
    ref = mixed(engine(model, 1, kv_pages=40))
    steps: list[list[str]] = []
    split = dp_attention.split_batch

    def recorded(*a, **kw):  # the real split; what each rank runs this step, kept
        shares = split(*a, **kw)
        steps.append([kind(s) for s in shares])
        return shares

    monkeypatch.setattr(dp_attention, "split_batch", recorded)
    e = engine(model, 4, 4, kv_pages=10)
    try:
        got = bounded(lambda: mixed(e))
    finally:
        e.tp.close()
    mixed_steps = [s for s in steps if {"prefill", "decode", "idle"} <= set(s)]
    assert mixed_steps, f"no step had a prefilling, a decoding and an idle rank at once: {steps}"
    assert got["reasons"]["p"] == got["reasons"]["d"] == "abort"
    assert 0 < len(got["tokens"].get("d", [])) < 8 and not got["tokens"].get("p"), got["tokens"]
    finished = {rid for rid, why in ref["reasons"].items() if why != "abort"}
    assert finished == {"x", "e"} and {rid for rid, why in got["reasons"].items() if why != "abort"} == finished
    assert {r: got["tokens"][r] for r in finished} == {r: ref["tokens"][r] for r in finished}
    assert all(p.poll() == 0 for p in e.tp.procs), "the other ranks stop cleanly when told"
    print(f"{len(mixed_steps)} of {len(steps)} steps mixed prefill, decode and idle ranks: {steps}")
