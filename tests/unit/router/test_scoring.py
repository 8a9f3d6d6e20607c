"""The cache-aware placement rule on its own: uncached tokens by tier against load, stale
claims ignored, the session's last worker and rendezvous hashing as tie-breaks."""

from __future__ import annotations

import pytest

from dsv4_router.scoring import Candidate, Match, TierCosts, choose, uncached_tokens

P = 64


def test_uncached_tokens_charge_tiers_and_always_compute_the_last_token():
    costs = TierCosts(host=0.1, disk=0.5)
    assert uncached_tokens(1000, P, Match()) == 1000
    assert uncached_tokens(1000, P, Match(device=10)) == 1000 - 640
    assert uncached_tokens(1000, P, Match(device=5, host=5), costs) == pytest.approx(1000 - 640 + 5 * P * 0.1)
    assert uncached_tokens(1000, P, Match(disk=10), costs) == pytest.approx(1000 - 640 + 10 * P * 0.5)
    # a prompt wholly held still computes its last token; the page holding it is not charged twice
    assert uncached_tokens(640, P, Match(device=10)) == 1
    assert uncached_tokens(640, P, Match(host=10), costs) == pytest.approx(1 + (639 / P) * P * 0.1)
    assert uncached_tokens(0, P, Match(device=3)) == 0


def test_the_holder_wins_unless_its_load_outweighs_the_tokens_it_saves():
    cands = [Candidate("a", 50_000, Match(device=100)), Candidate("b", 10_000)]
    # 6,400 tokens saved vs 40,000 tokens of load at weight 1/32 (1,250): the holder
    assert choose(8000, P, cands, key="s") == "a"
    # at weight 1 the load difference is worth more than the saved prefill
    assert choose(8000, P, cands, key="s", load_weight=1.0) == "b"
    # far busier: 400,000 tokens more load (12,500 at 1/32) outweighs 6,400 saved
    assert choose(8000, P, [Candidate("a", 410_000, Match(device=100)), Candidate("b", 10_000)], key="s") == "b"


def test_a_better_tier_wins_a_tie_of_length():
    cands = [Candidate("a", 0, Match(disk=50)), Candidate("b", 0, Match(host=50)), Candidate("c", 0, Match(device=50))]
    assert choose(4000, P, cands, key="k") == "c"
    assert choose(4000, P, cands[:2], key="k") == "b"


def test_stale_claims_count_for_nothing():
    cands = [Candidate("a", 10_000, Match(device=60), fresh=False), Candidate("b", 0)]
    assert choose(4000, P, cands, key="k") == "b"


def test_ties_go_to_the_sessions_last_worker_then_to_rendezvous_order():
    cands = [Candidate(u, 100) for u in ("a", "b", "c", "d")]
    assert choose(500, P, cands, key="k", last="c") == "c"
    # within a page's worth of cost counts as a tie
    cands2 = [Candidate("a", 0), Candidate("b", 40 * 32)]  # b: 40 tokens of cost more
    assert choose(500, P, cands2, key="k", last="b") == "b"
    # no last worker: every replica picks the same one for a key, and keys spread
    picks = {choose(500, P, cands, key=f"s{i}") for i in range(40)}
    assert picks == {"a", "b", "c", "d"}
    assert choose(500, P, cands, key="s7") == choose(500, P, list(reversed(cands)), key="s7")


def test_no_candidate_is_an_error():
    with pytest.raises(ValueError):
        choose(10, P, [], key="k")
