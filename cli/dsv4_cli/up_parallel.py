"""`dsv4 up --dp-size N`: the engines' parallel layout, decided before any process starts.

One `--dp-size` (and one `--tp-size`) for every engine `dsv4 up` runs, as for `--tp-size` before
it: the local launcher runs every engine on the one machine, over the same GPUs, and each role's
KV capacity gains the same from data-parallel attention (a prefill holds the KV of its in-flight
hand-offs, a decode of its running requests). A layout per role is the CRD's (`dpAttention` per
role, where each role's pods are sized on their own). A flag combination the engine refuses at
`--dp-size > 1` is refused here, in the engine's own words, instead of in a restart loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from dsv4_wire import EngineFlags


def parallel_sizes(tp_size: int, dp_size: int) -> tuple[int, int]:
    """(tp, dp) every engine runs with. `--dp-size N` alone implies `--tp-size N` (each rank is
    one attention replica); a different explicit `--tp-size` is a ValueError."""
    if dp_size <= 1:
        return tp_size, 1
    if tp_size not in (1, dp_size):
        raise ValueError(
            f"--dp-size {dp_size} needs --tp-size {dp_size} (each rank is one attention replica); "
            f"leave --tp-size out or give {dp_size}"
        )
    return dp_size, dp_size


def parallel_flags(tp_size: int, dp_size: int) -> list[str]:
    """The engine flags of that layout (none at one rank)."""
    out = [EngineFlags.TP_SIZE, str(tp_size)] if tp_size > 1 else []
    return out + ([EngineFlags.DP_SIZE, str(dp_size)] if dp_size > 1 else [])


def engine_roles(mono: bool) -> list[str]:
    return ["mono"] if mono else ["prefill", "decode"]


def serve_argv(model: Path, engine_args: Sequence[str], tp: int, dp: int) -> list[str]:
    """The `dsv4 serve` arguments every engine of `dsv4 up` shares (the role aside)."""
    return [EngineFlags.MODEL, str(model), *engine_args, *parallel_flags(tp, dp)]


def dp_up_refusal(roles: Sequence[str], given: Mapping[str, Any]) -> Optional[str]:
    """The engine's own refusal of its --dp-size for the first role that has one; `given`: those
    arguments parsed as `dsv4 serve` parses them. None when every role can start."""
    if (given.get("dp_size") or 1) <= 1:
        return None
    from dsv4_cli.options import field_values
    from dsv4_engine.engine import dp_refusal_for
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_wire.serve_options import options as serve_options

    values = field_values(serve_options("engine"), given)
    for role in roles:
        line = dp_refusal_for(EngineArgs(**{**values, "role": role}))
        if line:
            return f"{role} engines: {line}"
    return None
