"""The builtin engine spans every GPU of its pod: gpusPerPod becomes `dsv4 serve --tp-size`
(SGLang keeps its own flag of the same spelling)."""

from __future__ import annotations

from typing import Any

from dsv4_operator import manifests as M
from dsv4_operator.spec import parse_spec
from dsv4_wire import EngineFlags

OWNER = M.Owner(name="flash", namespace="serving", uid="2f1e3b4c-0000-4000-8000-000000000001")


def spec_of(**overrides: Any):
    raw: dict[str, Any] = {
        "model": {"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "engine": {"image": "reg/dsv4:1"},
    }
    raw.update(overrides)
    return parse_spec(raw)


def command(spec, role: str) -> list[str]:
    (c,) = M.engine_statefulset(spec, OWNER, role)["spec"]["template"]["spec"]["containers"]
    return c["command"]


def tp(cmd: list[str]) -> str | None:
    return cmd[cmd.index(EngineFlags.TP_SIZE) + 1] if EngineFlags.TP_SIZE in cmd else None


def test_builtin_engine_gets_tp_size_from_gpus_per_pod():
    spec = spec_of(prefill={"gpusPerPod": 4}, decode={"gpusPerPod": 2})
    assert command(spec, "prefill")[:2] == ["dsv4", "serve"]
    assert tp(command(spec, "prefill")) == "4" and tp(command(spec, "decode")) == "2"
    # The pod asks for as many GPUs as the engine spans ranks.
    (c,) = M.engine_statefulset(spec, OWNER, "prefill")["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] in (4, "4")


def test_one_gpu_or_none_runs_one_rank():
    spec = spec_of(prefill={"gpusPerPod": 1}, decode={"gpusPerPod": 0})
    assert tp(command(spec, "prefill")) is None and tp(command(spec, "decode")) is None


def test_a_user_argument_still_wins_over_the_mapping():
    spec = spec_of(engine={"image": "reg/dsv4:1", "args": [EngineFlags.TP_SIZE, "1"]}, prefill={"gpusPerPod": 4})
    cmd = command(spec, "prefill")
    assert cmd[len(cmd) - 1 - cmd[::-1].index(EngineFlags.TP_SIZE) + 1] == "1"  # the last one is the user's


def test_sglang_keeps_its_own_flag():
    spec = spec_of(engine={"kind": "sglang", "image": "lmsysorg/sglang:v1"}, prefill={"gpusPerPod": 4})
    cmd = command(spec, "prefill")
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"] and tp(cmd) == "4"
