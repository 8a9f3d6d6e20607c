"""`dsv4 bench grammar --quick` runs both parts on the tiny model (grammar engines alone, then
the engine's decode steps with and without a grammar) and writes the JSON and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_grammar_bench_quick_writes_its_report(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "bench",
            "grammar",
            "--quick",
            "--concurrency",
            "1",
            "--concurrency",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "grammar.json").read_text())
    assert (tmp_path / "grammar.png").stat().st_size > 0
    assert [row["concurrency"] for row in report["engine"]] == [1, 2]
    for row in report["engine"]:
        assert row["grammar"]["grammar_ms_per_step"] > row["plain"]["grammar_ms_per_step"]  # plain: one any() per step
        assert row["grammar"]["still_running"] == row["concurrency"]  # every measured step was mid-grammar
    xg = report["backends"]["xgrammar"]
    assert xg["mask_steps"] > 100 and len(xg["compile_ms"]) == 3
