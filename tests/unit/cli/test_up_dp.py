"""`dsv4 up --dp-size N`: the layout every engine gets, and what the engines would refuse is refused
before any process starts, in one line naming the role and the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_cli.main import _serve_params
from dsv4_cli.up_parallel import dp_up_refusal as _refusal, parallel_flags, parallel_sizes, serve_argv


def dp_up_refusal(model, roles, engine_args, tp, dp):
    return _refusal(roles, _serve_params(serve_argv(model, engine_args, tp, dp)))


def test_dp_size_implies_its_tp_size_and_a_different_one_is_refused():
    assert parallel_sizes(1, 1) == (1, 1)
    assert parallel_sizes(4, 1) == (4, 1)  # plain TP stays as it was
    assert parallel_sizes(1, 2) == (2, 2)  # --dp-size N alone: --tp-size N
    assert parallel_sizes(4, 4) == (4, 4)
    with pytest.raises(ValueError, match="--dp-size 2 needs --tp-size 2"):
        parallel_sizes(4, 2)


def test_the_engine_flags_of_each_layout():
    assert parallel_flags(1, 1) == []
    assert parallel_flags(2, 1) == ["--tp-size", "2"]
    assert parallel_flags(2, 2) == ["--tp-size", "2", "--dp-size", "2"]


# Extra engine arguments (as `dsv4 up --engine-arg` gives them, both forms) and the same as EngineArgs.
EXTRAS = [
    ([], {}),
    (["--speculative-algorithm", "mtp"], {"speculative_algorithm": "mtp"}),
    (["--kv-cache-dtype=fp8_e4m3"], {"kv_cache_dtype": "fp8_e4m3"}),
    (["--host-cache-gb", "1"], {"host_cache_gb": 1.0}),
    (["--nnodes", "2"], {"nnodes": 2}),  # what `dsv4 up --nnodes 2` hands on
]


def test_the_engines_own_refusal_is_given_per_role_with_the_extra_engine_args(make_model):
    """Whatever the engine refuses at --dp-size today (other parts lift its lines as they build
    them), `dsv4 up` refuses the same, naming the first role; nothing else."""
    from dsv4_engine.engine import dp_refusal_for
    from dsv4_engine.engine_args import EngineArgs

    tiny = make_model("tiny")
    assert dp_up_refusal(tiny, ["mono"], ["--speculative-algorithm", "mtp"], 1, 1) is None  # no DP, no check
    cases = [(tiny, ["mono"], *e) for e in EXTRAS]
    cases += [(make_model("v4-tiny"), ["mono"], [], {}), (tiny, ["prefill", "decode"], [], {})]
    refused = 0
    for model, roles, extra, fields in cases:
        engine_line = dp_refusal_for(EngineArgs(model=str(model), role=roles[0], tp_size=2, dp_size=2, **fields))
        up_line = dp_up_refusal(model, roles, extra, 2, 2)
        assert up_line == (None if engine_line is None else f"{roles[0]} engines: {engine_line}"), extra
        refused += engine_line is not None
    print(f"{refused} of {len(cases)} layouts refused by the engine today")


@pytest.mark.slow  # a CLI process (~1 s); the rule itself is the default run's test above
def test_dsv4_up_refuses_a_dp_layout_in_one_line_before_starting_anything(tiny_model):
    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "up", "--model", str(tiny_model), "--mono", "--dp-size", "2"]
        + ["--tp-size", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --dp-size 2 needs --tp-size 2 (each rank is one attention replica); leave --tp-size out or give 2"
    ], r.stderr
