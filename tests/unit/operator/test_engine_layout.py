"""dpAttention and redundantExperts per role (issue 46): spec -> the engine's flags, pure. TP
stays gpusPerPod (x nodesPerReplica); dpAttention makes every one of those ranks an attention
replica (--dp-size equal to --tp-size); a layout that cannot run is reported, never half-built;
objects written before these fields keep their revision and their pods."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsv4_operator import manifests as M
from dsv4_operator.engine_layout import engine_ranks, layout_flags, layout_reasons
from dsv4_operator.spec import dump, parse_spec, spec_revision

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
BASE = {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "reg/dsv4:1"}}


def spec(engine=None, **roles):
    return parse_spec({**BASE, "engine": {**BASE["engine"], **(engine or {})}, **roles})


def flag(cmd: list[str], name: str):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_dp_attention_is_dp_size_equal_to_the_engines_tp_size():
    s = spec(decode={"dpAttention": True, "gpusPerPod": 8})
    cmd = M.engine_command(s, "decode")
    assert flag(cmd, "--tp-size") == flag(cmd, "--dp-size") == "8"
    prefill = M.engine_command(s, "prefill")  # the other role keeps tensor-parallel attention
    assert flag(prefill, "--tp-size") == "4" and "--dp-size" not in prefill
    assert M.unbuildable_reasons("flash", s) == []


def test_a_multi_node_replica_is_one_attention_replica_per_gpu_of_the_group():
    s = spec(prefill={"dpAttention": True, "gpusPerPod": 4, "nodesPerReplica": 2})
    cmd = M.engine_command(s, "prefill", node=("0", "leader"))
    assert flag(cmd, "--tp-size") == flag(cmd, "--dp-size") == "8" and flag(cmd, "--nnodes") == "2"


def test_redundant_experts_is_the_eplb_flag_and_combines_with_dp_attention():
    s = spec(decode={"dpAttention": True, "redundantExperts": 2})
    cmd = M.engine_command(s, "decode")
    assert flag(cmd, "--ep-redundant-experts") == "2" and flag(cmd, "--dp-size") == "4"
    assert "--ep-redundant-experts" not in M.engine_command(spec(decode={"redundantExperts": 0}), "decode")


def test_sglang_gets_its_own_dp_attention_switch_and_no_builtin_flag():
    s = spec(engine={"kind": "sglang"}, decode={"dpAttention": True})
    cmd = M.engine_command(s, "decode")
    assert "--enable-dp-attention" in cmd and flag(cmd, "--dp-size") == "4" == flag(cmd, "--tp-size")
    assert "--enable-dp-attention" not in M.engine_command(spec(decode={"dpAttention": True}), "decode")


def test_user_args_still_come_last():
    s = spec(decode={"dpAttention": True, "args": ["--dp-size", "2"]})
    cmd = M.engine_command(s, "decode")
    assert cmd[-2:] == ["--dp-size", "2"] and cmd.index("--dp-size") < len(cmd) - 2


@pytest.mark.parametrize(
    "role,expect",
    [
        ({"dpAttention": True, "gpusPerPod": 1}, "dpAttention needs 2 GPUs"),
        ({"dpAttention": True, "gpusPerPod": 0}, "dpAttention needs 2 GPUs"),
        ({"redundantExperts": 5, "gpusPerPod": 4}, "(5 > 4)"),
        ({"redundantExperts": 3, "gpusPerPod": 1, "nodesPerReplica": 2}, "(3 > 2)"),
    ],
)
def test_a_layout_the_replica_cannot_hold_is_reported_by_role(role, expect):
    (reason,) = layout_reasons(spec(decode=role))
    assert reason.startswith("decode: ") and expect in reason
    assert any(expect in r for r in M.unbuildable_reasons("flash", spec(decode=role)))


def test_sglang_with_redundant_experts_is_reported():
    (reason,) = layout_reasons(spec(engine={"kind": "sglang"}, prefill={"redundantExperts": 1}))
    assert reason.startswith("prefill: ") and "SGLang's EPLB flags" in reason


def test_engine_ranks_follow_the_tp_size_the_manifests_write():
    for gpus, nodes, ranks in ((0, 1, 1), (1, 1, 1), (4, 1, 4), (1, 2, 2), (4, 2, 8)):
        s = spec(decode={"gpusPerPod": gpus, "nodesPerReplica": nodes})
        cmd = M.engine_command(s, "decode", node=("0", "leader") if nodes > 1 else None)
        assert engine_ranks(s.decode) == ranks == int(flag(cmd, "--tp-size") or 1)
    assert layout_flags("builtin", spec().decode, 4) == []
    one_gpu = spec(decode={"dpAttention": True, "gpusPerPod": 1})  # reported (above), never rendered half-way
    assert layout_flags("builtin", one_gpu.decode, 1) == [] and "--dp-size" not in M.engine_command(one_gpu, "decode")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_older_examples_keep_their_revision_and_their_commands(path):
    """Absent stays absent: an object written before these fields hashes as before (no rolling
    of its pods on an operator upgrade) and its engines get no new flag."""
    cr = yaml.safe_load(path.read_text())
    s = parse_spec(cr["spec"])
    written = dump(s)
    for role in ("prefill", "decode"):
        assert "dpAttention" not in written[role] and "redundantExperts" not in written[role]
        cmd = M.engine_command(s, role)
        assert not {"--dp-size", "--ep-redundant-experts", "--enable-dp-attention"} & set(cmd)
    off = parse_spec({**cr["spec"], "decode": {**cr["spec"].get("decode", {}), "dpAttention": True}})
    assert spec_revision(off) != spec_revision(s)  # ... and the field, once set, is part of it
