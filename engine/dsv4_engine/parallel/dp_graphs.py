"""Captured decode steps under data-parallel attention (`--dp-size N` with `--cuda-graph-max-bs`).

Each rank captures its own graphs, one per bucket of requests, of the data-parallel decode step
(dp_attention.dp_forward) over its own static buffers and its own pool. A graph's collectives
need the same shapes on every rank, so in a captured step every rank's share counts as the
step's largest share: rank 0 picks the bucket of the largest share and every rank pads its rows
to it (repeating its first row, as cuda_graphs.pad_decode does), so each MoE layer gathers
bucket rows from every rank whatever each holds. A rank with no request this step has no row
to repeat (padding would write a live page); it runs only its part of the collectives, eagerly,
with zero rows of the same width. The logits of each rank's real rows then come back to rank 0
as in an eager step (one gather, outside the graph).

Rank 0 sends a captured step as OP_DP_GRAPH: the step's shares as OP_DP_FORWARD packs them. A
step whose largest share is past the largest bucket runs eagerly (DPForward).
`--cuda-graph-max-bs` is per rank here: a step may hold up to N times as many requests.

DeepSeek-V4: the shares carry their slot rows (its rings), the graph runs the rank's layers as
dp_spec.v4_streams does (windows found on the device, as V4's own captured decode), and each MoE
reads every gathered row's token id (hash routing) from a static buffer of bucket x N ids, filled
before each replay from the step's shares, padded as the rows are (`padded_step_ids`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from dsv4_engine.batch_buffers import HostBatch
from dsv4_engine.cuda_graphs import DecodeGraphs, bucket_for, pad_decode
from dsv4_engine.layers.moe import DeepseekMoE
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel import wire
from dsv4_engine.parallel.dp_attention import (
    dp_forward,
    gather_logits,
    moe_over_ranks,
    pack_shares,
    routes_by_token,
    unpack_share,
    v4_moe_over_ranks,
)
from dsv4_engine.parallel.dp_batch import merge_logits, request_ranks, split_batch


def dp_graphs_refusal(model_type: str) -> Optional[str]:
    """Why this model's data-parallel decode steps are not captured (None: they are)."""
    if model_type in ("deepseek_v3", "deepseek_v2", "deepseek_v4"):
        return None
    return f"not yet captured per rank under --dp-size for model_type {model_type!r} (decodes run eagerly)"


def host_of(fb: ForwardBatch) -> HostBatch:
    """A share (CPU tensors) as the host arrays a graph's static buffers load."""
    return HostBatch(
        input_ids=fb.input_ids.numpy(),
        positions=fb.positions.numpy(),
        slot_mapping=fb.slot_mapping.numpy(),
        block_table=fb.block_table.numpy(),
        seq_lens=fb.seq_lens.numpy(),
        extend_lens=fb.extend_lens.numpy(),
        logits_indices=fb.logits_indices.numpy(),
        slot_ids=None if fb.slot_ids is None else fb.slot_ids.numpy(),  # V4's slot rows
    )


def forward_of(hb: HostBatch, page_size: int) -> ForwardBatch:
    """Rank 0's step (host arrays) as a CPU ForwardBatch, to cut into shares."""
    slots = hb.slot_ids is not None  # V4's slot rows (V3 has none)
    fields = [k for k in HostBatch.__dataclass_fields__ if k != "slot_ids" or slots]
    t = {k: torch.from_numpy(np.ascontiguousarray(getattr(hb, k))) for k in fields}
    return ForwardBatch.of_tensors(t, page_size, all_decode=True, slots=slots)


def step_bucket(reqs: list[int], buckets: list[int]) -> Optional[int]:
    """The bucket every rank replays this step: the largest share's (None: past the largest)."""
    return bucket_for(max(reqs), buckets)


class DPDecodeGraphs(DecodeGraphs):
    """One rank's captured data-parallel decode steps: bucket b's graph runs b rows of this rank
    and gathers b rows from every rank in each MoE layer."""

    def __init__(self, model, states: dict, max_bs: int, width: int, page_size: int, device, capture: bool):
        self.model, self.states, self.page_size = model, states, page_size
        self.ranks = model.tp.size
        self.v4 = routes_by_token(model)
        # V4: every rank's token ids of the step, bucket rows each (what its hash routing reads)
        self.step_ids = torch.zeros(max_bs * self.ranks, dtype=torch.int64, device=device) if self.v4 else None

        def run_forward(t: dict[str, torch.Tensor], bs: int) -> torch.Tensor:
            fb = ForwardBatch.of_tensors(t, page_size, all_decode=True, slots=self.v4)
            if self.v4:
                return v4_decode_logits(model, fb, self.states, [bs] * self.ranks, self.step_ids[: bs * self.ranks])
            return dp_forward(model, fb, self.states, [bs] * self.ranks)

        super().__init__(run_forward, max_bs, width, device, capture)
        self.name = "data-parallel decode"

    def fits(self, n: int, max_pages: int) -> bool:
        """Whether a step may be captured: its pages fit the table; its largest share is checked
        in `step` (each rank's share is at most the step's n, and up to N buckets' worth in all)."""
        return n <= self.buckets[-1] * self.ranks and max_pages <= self.width

    def replay_share(
        self, share: Optional[ForwardBatch], bs: int, step_ids: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """This rank's logits of the step at bucket bs (None when it has no request: then only
        its part of each MoE layer's collectives, eagerly). step_ids (V4): `padded_step_ids`."""
        if self.v4:
            self.step_ids[: step_ids.numel()].copy_(step_ids)
        if share is None:
            if self.v4:  # the routed experts' gather and sum only (the shared expert is per row)
                m, ids = self.model, self.step_ids[: bs * self.ranks]
                empty = torch.zeros(0, m.cfg.hidden_size, dtype=m.dtype, device=m.device)
                for L in m.layers:
                    moe_over_ranks(lambda x, f=L.ffn: f(x, ids, with_shared=False), empty, [bs] * self.ranks, m.tp)
            else:
                idle_moe(self.model, bs)
            return None
        return replay_at(self, host_of(share), bs)


def padded_step_ids(ids: list[Optional[torch.Tensor]], bs: int) -> torch.Tensor:
    """Every rank's token ids (None: no request) as a captured V4 step's MoE gathers them: bs
    rows a rank, a rank's padding rows repeating its first (as pad_decode pads its rows), an idle
    rank's zero rows token 0 (their output is never read)."""
    out = torch.zeros(len(ids) * bs, dtype=torch.int64)
    for r, x in enumerate(ids):
        if x is not None:
            out[r * bs : r * bs + x.numel()] = x
            out[r * bs + x.numel() : (r + 1) * bs] = x[0]
    return out


@torch.inference_mode()
def v4_decode_logits(model, fb: ForwardBatch, states: dict, tokens: list[int], token_ids: torch.Tensor):
    """A V4 rank's captured decode step: its rows' fp32 logits, the MoE over every rank's rows."""
    from dsv4_engine.parallel.dp_spec import v4_streams

    x = v4_streams(
        model,
        model.layers,
        model.embed_streams(fb.input_ids),
        fb,
        states,
        v4_moe_over_ranks(tokens, model.tp, token_ids),
    )
    return model.logits(x[fb.logits_indices])


def replay_at(g: DecodeGraphs, hb: HostBatch, bs: int) -> torch.Tensor:
    """g's output rows of a decode-shaped batch replayed at bucket bs (not its own bucket: the
    step's largest share's); the same padded step run eagerly where nothing was captured."""
    n = hb.seq_lens.shape[0]
    g.inputs.load(pad_decode(hb, bs))
    if g.graphs:
        g.graphs[bs].replay()
        return g.outputs[bs][:n]
    return g.run_forward(g.inputs.view(bs), bs)[:n]


@torch.inference_mode()
def idle_moe(model, bs: int) -> None:
    """A rank without requests in a captured step: each MoE layer's gather and sum over bs zero
    rows of its own (what the busy ranks' graphs expect of it)."""
    idle_layers(model, model.layers, bs)


@torch.inference_mode()
def idle_layers(model, layers, bs: int) -> None:
    """Each MoE layer of `layers`: this rank's part of the gather and sum, with zero rows."""
    comm = model.tp
    h = torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
    for layer in layers:
        if isinstance(layer.mlp, DeepseekMoE):
            moe_over_ranks(layer.mlp, h, [bs] * comm.size, comm)


def dp_decode_graphs(runner, pool) -> DPDecodeGraphs:
    """This rank's (empty) graph set, sized as the runner's plain decode graphs would be."""
    width = max(1, min(pool.num_pages, -(-runner.cfg.max_position_embeddings // pool.page_size)))
    return DPDecodeGraphs(
        runner.local_model, pool.all_states, runner.cuda_graph_max_bs, width, pool.page_size, runner.device, True
    )


def serve_graph_share(graphs: DPDecodeGraphs, header: torch.Tensor, payload: torch.Tensor) -> None:
    """A rank other than 0: its share of a captured step rank 0 sent."""
    model = graphs.model
    cpu = torch.device("cpu")
    share, _, reqs = unpack_share(header, payload, model.tp.rank, cpu)
    bs = step_bucket(reqs, graphs.buckets)
    ids = None
    if graphs.v4:
        shares = [share if r == model.tp.rank else unpack_share(header, payload, r, cpu)[0] for r in range(len(reqs))]
        ids = padded_step_ids([None if s is None else s.input_ids for s in shares], bs)
    logits = graphs.replay_share(share, bs, ids)
    gather_logits(logits, reqs, model.cfg.vocab_size, model.tp, model.device)


class RankZeroDPGraphs:
    """Rank 0's captured steps (what `ModelRunner._graph_forward` steps): the step cut into
    shares and sent, its own share replayed, the logits gathered back in batch order; a step
    whose largest share has no bucket comes back None (the runner then runs it eagerly)."""

    def __init__(self, graphs: DPDecodeGraphs, group, pages_per_rank: int, slots_per_rank: int = 0):
        self.graphs, self.group = graphs, group
        self.pages_per_rank, self.slots_per_rank = pages_per_rank, slots_per_rank

    def step(self, hb: HostBatch) -> Optional[torch.Tensor]:
        g = self.graphs
        fb = forward_of(hb, g.page_size)
        ranks = request_ranks(fb, self.pages_per_rank)
        shares = split_batch(fb, ranks, self.group.size, self.pages_per_rank, g.page_size, self.slots_per_rank)
        reqs = [0 if s is None else s.seq_lens.numel() for s in shares]
        bs = step_bucket(reqs, g.buckets)
        if bs is None:
            return None
        with self.group.step("a captured data-parallel decode step on rank 0"):
            header, payload = pack_shares(shares)
            header[wire.OP] = wire.OP_DP_GRAPH
            torch.distributed.broadcast(header, 0, group=self.group.rank.control)
            torch.distributed.broadcast(payload, 0, group=self.group.rank.control)
            ids = padded_step_ids([None if s is None else s.input_ids for s in shares], bs) if g.v4 else None
            logits = g.replay_share(shares[0], bs, ids)
            parts = gather_logits(logits, reqs, g.model.cfg.vocab_size, g.model.tp, g.model.device)
            return merge_logits(parts, ranks)

    def __getattr__(self, name):
        return getattr(self.graphs, name)
