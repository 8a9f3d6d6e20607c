"""The serving benches never measure a run on prompts a server has already seen: each workload,
each repeat and the warm-up draw their own, while every side of one run gets the same."""

from bench.harness import http_side  # noqa: E402


def _prefixes(prompts):
    return {tuple(p[:16]) for p in prompts}


def test_every_run_and_the_warm_up_have_prompts_of_their_own():
    ws = http_side.build_workloads([1, 8, 32], 2, 128, 64, 512, 0, rounds=3, conversations=4, append_len=32)
    seen: set = set()
    for w in ws:
        for r in (-1, 0, 1, 2):
            wr = http_side.for_run(w, r)
            ps = wr["prompts"] if w["kind"] == "fixed" else wr["first"]
            assert len(ps) == len(w["prompts"] if w["kind"] == "fixed" else w["first"])
            assert all(len(p) == 128 for p in ps)
            assert not (_prefixes(ps) & seen), (w["name"], r)  # no prompt starts like an earlier one
            seen |= _prefixes(ps)
    # the same run gives every side the same prompts, and run 0 is the workload as built (HF's batch)
    assert http_side.for_run(ws[1], 2) == http_side.for_run(ws[1], 2)
    assert http_side.for_run(ws[1], 0) is ws[1]
    assert "fresh" not in http_side.describe(ws[1])
