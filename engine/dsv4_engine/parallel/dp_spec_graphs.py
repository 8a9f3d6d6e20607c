"""The speculator's captured steps under data-parallel attention (`--dp-size N`, MTP, with
`--cuda-graph-max-bs`; DeepSeek-V3's one-token rows: spec_decode.graphs).

Each rank captures the verify and draft sets over its own static buffers and pool, their forwards
the data-parallel ones (parallel.dp_spec: attention over the rank's rows, the MoE gathered from
every rank), each bucket gathering that many rows from every rank. A captured step is cut into
shares as an eager one; every rank with rows replays the bucket of the step's largest share (its
rows padded by repeating its first, its `prev` row too); a rank without rows runs only its part of
each MoE layer's gather and sum, eagerly (dp_graphs.idle_layers). The hidden rows come back to
rank 0 as in the eager step (dp_spec.gather_rows), and a draft's input rows go out rank-major
first. Rank 0 sends a verify as OP_DP_SPEC_VERIFY_GRAPH and a draft as OP_DP_SPEC_DRAFT_GRAPH.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from dsv4_engine.batch_buffers import HostBatch
from dsv4_engine.cuda_graphs import bucket_for
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.parallel import wire
from dsv4_engine.parallel.dp_attention import pack_shares, unpack_share
from dsv4_engine.parallel.dp_batch import request_ranks, split_batch
from dsv4_engine.parallel.dp_graphs import forward_of, host_of, idle_layers, replay_at
from dsv4_engine.parallel.dp_spec import my_rows, gather_rows, mtp_hidden, rank_major_rows, target_hidden
from dsv4_engine.parallel.spec import receive_hidden, send_hidden
from dsv4_engine.spec_decode.graphs import SpecGraphs


class DPSpecGraphs(SpecGraphs):
    """One rank's verify and draft sets, their forwards data-parallel (bucket b: b rows of this
    rank, b gathered from every rank in each MoE layer)."""

    def __init__(self, spec, page_size: int, num_pages: int, max_bs: int, capture: bool):
        super().__init__(spec, page_size, num_pages, max_bs, capture)
        model, mtp = spec.local_target.model, spec.local_mtp
        self.model, self.mtp, self.page_size = model, mtp, page_size
        ranks = model.tp.size

        def fb_of(t: dict[str, torch.Tensor]) -> ForwardBatch:
            return ForwardBatch.of_tensors(t, page_size, all_decode=True, slots=False)

        self.verify.run_forward = lambda t, bs: target_hidden(model, fb_of(t), self.states, [bs] * ranks)
        self.draft.run_forward = lambda t, bs: mtp_hidden(mtp, fb_of(t), self.states, self.prev[:bs], [bs] * ranks)

    def verify_share(self, hb, bs: int):
        if hb is None:
            idle_layers(self.model, self.model.layers, bs)
            return None
        return replay_at(self.verify, hb, bs)

    def draft_share(self, hb, prev: torch.Tensor, bs: int):
        if hb is None:
            idle_layers(self.model, [self.mtp.L], bs)
            return None
        n = prev.shape[0]
        self.prev[:n].copy_(prev)
        self.prev[n:bs].copy_(prev[:1].expand(bs - n, *prev.shape[1:]))  # padding rows repeat row 0
        return replay_at(self.draft, hb, bs)


def serve_spec_graph(graphs: DPSpecGraphs, op: int, header: torch.Tensor, payload: torch.Tensor, rank) -> None:
    """A rank other than 0: its share of a captured speculative step rank 0 sent."""
    model = graphs.model
    share, tokens, _ = unpack_share(header, payload, model.tp.rank, torch.device("cpu"))
    hb = None if share is None else host_of(share)
    bs = bucket_for(max(tokens), graphs.buckets)
    if op == wire.OP_DP_SPEC_VERIFY_GRAPH:
        out = graphs.verify_share(hb, bs)
    else:
        prev = my_rows(receive_hidden(rank, model.device), tokens, model.tp.rank)
        out = graphs.draft_share(hb, prev, bs)
    like = torch.empty(0, dtype=model.dtype, device=model.device)
    gather_rows(out, tokens, model.cfg.hidden_size, model.tp, like)


class RankZeroDPSpecGraphs:
    """Rank 0's captured speculative steps (what the speculator replays: `fits`, `hidden`,
    `draft_hidden`): each cut into shares and sent, its own share replayed, the hidden rows
    gathered back in batch order."""

    def __init__(self, graphs: DPSpecGraphs, group, pages_per_rank: int, slots_per_rank: int = 0):
        self.graphs, self.group, self.pages_per_rank = graphs, group, pages_per_rank
        self.slots_per_rank = slots_per_rank

    def _rows_per_rank(self, hb: HostBatch) -> np.ndarray:
        ranks = hb.block_table[:, 0].astype(np.int64) // self.pages_per_rank
        return np.bincount(ranks, weights=hb.extend_lens, minlength=self.group.size)

    def fits(self, hb: HostBatch, verify: bool = False) -> bool:
        """One-token rows whose largest share has a bucket, pages within the width."""
        g = self.graphs
        one_token = bool((hb.extend_lens == 1).all())
        return one_token and self._rows_per_rank(hb).max() <= g.buckets[-1] and hb.block_table.shape[1] <= g.width

    def _send(self, hb: HostBatch, op: int):
        g = self.graphs
        fb = forward_of(hb, g.page_size)
        ranks = request_ranks(fb, self.pages_per_rank)
        shares = split_batch(fb, ranks, self.group.size, self.pages_per_rank, g.page_size, self.slots_per_rank)
        header, payload = pack_shares(shares)
        header[wire.OP] = op
        dist.broadcast(header, 0, group=self.group.rank.control)
        dist.broadcast(payload, 0, group=self.group.rank.control)
        tokens = [0 if s is None else s.input_ids.numel() for s in shares]
        order = rank_major_rows(fb.extend_lens.tolist(), ranks, self.group.size)
        mine = None if shares[0] is None else host_of(shares[0])
        return mine, tokens, order, bucket_for(max(tokens), g.buckets)

    def _back(self, out, tokens: list[int], order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        g = self.graphs
        rows = gather_rows(out, tokens, g.model.cfg.hidden_size, g.model.tp, like)
        batch = torch.empty_like(rows)
        batch[order.to(rows.device)] = rows
        return batch

    def hidden(self, hb: HostBatch, pool) -> torch.Tensor:
        g = self.graphs
        g.states = pool.all_states
        with self.group.step("a captured data-parallel speculative verify on rank 0"):
            mine, tokens, order, bs = self._send(hb, wire.OP_DP_SPEC_VERIFY_GRAPH)
            like = torch.empty(0, dtype=g.model.dtype, device=g.model.device)
            return self._back(g.verify_share(mine, bs), tokens, order, like)

    def draft_hidden(self, hb: HostBatch, prev: torch.Tensor, pool) -> torch.Tensor:
        g = self.graphs
        g.states = pool.all_states
        with self.group.step("a captured data-parallel speculative draft on rank 0"):
            mine, tokens, order, bs = self._send(hb, wire.OP_DP_SPEC_DRAFT_GRAPH)
            ranked = prev[order.to(prev.device)]
            send_hidden(self.group, ranked)
            return self._back(g.draft_share(mine, my_rows(ranked, tokens, 0), bs), tokens, order, ranked)

    def takes_catch_up(self, hb: HostBatch) -> bool:
        return False  # V4's set: not under --dp-size

    def __getattr__(self, name):
        return getattr(self.graphs, name)


def dp_spec_graphs_refusal(model_type: str) -> Optional[str]:
    """Why this model's speculative steps are not captured per rank under --dp-size (None: they are)."""
    if model_type in ("deepseek_v3", "deepseek_v2"):
        return None
    return f"speculative steps not yet captured per rank under --dp-size for model_type {model_type!r} (run eagerly)"


def capture_dp_spec(spec, pool, group, pages_per_rank: int) -> bool:
    """Rank 0, at start-up: every rank captures its speculative sets together (OP_CAPTURE, the
    agreement after every bucket), all keep them or none."""
    from dsv4_engine.spec_decode.graphs import capture_here

    why = dp_spec_graphs_refusal(spec.runner.model_type)
    if why is not None:
        spec.runner.drop_graphs(why)
        return False
    spec.graphs_class = DPSpecGraphs  # what capture_here builds (the other ranks: worker.py)
    held = []

    def capture(agree) -> bool:
        held.append(capture_here(spec, pool, agree))
        return held[-1] is not None

    if group.capture_graphs(spec.runner.cuda_graph_max_bs, capture, "speculative"):
        spec.graphs = RankZeroDPSpecGraphs(held[0], group, pages_per_rank, pool.num_slots)
        return True
    spec.runner.drop_graphs("another rank could not capture its speculative graphs")
    return False
