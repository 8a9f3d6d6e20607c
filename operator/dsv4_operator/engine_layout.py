"""A role's parallel layout inside one engine (issue 46), spec -> engine flags. Pure.

TP stays `gpusPerPod` (x `nodesPerReplica`): one engine spans every GPU of its replica. On top,
`dpAttention` makes each of those ranks an attention replica of its own (`--dp-size` equal to the
engine's `--tp-size`), and `redundantExperts` asks the builtin engine for EPLB copies. What the
schema cannot express alone is checked here too (`layout_reasons`), for a CRD older than the
operator or an API server without CEL.
"""

from __future__ import annotations

from dsv4_operator import layout_rules as L
from dsv4_operator.spec import DSV4DeploymentSpec, RoleSpec
from dsv4_wire.flags import EngineFlags

SGLANG_DP_ATTENTION = "--enable-dp-attention"  # SGLang's switch; its --dp-size is spelled as ours


def engine_ranks(r: RoleSpec) -> int:
    """The engine's --tp-size: every GPU of the replica (at least 1)."""
    return max(1, r.gpus_per_pod) * r.nodes_per_replica


def layout_flags(kind: str, r: RoleSpec, tp: int) -> list[str]:
    """The engine flags of dpAttention and redundantExperts, beside the `--tp-size tp` the
    manifests write (--dp-size is always that same size)."""
    out: list[str] = []
    if r.dp_attention and tp > 1:  # below 2 ranks it is refused (layout_reasons), not rendered
        dp = [EngineFlags.DP_SIZE, str(tp)]
        out += dp if kind == "builtin" else [SGLANG_DP_ATTENTION, *dp]
    if r.redundant_experts and kind == "builtin":
        out += [EngineFlags.EP_REDUNDANT_EXPERTS, str(r.redundant_experts)]
    return out


def layout_reasons(spec: DSV4DeploymentSpec) -> list[str]:
    """Why a role's layout cannot be built (the CRD's CEL rules, said again at reconcile)."""
    reasons = []
    for role in ("prefill", "decode"):
        r = spec.role(role)
        if r.dp_attention and engine_ranks(r) < 2:
            reasons.append(f"{role}: {L.MSG_DP_ATTENTION_ONE_GPU}")
        if r.redundant_experts and r.redundant_experts > engine_ranks(r):
            reasons.append(f"{role}: {L.MSG_REDUNDANT_PER_GPU} ({r.redundant_experts} > {engine_ranks(r)})")
        if r.redundant_experts and spec.engine.kind == "sglang":
            reasons.append(f"{role}: {L.MSG_SGLANG_REDUNDANT}")
    return reasons
