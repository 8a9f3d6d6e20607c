"""The faults /admin/faults knows and the `--arm-fault` syntax: torch-free, so the HTTP process
checks `dsv4 serve --arm-fault` before the core starts (dsv4_engine.pd.faults applies them)."""

from __future__ import annotations

from typing import Any

FAULTS = (
    "stall_transfer",
    "fail_transfer",
    "drop_notification",
    "delay_bootstrap",
    "crash",
    "disable_deadlines",
    "corrupt_transfer",
    "stall_long_context",
)
STALL_DEFAULT_TOKENS = 1024  # stall_long_context's threshold when `tokens` is not given


def parse_arm_fault(text: str) -> tuple[str, int, dict[str, Any]]:
    """`--arm-fault` value `NAME[:key=value,...]` -> (name, count, params). Numbers are numbers;
    `count` defaults to -1 (armed until cleared). Raises ValueError naming what is wrong."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in FAULTS:
        raise ValueError(f"--arm-fault: unknown fault {name!r}; known: {', '.join(FAULTS)}")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--arm-fault {text!r}: {item!r} is not key=value")
        try:
            params[key] = int(value)
        except ValueError:
            try:
                params[key] = float(value)
            except ValueError:
                params[key] = value
    count = params.pop("count", -1)
    if not isinstance(count, int) or count == 0 or count < -1:
        raise ValueError(f"--arm-fault {text!r}: count must be a positive number or -1")
    return name, count, params
