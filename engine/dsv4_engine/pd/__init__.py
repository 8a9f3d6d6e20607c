"""Prefill/decode disaggregation inside the engine: role controllers that plug into the engine
loop (`role.RoleController`), their per-request state with deadlines, and the seams they work
over: the KV transport (`transport`, NIXL in production, `fake` in tests), the control channel
to the peer (`channel`, HTTP in production) and fault injection at both (`faults`). The HTTP
endpoints PD needs live in `dsv4_serve.pd_routes`."""

from __future__ import annotations

from dsv4_engine.pd.admission import bootstrap_target
from dsv4_engine.pd.request_info import PDRequestInfo

# The rest pulls in the transport (torch): loaded on first use, so that the HTTP process, which
# only checks a PD request's bootstrap fields, stays torch-free.
_LAZY = {
    "BOOT_ID": "dsv4_engine.pd.common",
    "PDSettings": "dsv4_engine.pd.common",
    "FaultInjector": "dsv4_engine.pd.faults",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attach_role(engine, args) -> None:
    """Give a prefill or decode engine its controller, wired to NIXL, HTTP and fault injection."""
    from dsv4_engine.pd.channel import HttpChannel
    from dsv4_engine.pd.common import BOOT_ID, PDSettings
    from dsv4_engine.pd.faults import Deadlines, FaultInjector, FaultyChannel, FaultyTransport
    from dsv4_engine.pd.fault_names import parse_arm_fault
    from dsv4_engine.pd.nixl.agent import KVTransferAgent
    from dsv4_engine.pd.transport import PoolStates
    from dsv4_wire import authorization_header

    if args.role == "prefill":
        from dsv4_engine.pd.prefill import PrefillController as Controller
    elif args.role == "decode":
        from dsv4_engine.pd.decode import DecodeController as Controller
    else:
        raise ValueError(f"no PD controller for role {args.role!r}")
    faults = FaultInjector()
    for text in getattr(args, "arm_faults", None) or []:  # --arm-fault: armed before any request
        name, count, params = parse_arm_fault(text)
        faults.arm(name, count, **params)
    # No transport-level timeout: the controllers' deadlines decide (and can be turned off).
    states = PoolStates.of_pool(engine.pool)  # paged regions and slot rows alike
    agent = KVTransferAgent(f"{args.role}-{BOOT_ID}", states, default_timeout_s=None)
    channel = HttpChannel(engine.call, headers=authorization_header(getattr(args, "pd_secret", None)))
    # Several ranks: each rank's pool gets its own agent. A TP decode names them in every
    # registration (pd.rank_pools); at --dp-size N a decode names the one its request lands in and a
    # prefill has the rank holding a request's pages write them (pd.dp_handoff, pd.dp_sender).
    data_parallel = engine.tp is not None and args.dp_size > 1
    decode_tp = engine.tp is not None and args.role == "decode"
    descs = engine.tp.gather_rank_pools(agent.descriptor()) if decode_tp or data_parallel else []
    transport = agent
    if data_parallel and args.role == "prefill":
        from dsv4_engine.pd.dp_sender import DPSendTransport

        transport = DPSendTransport(agent, descs[1:], engine.pool.allocator.pages_per_rank)
    engine.pd = Controller(
        engine,
        PDSettings.from_args(args),
        # corrupt_transfer flips a byte of rank 0's pool: not of another rank's (refused at DP)
        FaultyTransport(transport, faults, states=None if data_parallel else states),
        FaultyChannel(channel, faults),
        deadlines=Deadlines(args.deadlines, faults),
        faults=faults,
    )
    if data_parallel and decode_tp:
        engine.pd.dp_descs = descs
    elif decode_tp:
        engine.pd.rank_descs = descs[1:]


__all__ = ["BOOT_ID", "FaultInjector", "PDRequestInfo", "PDSettings", "attach_role", "bootstrap_target"]
