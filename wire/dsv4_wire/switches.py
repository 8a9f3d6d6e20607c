"""Every `DSV4_*` environment switch, declared once: its name, type, default and what it does.

Code reads a switch through `read(name)` (typed) or `on(name)` (a flag: set and not "0"), never
`os.environ` by a literal name; tests/unit/house/test_switches.py checks that every `DSV4_*` name
in the source is declared here and that none is read by its literal name elsewhere."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Switch:
    name: str
    type: type  # bool (a flag: set and not "0"), str, float or int
    default: Any
    help: str


def _s(name: str, type_: type, default: Any, help_: str) -> Switch:
    return Switch(name, type_, default, help_)


_NATIVE_OFF = "1: this native CPU kernel is not built or loaded; its op runs the torch reference"

SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        # kernels: the CPU backend's C kernels (dsv4_kernels.native)
        _s(
            "DSV4_NO_NATIVE",
            bool,
            False,
            "1: no native CPU kernel is built or loaded; the cpu backend runs the reference",
        ),
        _s("DSV4_NO_NATIVE_MLA", bool, False, _NATIVE_OFF + " (V3 decode attention)"),
        _s("DSV4_NO_NATIVE_ABSORB", bool, False, _NATIVE_OFF + " (V3 absorbed projections)"),
        _s("DSV4_NO_NATIVE_NORM", bool, False, _NATIVE_OFF + " (RMSNorm)"),
        _s("DSV4_NO_NATIVE_ROPE", bool, False, _NATIVE_OFF + " (rope)"),
        _s("DSV4_NO_NATIVE_ROUTE", bool, False, _NATIVE_OFF + " (V3 expert choice)"),
        _s("DSV4_NO_NATIVE_MOE", bool, False, _NATIVE_OFF + " (decode-size MoE and MLP)"),
        _s("DSV4_NO_NATIVE_LINEAR", bool, False, _NATIVE_OFF + " (decode-size dense projections)"),
        _s("DSV4_NO_NATIVE_GROUPED_MOE", bool, False, _NATIVE_OFF + " (prefill-size MoE helpers)"),
        _s("DSV4_NO_NATIVE_MHC", bool, False, _NATIVE_OFF + " (V4 hyper-connections)"),
        _s("DSV4_NO_NATIVE_V4_ATTN", bool, False, _NATIVE_OFF + " (V4 window attention, norm + rope)"),
        _s("DSV4_NO_NATIVE_V4_COMPRESS", bool, False, _NATIVE_OFF + " (V4 compressor pooling)"),
        _s(
            "DSV4_NATIVE_ISA",
            str,
            "",
            "the ISA level the native kernels are built for: x86-64-v4, x86-64-v3, x86-64-v2, x86-64, "
            "armv8-a, native (empty: the highest x86-64 level of v4, v3, v2 the CPU has; armv8-a on aarch64)",
        ),
        _s(
            "DSV4_NATIVE_DIR",
            str,
            "",
            "a folder of prebuilt native kernels (dsv4 kernels build); loaded when root- or self-owned "
            "and writable by no one else, before the per-user cache",
        ),
        _s(
            "DSV4_FP4_NATIVE",
            str,
            "1",
            "0: fp4 GEMMs keep the decode path (dequantize, then a bf16 GEMM) where tl.dot_scaled would run",
        ),
        _s("DSV4_NO_HUGE_PAGES", bool, False, "1: the KV pools are not advised onto transparent huge pages"),
        # engine
        _s(
            "DSV4_STEP_PHASES",
            str,
            "",
            "1: the engine times each phase of its decode / mixed steps (wall); cpu: the loop thread's CPU time",
        ),
        _s("DSV4_CORE_PROFILE", str, "", "a file the engine core writes a cProfile of its loop to, at exit"),
        _s("DSV4_TP_SPEC", str, "", "internal: a tensor-parallel worker's rank, world and engine arguments (JSON)"),
        _s("DSV4_TP_TIMEOUT_S", float, 300.0, "seconds a tensor-parallel group may take to form"),
        _s("DSV4_NODE_TIMEOUT_S", float, 30.0, "seconds a multi-node rank waits for its peers"),
        # wire: secrets and keys
        _s("DSV4_ADMIN_TOKEN", str, "", "the token the admin endpoints (/admin/*, /debug/*) require when set"),
        _s("DSV4_ADMIN_TOKEN_FILE", str, "", "a file holding DSV4_ADMIN_TOKEN"),
        _s("DSV4_PD_SECRET", str, "", "the secret prefill and decode engines and the router share (internal requests)"),
        _s("DSV4_PD_SECRET_FILE", str, "", "a file holding DSV4_PD_SECRET"),
        _s(
            "DSV4_ENGINE_API_KEY",
            str,
            "",
            "the key the router shows mono engines started with --api-key (its --engine-api-key)",
        ),
        # operator
        _s("DSV4_OPERATOR_KEY", str, "", "the operator's key (auth secrets it owns)"),
        _s("DSV4_OPERATOR_KEY_FILE", str, "", "a file holding DSV4_OPERATOR_KEY"),
        _s(
            "DSV4_RESTART_RATE_LIMIT",
            str,
            "",
            "COUNT/SECONDS: at most COUNT remediations start in any SECONDS, across every deployment",
        ),
        _s("DSV4_TENANT_POLICY", str, "", "the operator's tenant policy (what a DSV4Deployment may ask for)"),
        _s("DSV4_NODE_RANK", int, 0, "set on a multi-node group's pods: this pod's node rank"),
        _s("DSV4_LEADER_ADDRESS", str, "", "set on a multi-node group's pods: the leader's address"),
        # cli and local deployments
        _s("DSV4_CACHE", str, "", "where `dsv4 up` caches built models (default: ~/.cache/dsv4)"),
        _s("DSV4_BENCH_DIR", str, "", "the bench package `dsv4 bench` runs (default: the checkout's)"),
        _s("DSV4_FRAMEWORKS_PYTHON", str, "", "the Python the frameworks bench runs agent frameworks with"),
    )
}


def _declared(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in dsv4_wire.switches.SWITCHES") from None


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The switch's value in `environ` (default: this process's), as its declared type; its
    default when unset or empty."""
    sw = _declared(name)
    raw = (os.environ if environ is None else environ).get(name, "")
    if raw == "":
        return sw.default
    if sw.type is bool:
        return raw != "0"
    return sw.type(raw)


def on(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A flag switch: set to anything but "" or "0"."""
    if _declared(name).type is not bool:
        raise TypeError(f"{name} is not a flag")
    return bool(read(name, environ))
