"""EPLB in a real `dsv4 serve --tp-size 2` (gloo on 127.0.0.1) on the moe32 preset: with one
redundant expert per rank the greedy text equals --tp-size 1's, a rebalance from the live loads
lands between steps while requests run (none fails, none changes), the expert load counters are
in /metrics and GET /admin/expert_loads, and flags or bodies that cannot be honoured are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.harness.commands import free_port, serving

pytestmark = pytest.mark.slow

ARGS = ["--kv-pages", 256, "--served-model-name", "m", "--device", "cpu"]
PROMPTS = ["yes no ok yes yes no", "ok ok no yes ok no ok", "the quick brown fox", "no no no yes ok ok yes"]


def complete(url: str, prompt: str) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def all_texts(url: str, during=None) -> list[str]:
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, url, p) for p in PROMPTS * 2]
        if during is not None:
            during()
        return [f.result() for f in futures]


def test_replicas_at_tp2_keep_the_greedy_text_and_a_live_rebalance_drops_nothing(make_model, tmp_path):
    model = make_model("moe32")
    with serving(["--model", model, *ARGS], tmp_path / "tp1.log") as url:
        ref = all_texts(url)
        recorded = httpx.get(f"{url}/admin/expert_loads").json()
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps(recorded))
    flags = ["--tp-size", 2, "--ep-redundant-experts", 2, "--ep-loads-file", loads]
    with serving(["--model", model, *ARGS, *flags], tmp_path / "tp2.log") as url:
        assert all_texts(url) == ref
        table = httpx.get(f"{url}/admin/expert_loads").json()
        placement = table["placement"]
        assert placement["redundant"] == 2 and placement["ranks"] == 2
        for slots in placement["layers"].values():
            assert len(slots) == 34 and sorted(set(slots)) == list(range(32))
        assert all(
            len(row["ranks"]) == 2 and sum(row["ranks"]) == sum(row["experts"]) for row in table["layers"].values()
        )
        answers: dict = {}

        def rebalance() -> None:
            answers["r"] = httpx.post(f"{url}/admin/eplb/rebalance", timeout=300)

        assert all_texts(url, during=rebalance) == ref
        assert answers["r"].status_code == 200, answers["r"].text
        assert answers["r"].json()["placement"]["redundant"] == 2
        assert all_texts(url) == ref  # after it, every rank on the new placement
        metrics = httpx.get(f"{url}/metrics").text
        assert 'dsv4:moe_rank_load_imbalance{layer="1"' in metrics
        assert "dsv4:moe_expert_tokens_total{" in metrics
        assert httpx.get(f"{url}/v1/loads").json()["expert_loads"]["redundant_experts"] == 2
        bad = httpx.post(f"{url}/admin/eplb/rebalance", content=b"[1, 2]", timeout=30)
        assert bad.status_code == 400 and "loads table" in bad.json()["error"]["message"]
        bad = httpx.post(f"{url}/admin/eplb/rebalance", json={"format": "other"}, timeout=30)
        assert bad.status_code == 400 and "format" in bad.json()["error"]["message"]


def test_more_than_one_redundant_expert_per_rank_is_refused_in_one_line(make_model):
    model = make_model("moe32")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(free_port()),
            "--tp-size",
            "2",
            "--ep-redundant-experts",
            "3",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "more than one redundant expert per rank" in p.stderr, p.stderr[-2000:]
