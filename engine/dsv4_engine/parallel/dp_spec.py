"""Speculative decoding under data-parallel attention (`--dp-size N --speculative-algorithm mtp`).

Rank 0 runs the speculator as at one rank (schedules, verifies, picks the drafts). Its two kinds
of forward run data-parallel, as a plain DP step does (dp_attention): the batch is cut into each
rank's share (`split_batch`: a request's rows go to the rank its pages live on), every rank
runs attention over its own rows against its own pool (the target's layers and the MTP block's
own layer, whose KV each rank's pool holds for its requests), and the MoE of every layer runs
over every rank's rows, gathered. What the speculator reads back is the hidden state at every
row: each rank's rows are gathered to rank 0 and put back in batch order.
- the target's forward (OP_DP_SPEC_TARGET): the final-normed hidden states;
- one MTP forward (OP_DP_SPEC_MTP): its input hidden states first go out in rank-major order
  (each rank takes its own rows), its output hidden states come back; rank 0 applies the head.
Heads are whole on every rank here, so only rank 0 computes logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dsv4_engine.layers.moe import DeepseekMoE
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel import wire
from dsv4_engine.parallel.dp_attention import wire_dtype, moe_over_ranks, pack_shares, unpack_share
from dsv4_engine.parallel.dp_batch import request_ranks, split_batch
from dsv4_engine.parallel.spec import receive_hidden, send_hidden

# ---- pure: where each rank's rows sit in the batch -----------------------------------------------


def rank_major_rows(extend_lens: list[int], ranks: list[int], dp_size: int) -> torch.Tensor:
    """The batch's token rows in rank-major order (rank 0's requests' rows, in batch order, then
    rank 1's, ...): the order the ranks' shares concatenate to (`split_batch`)."""
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)
    order = [
        j
        for r in range(dp_size)
        for i, ri in enumerate(ranks)
        if ri == r
        for j in range(starts[i], starts[i] + extend_lens[i])
    ]
    return torch.tensor(order, dtype=torch.int64)


# ---- every rank ----------------------------------------------------------------------------------


def dp_layer(layer, x, residual, fb, kv_layer, slots, tokens: list[int], comm, hidden: int, dtype, device):
    """One decoder layer on this rank's rows (attention over its own pool), its MoE over every
    rank's rows. A rank without rows (x None) still enters the MoE's collectives."""
    mine = tokens[comm.rank]
    if mine:
        h, residual = layer.input_norm(x, residual)
        x = layer.attn(h, fb, kv_layer, slots)
        h, residual = layer.post_norm(x, residual)
    else:
        h = torch.zeros(0, hidden, dtype=dtype, device=device)
    if isinstance(layer.mlp, DeepseekMoE):
        x = moe_over_ranks(layer.mlp, h, tokens, comm)
    elif mine:
        x = layer.mlp(h)
    return x, residual


def _slots(fb: ForwardBatch, pool: torch.Tensor):
    page_size = pool.shape[2]
    return fb.slot_mapping // page_size, fb.slot_mapping % page_size


@torch.inference_mode()
def target_hidden(model, fb: Optional[ForwardBatch], states: dict, tokens: list[int]) -> Optional[torch.Tensor]:
    """The target's final-normed hidden states at this rank's rows [T_r, hidden] (None: no rows)."""
    comm, mine = model.tp, tokens[model.tp.rank]
    kv_pool = states[model.LATENT_KV]
    x = residual = slots = None
    if mine:
        slots = _slots(fb, kv_pool)
        x = torch.nn.functional.embedding(fb.input_ids, model.embed)
    for i, layer in enumerate(model.layers):
        x, residual = dp_layer(
            layer, x, residual, fb, kv_pool[:, i], slots, tokens, comm, model.cfg.hidden_size, model.dtype, model.device
        )
    return model.final_norm(x + residual)[0] if mine else None


@torch.inference_mode()
def mtp_hidden(mtp, fb: Optional[ForwardBatch], states: dict, prev: torch.Tensor, tokens: list[int]):
    """The MTP block's output hidden states at this rank's rows (None: no rows)."""
    from dsv4_engine.spec_decode.mtp_layer import STATE

    model = mtp.model
    comm, mine = model.tp, tokens[model.tp.rank]
    kv = states[STATE]
    x = slots = None
    if mine:
        slots = _slots(fb, kv)
        x = mtp.inputs(fb, prev)
    x, residual = dp_layer(
        mtp.L, x, None, fb, kv[:, 0], slots, tokens, comm, model.cfg.hidden_size, model.dtype, model.device
    )
    return x + residual if mine else None


def gather_rows(rows: Optional[torch.Tensor], tokens: list[int], hidden: int, comm, like: torch.Tensor):
    """Every rank's rows on rank 0, rank-major [sum(tokens), hidden] (None elsewhere)."""
    pad = torch.zeros(max(tokens), hidden, dtype=wire_dtype(like), device=like.device)
    if rows is not None:
        pad[: rows.shape[0]] = rows
    group = comm._rank.compute
    if comm.rank != 0:
        dist.gather(pad, None, dst=0, group=group)
        return None
    parts = [torch.empty_like(pad) for _ in tokens]
    dist.gather(pad, parts, dst=0, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, tokens)]).to(like.dtype)


def my_rows(prev: torch.Tensor, tokens: list[int], rank: int) -> torch.Tensor:
    start = sum(tokens[:rank])
    return prev[start : start + tokens[rank]]


def serve_spec_share(op: int, spec, header: torch.Tensor, payload: torch.Tensor, states: dict, rank) -> None:
    """A rank other than 0: its share of a speculative forward rank 0 sent."""
    model = spec.model
    fb, tokens, _ = unpack_share(header, payload, model.tp.rank, model.device)
    like = torch.empty(0, dtype=model.dtype, device=model.device)
    if op == wire.OP_DP_SPEC_TARGET:
        out = target_hidden(model, fb, states, tokens)
    else:
        prev = receive_hidden(rank, model.device)
        out = mtp_hidden(spec.local_mtp, fb, states, my_rows(prev, tokens, model.tp.rank), tokens)
    gather_rows(out, tokens, model.cfg.hidden_size, model.tp, like)


# ---- rank 0 --------------------------------------------------------------------------------------


class DPSpeculation:
    """Rank 0's side: sends a speculative forward's shares, runs its own, and returns the
    hidden states of every row in batch order."""

    def __init__(self, spec, group, pages_per_rank: int, page_size: int):
        self.spec, self.group = spec, group
        self.pages_per_rank, self.page_size = pages_per_rank, page_size

    def _shares(self, fb: ForwardBatch, op: int):
        ranks = request_ranks(fb, self.pages_per_rank)
        shares = split_batch(fb, ranks, self.group.size, self.pages_per_rank, self.page_size)
        header, payload = pack_shares(shares)
        header[wire.OP] = op
        dist.broadcast(header, 0, group=self.group.rank.control)
        dist.broadcast(payload, 0, group=self.group.rank.control)
        fb0, tokens, _ = unpack_share(header, payload, 0, self.spec.model.device)
        return fb0, tokens, rank_major_rows(fb.extend_lens.tolist(), ranks, self.group.size)

    def _in_batch_order(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        out[order.to(rows.device)] = rows
        return out

    def target_hidden(self, fb: ForwardBatch, states: dict) -> torch.Tensor:
        model = self.spec.model
        with self.group.step("a data-parallel speculative target step on rank 0"):
            fb0, tokens, order = self._shares(fb, wire.OP_DP_SPEC_TARGET)
            mine = target_hidden(model, fb0, states, tokens)
            like = torch.empty(0, dtype=model.dtype, device=model.device)
            return self._in_batch_order(gather_rows(mine, tokens, model.cfg.hidden_size, model.tp, like), order)

    def mtp_hidden(self, fb: ForwardBatch, states: dict, prev: torch.Tensor) -> torch.Tensor:
        model = self.spec.model
        with self.group.step("a data-parallel speculative MTP step on rank 0"):
            fb0, tokens, order = self._shares(fb, wire.OP_DP_SPEC_MTP)
            ranked = prev[order.to(prev.device)]
            send_hidden(self.group, ranked)
            mine = mtp_hidden(self.spec.local_mtp, fb0, states, my_rows(ranked, tokens, 0), tokens)
            out = gather_rows(mine, tokens, model.cfg.hidden_size, model.tp, ranked)
            return self._in_batch_order(out, order)


class DPTarget:
    def __init__(self, target, dp: DPSpeculation):
        self.target, self.dp = target, dp

    def hidden(self, fb, states: dict) -> torch.Tensor:
        return self.dp.target_hidden(fb, states)

    def __getattr__(self, name):
        return getattr(self.target, name)


class DPMTP:
    def __init__(self, mtp, dp: DPSpeculation):
        self.mtp, self.dp = mtp, dp

    def forward(self, fb, states: dict, prev: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """As MTPLayer.forward: (fp32 logits, output hidden states) at `rows` (default: each
        request's last)."""
        out = self.dp.mtp_hidden(fb, states, prev)
        out = out[fb.logits_indices if rows is None else rows]
        return self.mtp.logits(out), out

    def __getattr__(self, name):
        return getattr(self.mtp, name)


def dp_speculator(spec, group, pages_per_rank: int, page_size: int) -> None:
    """Make rank 0's speculator run its forwards data-parallel over the group."""
    dp = DPSpeculation(spec, group, pages_per_rank, page_size)
    spec.target = DPTarget(spec.target, dp)
    spec.mtp = DPMTP(spec.mtp, dp)
