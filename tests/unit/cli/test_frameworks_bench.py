"""`dsv4 bench frameworks` without the frameworks: each is reported as skipped with the reason
(the interpreter given cannot import it), and a run is judged a success only when calls were
made and parsed with nothing malformed and no error. The real run is bench/results/frameworks/."""

from __future__ import annotations

import json
import sys

from bench.suites import frameworks_bench as fb


def test_a_framework_the_interpreter_lacks_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(fb, "FRAMEWORKS", {"agents-sdk": "no_such_module_agents", "langchain": "json"})
    assert fb.importable(sys.executable, "json") is None
    fb.main(["--python", sys.executable, "--out", str(tmp_path), "--frameworks", "agents-sdk"])
    report = json.loads((tmp_path / "frameworks.json").read_text())
    (run,) = report["runs"]
    assert run["framework"] == "agents-sdk" and "no_such_module_agents" in run["skipped"]
    assert sys.executable in run["skipped"]


def test_success_needs_parsed_calls_and_nothing_malformed():
    ok = {"rounds": 3, "calls": 2, "malformed": 0, "cut": 1, "errors": []}
    assert fb.verdict(ok)["success"]
    assert not fb.verdict({**ok, "malformed": 1})["success"]
    assert not fb.verdict({**ok, "calls": 0})["success"]
    assert not fb.verdict({**ok, "errors": ["boom"]})["success"]
    assert not fb.verdict({"framework": "x", "errors": ["timed out"]})["success"]
