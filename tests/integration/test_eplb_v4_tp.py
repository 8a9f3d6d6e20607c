"""EPLB on DeepSeek-V4 in a real `dsv4 serve --tp-size 2` (gloo on 127.0.0.1), preset v4-moe32
(32 routed experts: one hash-routed layer, three learned): loads recorded at --tp-size 1 place one
redundant expert per rank (every rank reads the experts it newly hosts from the checkpoint's V4
release names), the greedy text equals --tp-size 1's, a rebalance from the live loads lands
between steps while requests run (none fails, none changes), and the per-layer counters say which
layer is hash-routed."""

from __future__ import annotations

import json

import httpx
import pytest
from test_eplb_tp import ARGS, all_texts

from bench.harness.commands import serving

pytestmark = pytest.mark.slow


def test_v4_replicas_at_tp2_keep_the_greedy_text_and_a_live_rebalance_drops_nothing(make_model, tmp_path):
    model = make_model("v4-moe32")
    with serving(["--model", model, *ARGS], tmp_path / "tp1.log") as url:
        ref = all_texts(url)
        recorded = httpx.get(f"{url}/admin/expert_loads").json()
    assert {k: row["routing"] for k, row in recorded["layers"].items()} == {
        "0": "hash",
        "1": "learned",
        "2": "learned",
        "3": "learned",
    }
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps(recorded))
    flags = ["--tp-size", 2, "--ep-redundant-experts", 2, "--ep-loads-file", loads]
    with serving(["--model", model, *ARGS, *flags], tmp_path / "tp2.log") as url:
        assert all_texts(url) == ref
        table = httpx.get(f"{url}/admin/expert_loads").json()
        placement = table["placement"]
        assert placement["redundant"] == 2 and placement["ranks"] == 2
        assert sorted(placement["layers"]) == ["0", "1", "2", "3"]
        for slots in placement["layers"].values():
            assert len(slots) == 34 and sorted(set(slots)) == list(range(32))
        answers: dict = {}

        def rebalance() -> None:
            answers["r"] = httpx.post(f"{url}/admin/eplb/rebalance", timeout=300)

        assert all_texts(url, during=rebalance) == ref
        assert answers["r"].status_code == 200, answers["r"].text
        assert all_texts(url) == ref  # after it, every rank on the new placement
        metrics = httpx.get(f"{url}/metrics").text
        assert 'dsv4:moe_rank_load_imbalance{layer="0"' in metrics  # the hash-routed layer too
        summary = httpx.get(f"{url}/v1/loads").json()["expert_loads"]
        assert summary["redundant_experts"] == 2 and summary["layers"]["0"]["routing"] == "hash"
