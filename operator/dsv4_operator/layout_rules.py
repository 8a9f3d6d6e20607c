"""The words and admission rules of a role's parallel layout fields (`dpAttention`,
`redundantExperts`, issue 46): their CRD descriptions, the CEL rules the API server checks and
the messages the operator repeats at reconcile (`engine_layout`). Both fields are optional with no
default: absent stays absent, so an object written before them keeps its revision and its pods.
"""

from __future__ import annotations

DP_ATTENTION_DOC = (
    "Data-parallel attention over the replica's GPUs: each GPU attends over its own requests and holds only "
    "their KV, the MoE runs expert-parallel over all of them, so a replica keeps about gpusPerPod x "
    "nodesPerReplica times the KV of tensor-parallel attention (builtin: `dsv4 serve --tp-size T --dp-size T`; "
    "sglang: its DP attention switch with --dp-size T; T = gpusPerPod x nodesPerReplica). Needs 2 GPUs or more a "
    "replica. The engine refuses at start, in its log, what it does not run yet with it (docs/tensor-parallel.md)."
)
REDUNDANT_EXPERTS_DOC = (
    "builtin: EPLB, this many extra copies of the hottest routed experts, at most one per GPU of a replica "
    "(`dsv4 serve --ep-redundant-experts`; docs/eplb.md). Not mapped for engine.kind sglang (give SGLang's own "
    "EPLB flags in args)."
)
MSG_DP_ATTENTION_ONE_GPU = (
    "dpAttention needs 2 GPUs or more a replica (gpusPerPod x nodesPerReplica): each GPU is one attention replica"
)
MSG_REDUNDANT_PER_GPU = (
    "redundantExperts is at most one per GPU of a replica (gpusPerPod x nodesPerReplica): the engine places at most "
    "one redundant expert per rank"
)
MSG_SGLANG_REDUNDANT = "redundantExperts is builtin's flag; with engine.kind sglang give SGLang's EPLB flags in args"

_RANKS = "((self.gpusPerPod > 1 ? self.gpusPerPod : 1) * self.nodesPerReplica)"  # the engine's --tp-size, >= 1

# On a role (prefill, decode): `self` is the role.
ROLE_RULES = [
    {
        "rule": "!has(self.dpAttention) || !self.dpAttention || self.nodesPerReplica > 1 || self.gpusPerPod > 1",
        "message": MSG_DP_ATTENTION_ONE_GPU,
        "fieldPath": ".dpAttention",
    },
    {
        "rule": f"!has(self.redundantExperts) || self.redundantExperts <= {_RANKS}",
        "message": MSG_REDUNDANT_PER_GPU,
        "fieldPath": ".redundantExperts",
    },
]
# On the spec: `self` is the spec.
ENGINE_ROLES = ("prefill", "decode")
SGLANG_REDUNDANT_RULE = {
    "rule": "self.engine.kind != 'sglang' || ("
    + " && ".join(f"(!has(self.{r}.redundantExperts) || self.{r}.redundantExperts == 0)" for r in ENGINE_ROLES)
    + ")",
    "message": MSG_SGLANG_REDUNDANT,
    "fieldPath": ".engine.kind",
}
