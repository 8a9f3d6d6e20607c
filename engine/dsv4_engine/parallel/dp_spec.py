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

DeepSeek-V4 (`v4_target_streams`, `v4_mtp_streams`): the same two forwards over its residual
streams [T, hc, D] (what its speculator reads), each rank's layers as `forward_over_ranks` runs
them (mHC, attention, compressors and indexer against its own rings and slot rows; the MTP block's
sliding layer on its own ring), each MoE over every rank's rows with their token ids (hash
routing), the shared expert over the rank's own rows. Rejected drafts' ring entries are put back
on every rank (`parallel.spec.mirrored_rollback`): a request's slot row is the same on every
rank, and only its rank's copy is ever read.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dsv4_engine.layers.moe import DeepseekMoE
from dsv4_engine.models.forward_batch import ForwardBatch, request_spans
from dsv4_engine.parallel import wire
from dsv4_engine.parallel.dp_attention import (
    moe_over_ranks,
    pack_shares,
    routes_by_token,
    step_token_ids,
    unpack_share,
    v4_moe_over_ranks,
    wire_dtype,
)
from dsv4_engine.parallel.dp_batch import request_ranks, split_batch
from dsv4_engine.parallel.spec import mirrored_rollback, receive_hidden, send_hidden

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


def v4_streams(m, layers: list, x: Optional[torch.Tensor], fb: Optional[ForwardBatch], states: dict, moe):
    """Streams x [T_r, hc, D] of this rank's rows through `layers` (a V4 model's, or its MTP
    block's), each MoE through `moe(layer.ffn, h)` over every rank's rows; a rank without rows
    (fb None) still enters every MoE. The streams after the last layer, or None."""
    spans = step = rope = None
    if fb is not None:
        # a captured decode (no host lengths, dp_graphs): its windows found on the device, as V4's own
        static = m.kops is not None and fb.all_decode and fb.seq_lens_host is None
        spans, step = None if static else request_spans(fb), m.new_step()
        rope = m.rope(fb.positions, {"compress" if L.attn.rate else "main" for L in layers})
    for L in layers:
        if fb is None:
            moe(L.ffn, torch.zeros(0, m.cfg.hidden_size, dtype=m.dtype, device=m.device))
            continue
        x, h, post, comb = m.attend(L, x, fb, states, spans, rope, step)
        x = L.hc_ffn.expand(x, moe(L.ffn, h), post, comb)
    return x


@torch.inference_mode()
def v4_target_streams(model, fb: Optional[ForwardBatch], states: dict, tokens: list[int], token_ids):
    """V4's target: the streams [T_r, hc, D] after its last layer at this rank's rows (None: no rows)."""
    x = None if fb is None else model.embed_streams(fb.input_ids)
    return v4_streams(model, model.layers, x, fb, states, v4_moe_over_ranks(tokens, model.tp, token_ids))


@torch.inference_mode()
def v4_mtp_streams(mtp, fb: Optional[ForwardBatch], states: dict, prev, tokens: list[int], token_ids):
    """V4's MTP block: its output streams at this rank's rows (None: no rows); prev: the streams
    this rank's rows follow."""
    model = mtp.model
    x = None if fb is None else mtp.inputs(fb, prev)
    moe = v4_moe_over_ranks(tokens, model.tp, token_ids)
    return v4_streams(model, [mtp.L], x, fb, mtp.layer_states(states), moe)


def row_shape(model) -> tuple[int, ...]:
    """One row of what the speculator reads: a hidden state (V3), or V4's hc streams."""
    return (model.cfg.hc_mult, model.cfg.hidden_size) if routes_by_token(model) else (model.cfg.hidden_size,)


def gather_rows(rows: Optional[torch.Tensor], tokens: list[int], hidden, comm, like: torch.Tensor):
    """Every rank's rows on rank 0, rank-major [sum(tokens), *hidden] (None elsewhere); hidden:
    a row's width, or its shape."""
    shape = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    pad = torch.zeros(max(tokens), *shape, dtype=wire_dtype(like), device=like.device)
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


def run_share(op: int, spec, fb, states: dict, tokens: list[int], ids, prev=None):
    """This rank's part of a speculative forward (V3 or V4): its rows' output, or None."""
    model, me = spec.model, spec.model.tp.rank
    v4 = routes_by_token(model)
    if op == wire.OP_DP_SPEC_TARGET:
        return v4_target_streams(model, fb, states, tokens, ids) if v4 else target_hidden(model, fb, states, tokens)
    mine = my_rows(prev, tokens, me)
    if v4:
        return v4_mtp_streams(spec.local_mtp, fb, states, mine, tokens, ids)
    return mtp_hidden(spec.local_mtp, fb, states, mine, tokens)


def serve_spec_share(op: int, spec, header: torch.Tensor, payload: torch.Tensor, states: dict, rank) -> None:
    """A rank other than 0: its share of a speculative forward rank 0 sent."""
    model = spec.model
    fb, tokens, _ = unpack_share(header, payload, model.tp.rank, model.device)
    ids = step_token_ids(header, payload, model.device) if routes_by_token(model) else None
    prev = receive_hidden(rank, model.device) if op == wire.OP_DP_SPEC_MTP else None
    out = run_share(op, spec, fb, states, tokens, ids, prev)
    like = torch.empty(0, dtype=model.dtype if prev is None else prev.dtype, device=model.device)
    gather_rows(out, tokens, row_shape(model), model.tp, like)


# ---- rank 0 --------------------------------------------------------------------------------------


class DPSpeculation:
    """Rank 0's side: sends a speculative forward's shares, runs its own, and returns the
    hidden states of every row in batch order."""

    def __init__(self, spec, group, pages_per_rank: int, page_size: int, slots_per_rank: int = 0):
        self.spec, self.group = spec, group
        self.pages_per_rank, self.page_size = pages_per_rank, page_size
        self.slots_per_rank = slots_per_rank

    def _shares(self, fb: ForwardBatch, op: int):
        ranks = request_ranks(fb, self.pages_per_rank)
        shares = split_batch(fb, ranks, self.group.size, self.pages_per_rank, self.page_size, self.slots_per_rank)
        header, payload = pack_shares(shares)
        header[wire.OP] = op
        dist.broadcast(header, 0, group=self.group.rank.control)
        dist.broadcast(payload, 0, group=self.group.rank.control)
        model = self.spec.model
        fb0, tokens, _ = unpack_share(header, payload, 0, model.device)
        ids = step_token_ids(header, payload, model.device) if routes_by_token(model) else None
        return fb0, tokens, ids, rank_major_rows(fb.extend_lens.tolist(), ranks, self.group.size)

    def _in_batch_order(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        out[order.to(rows.device)] = rows
        return out

    def target_hidden(self, fb: ForwardBatch, states: dict) -> torch.Tensor:
        model = self.spec.model
        with self.group.step("a data-parallel speculative target step on rank 0"):
            fb0, tokens, ids, order = self._shares(fb, wire.OP_DP_SPEC_TARGET)
            mine = run_share(wire.OP_DP_SPEC_TARGET, self.spec, fb0, states, tokens, ids)
            like = torch.empty(0, dtype=model.dtype, device=model.device)
            return self._in_batch_order(gather_rows(mine, tokens, row_shape(model), model.tp, like), order)

    def mtp_hidden(self, fb: ForwardBatch, states: dict, prev: torch.Tensor) -> torch.Tensor:
        model = self.spec.model
        with self.group.step("a data-parallel speculative MTP step on rank 0"):
            fb0, tokens, ids, order = self._shares(fb, wire.OP_DP_SPEC_MTP)
            ranked = prev[order.to(prev.device)]
            send_hidden(self.group, ranked)
            mine = run_share(wire.OP_DP_SPEC_MTP, self.spec, fb0, states, tokens, ids, ranked)
            out = gather_rows(mine, tokens, row_shape(model), model.tp, ranked)
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


def dp_speculator(spec, group, pages_per_rank: int, page_size: int, slot_states: Optional[dict] = None) -> None:
    """Make rank 0's speculator run its forwards data-parallel over the group; with slot states
    (V4's rings), put back rejected drafts' ring entries on every rank."""
    rows = next(iter(slot_states.values())).shape[0] if slot_states else 0  # each rank's slot rows
    dp = DPSpeculation(spec, group, pages_per_rank, page_size, rows)
    spec.target = DPTarget(spec.target, dp)
    spec.mtp = DPMTP(spec.mtp, dp)
    if slot_states:
        spec.rollback = mirrored_rollback(group, slot_states, rows)
