"""Data-parallel attention (`--dp-size N` with `--tp-size N`): one step on every rank.

Each rank runs embeddings, norms, attention, the dense MLPs and the LM head over its own
requests' token rows only, against its own page pool (`dp_pages`). Before each MoE layer the
ranks all-gather their rows (padded to the step's largest share; a rank with no rows sends only
padding), run the MoE expert-parallel over every gathered token (each rank its experts and its
slice of the shared experts, the partial sums added by one all-reduce, as under TP), and each
keeps its own rows of the sum. Every rank enters every collective of every layer whatever its
share, so a step where one rank prefills and another idles cannot deadlock. The logits of each
rank's requests come back to rank 0 (one gather), which samples as at one rank: the sampler's
state (seeds, penalties, grammars) stays in one place. DeepSeek-V4 runs the same step through
its own layers (`DeepseekV4.forward_over_ranks`: mHC, attention, compressors, indexer and its
states per rank); its MoE also takes every gathered row's token id (hash routing).

Rank 0 sends each step as one header and one int64 payload: every rank's token and request
counts, then each non-empty share packed as `wire.pack` packs a batch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dsv4_engine.layers.moe import DeepseekMoE
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel import wire
from dsv4_engine.parallel.dp_batch import merge_logits, request_ranks, split_batch


def dp_refusal(args, model_type: str) -> Optional[str]:
    """Why these flags cannot run data-parallel attention (one line), or None. What is not built
    yet is refused by name, never run half-way."""
    if args.dp_size <= 1:
        return None
    if args.dp_size != args.tp_size:
        return f"--dp-size {args.dp_size} needs --tp-size {args.dp_size} (each rank is one attention replica)"
    if model_type not in ("deepseek_v3", "deepseek_v2", "deepseek_v4"):
        return f"--dp-size > 1 is not supported for model_type {model_type!r} (DeepSeek-V3 and V4 only)"
    # pd.dp_handoff: rank 0 cannot read rank r's pool to verify what landed (a server option)
    if args.role == "decode" and getattr(args, "transfer_checksum", False):
        return "--dp-size > 1 is not yet supported with --transfer-checksum on a decode"
    if args.role != "mono" and args.speculative_algorithm is not None:  # (each built, not yet together)
        return f"--dp-size > 1 is not yet supported with PD (--role {args.role}) and --speculative-algorithm together"
    if args.nnodes > 1:
        return "--dp-size > 1 is not yet supported with --nnodes > 1"
    if args.host_cache_gb > 0 or args.disk_cache_dir:
        return (
            "--dp-size > 1 is not yet supported with --host-cache-gb / --disk-cache-dir "
            "(the device prefix cache is per rank; a rank's pages live in its own process)"
        )
    return None


# ---- the step's message --------------------------------------------------------------------------


def pack_shares(shares: list[Optional[ForwardBatch]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload): [tokens of each rank, requests of each rank, then each non-empty share
    as its wire header and payload]."""
    tokens = [0 if s is None else s.input_ids.numel() for s in shares]
    reqs = [0 if s is None else s.seq_lens.numel() for s in shares]
    parts = [torch.tensor(tokens + reqs, dtype=torch.int64)]
    for s in shares:
        if s is not None:
            parts.extend(wire.pack(s))
    payload = torch.cat(parts)
    header = wire.op_header(wire.OP_DP_FORWARD)
    header[wire.REQS] = len(shares)
    header[wire.PAYLOAD] = payload.numel()
    return header, payload


def unpack_share(
    header: torch.Tensor, payload: torch.Tensor, rank: int, device: torch.device
) -> tuple[Optional[ForwardBatch], list[int], list[int]]:
    """This rank's share (None when it has no request this step), and every rank's token and
    request counts."""
    n = int(header[wire.REQS])
    counts = payload[: 2 * n].tolist()
    tokens, reqs = counts[:n], counts[n:]
    at = 2 * n
    for r in range(n):
        if reqs[r] == 0:
            continue
        h = payload[at : at + wire.HEADER_LEN]
        body = payload[at + wire.HEADER_LEN : at + wire.HEADER_LEN + wire.payload_len(h)]
        if r == rank:
            return wire.unpack(h, body, device), tokens, reqs
        at += wire.HEADER_LEN + wire.payload_len(h)
    return None, tokens, reqs


# ---- the forward ---------------------------------------------------------------------------------


def wire_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_cuda or x.dtype == torch.float32 else torch.float32  # gloo: float32


def step_token_ids(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's token ids of the step in rank order (the rows the MoE gathers): V4's hash-routed
    layers pick experts by token id. Read from the step's message, which every rank holds."""
    n = int(header[wire.REQS])
    reqs = payload[n : 2 * n].tolist()
    at, ids = 2 * n, []
    for r in range(n):
        if reqs[r] == 0:
            continue
        h = payload[at : at + wire.HEADER_LEN]
        ids.append(payload[at + wire.HEADER_LEN : at + wire.HEADER_LEN + int(h[wire.TOKENS])])
        at += wire.HEADER_LEN + wire.payload_len(h)
    return torch.cat(ids).to(device)


def routes_by_token(model) -> bool:
    """Whether the model's MoE needs every gathered row's token id (V4: hash routing)."""
    return hasattr(model, "forward_over_ranks")


def moe_over_ranks(moe: DeepseekMoE, h: torch.Tensor, tokens: list[int], comm) -> torch.Tensor:
    """The MoE over every rank's rows; this rank's rows of the output. `h`: its rows [T, D]."""
    me, group = comm.rank, comm._rank.compute
    width = max(tokens)
    pad = torch.zeros(width, h.shape[1], dtype=wire_dtype(h), device=h.device)
    pad[: h.shape[0]] = h
    parts = [torch.empty_like(pad) for _ in tokens]
    dist.all_gather(parts, pad, group=group)
    everyone = torch.cat([p[:n] for p, n in zip(parts, tokens)]).to(h.dtype)
    out = moe(everyone)  # this rank's experts' share, summed over the ranks inside
    start = sum(tokens[:me])
    return out[start : start + tokens[me]]


def v4_moe_over_ranks(tokens: list[int], comm, token_ids: torch.Tensor):
    """V4's MoE of one step, as forward_over_ranks calls it: moe(layer.ffn, this rank's rows)."""

    def run(moe, h: torch.Tensor) -> torch.Tensor:
        # routed experts over every rank's rows and token ids; the shared expert, whole on
        # every rank, over this rank's rows only (rank 0 alone would do every rank's)
        routed = moe_over_ranks(lambda x: moe(x, token_ids, with_shared=False), h, tokens, comm)
        return routed + moe.shared_expert(h)

    return run


@torch.inference_mode()
def dp_forward(
    model, fb: Optional[ForwardBatch], states: dict, tokens: list[int], token_ids: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """One step on this rank: fp32 logits of its requests [B_r, vocab], or None when it has none
    (it still takes part in every layer's MoE). DeepSeek-V4 runs its own layer order
    (`forward_over_ranks`), its MoE over every rank's rows and token ids."""
    comm = model.tp
    if routes_by_token(model):
        return model.forward_over_ranks(fb, states, v4_moe_over_ranks(tokens, comm, token_ids))
    mine = tokens[comm.rank]
    hidden = model.cfg.hidden_size
    x = residual = None
    if mine:
        kv_pool = states[model.LATENT_KV]
        page_size = kv_pool.shape[2]
        slots = (fb.slot_mapping // page_size, fb.slot_mapping % page_size)
        x = torch.nn.functional.embedding(fb.input_ids, model.embed)
    for i, layer in enumerate(model.layers):
        if mine:
            h, residual = layer.input_norm(x, residual)
            x = layer.attn(h, fb, kv_pool[:, i], slots)
            h, residual = layer.post_norm(x, residual)
        else:
            h = torch.zeros(0, hidden, dtype=model.dtype, device=model.device)
        if isinstance(layer.mlp, DeepseekMoE):
            x = moe_over_ranks(layer.mlp, h, tokens, comm)
        elif mine:
            x = layer.mlp(h)
    if not mine:
        return None
    rows = fb.logits_indices
    return model.lm_head(model.final_norm(x[rows] + residual[rows])[0]).float()


def gather_logits(logits: Optional[torch.Tensor], reqs: list[int], vocab: int, comm, device) -> list:
    """Every rank's logits on rank 0 (None elsewhere): one gather, padded to the largest share."""
    width = max(reqs)
    pad = torch.zeros(width, vocab, dtype=torch.float32, device=device)
    if logits is not None:
        pad[: logits.shape[0]] = logits
    group = comm._rank.compute
    if comm.rank != 0:
        dist.gather(pad, None, dst=0, group=group)
        return []
    parts = [torch.empty_like(pad) for _ in reqs]
    dist.gather(pad, parts, dst=0, group=group)
    return [p[:n] if n else None for p, n in zip(parts, reqs)]


def serve_share(model, header: torch.Tensor, payload: torch.Tensor, states: dict) -> None:
    """A rank other than 0: its share of the step rank 0 sent."""
    fb, tokens, reqs = unpack_share(header, payload, model.tp.rank, model.device)
    ids = step_token_ids(header, payload, model.device) if routes_by_token(model) else None
    logits = dp_forward(model, fb, states, tokens, ids)
    gather_logits(logits, reqs, model.cfg.vocab_size, model.tp, model.device)


class DPForward:
    """Rank 0's model under --dp-size N: each step is cut into the ranks' shares, sent, run on
    every rank, and its logits gathered back in batch order."""

    def __init__(self, model, group, pages_per_rank: int, page_size: int, slots_per_rank: int = 0):
        self.model = model
        self.slots_per_rank = slots_per_rank  # slot rows of each rank's pool (V4; dp_pages)
        self.group = group
        self.pages_per_rank = pages_per_rank
        self.page_size = page_size

    def forward(self, fb: ForwardBatch, states: dict) -> torch.Tensor:
        with self.group.step("a data-parallel step on rank 0"):
            ranks = request_ranks(fb, self.pages_per_rank)
            shares = split_batch(fb, ranks, self.group.size, self.pages_per_rank, self.page_size, self.slots_per_rank)
            header, payload = pack_shares(shares)
            dist.broadcast(header, 0, group=self.group.rank.control)
            dist.broadcast(payload, 0, group=self.group.rank.control)
            fb0, tokens, reqs = unpack_share(header, payload, 0, self.model.device)
            ids = step_token_ids(header, payload, self.model.device) if routes_by_token(self.model) else None
            logits = dp_forward(self.model, fb0, states, tokens, ids)
            parts = gather_logits(logits, reqs, self.model.cfg.vocab_size, self.model.tp, self.model.device)
            return merge_logits(parts, ranks)

    def __getattr__(self, name):
        return getattr(self.model, name)
