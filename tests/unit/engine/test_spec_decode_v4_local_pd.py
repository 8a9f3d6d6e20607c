"""MTP speculation on a decode that serves later rounds from its own cache (`--decode-local-prefill`,
v4-tiny with an MTP block, over the in-process fabric): three multi-round conversations equal an
engine with neither speculation nor cache, decode drafts in the rounds it serves itself, and
everything comes back (the MTP block's ring is part of the snapshots decode keeps)."""

from __future__ import annotations

import pytest

from test_spec_decode_pd import all_back, make, models, pair  # noqa: F401 (fixture)
from test_spec_decode_v4_prefix_pd import conversations, mono_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_speculating_decode_serves_later_rounds_itself_and_equals_mono(models):
    model = models["v4"]
    want, _ = conversations((mono_engine(model, False),))
    engines = (make(model, "prefill", True), make(model, "decode", True, decode_local_prefill=64))
    p, d = pair(model, True, True, engines)
    got, _ = conversations((p, d))
    assert got == want
    assert d.metrics.totals["num_decode_local_reqs"] == 6  # rounds 2 and 3 of three conversations
    assert d.metrics.totals["spec_decode_num_draft_tokens"] > 0
    all_back(p, d)
    d.prefix_cache.check()
