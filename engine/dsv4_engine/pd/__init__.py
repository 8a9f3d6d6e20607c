"""Prefill/decode disaggregation inside the engine: role controllers that plug into the engine
loop, their per-request state with deadlines, and the transport seam they move KV over. The HTTP
endpoints PD needs live in `dsv4_serve.pd_routes`."""

from __future__ import annotations

from dsv4_engine.pd.common import BOOT_ID, FaultInjector


def attach_role(engine, args) -> None:
    """Give a prefill or decode engine its controller (and transport)."""
    engine.faults = FaultInjector()
    if args.role == "prefill":
        from dsv4_engine.pd.prefill import PrefillController

        engine.pd = PrefillController(engine, args, engine.faults)
    elif args.role == "decode":
        from dsv4_engine.pd.decode import DecodeController

        engine.pd = DecodeController(engine, args, engine.faults)
    else:
        raise ValueError(f"no PD controller for role {args.role!r}")


__all__ = ["BOOT_ID", "FaultInjector", "attach_role"]
