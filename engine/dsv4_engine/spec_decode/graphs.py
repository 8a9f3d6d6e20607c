"""The speculator's decode-shaped steps replayed from captured CUDA graphs.

On V3 a verify step is a decode step: the speculator runs every token as a one-token row of its
own (`MTPSpeculator._batch`), so a batch of requests that each verify their last token and up to
k drafts is a decode batch of T = sum(1 + drafts) rows, whatever each request drafted. The same
holds for the MTP block's catch-up over the positions a step made valid (1..k+1 rows a request)
and for each of the k-1 chained draft steps (one row a request). So each is a
`cuda_graphs.DecodeGraphs` over rows, with its own buckets of row counts:

- `verify`: the target's final-normed hidden states at every row (the graph ends before the
  head: the host then takes the logits of the rows that verify, one matmul);
- `draft`: the MTP block's output hidden state at every row, reading the hidden states its tokens
  follow from one more static buffer, `prev` (its logits, one norm and one matmul, run after).

Padding rows repeat row 0 (its token, position, KV slot, slot row and, for the draft, its `prev`
row), so they write what row 0 writes, as the plain decode graphs do. Accepting, rejecting and
drafting stay on the host after the replays; prefill chunks and steps longer than the largest
bucket run eagerly.

DeepSeek-V4 runs a request's verify rows whole (its rings are read before a step's writes): an
extend, captured at a fixed shape (`ExtendGraphs`, the forward in dsv4_engine.layers.v4_verify):
over the plain decode buckets counted in requests, each request k + 1 rows, its real tokens
(1..k+1: fewer drafts near max_tokens or a prefix-cache boundary) then padding tokens after them,
whose writes the model masks (`pad_extend`); the replay's rows of real tokens come back in the
step's order. A step with a longer chunk, snapshots inside a chunk, or more requests than the
largest bucket runs eagerly. The MTP block's catch-up over 1..k+1 positions a request is a
third set, `catch_up`, of the same shape (`prev_ext` holds the streams it reads, padded alike).
Its chained draft steps (k-1 of them a step, one row a request, the MTP block's sliding-window
ring as a slot state) are captured over the same buckets, `prev` holding the block's [hc, hidden]
residual streams.

At --tp-size > 1 every rank captures the same sets over the same buckets, together, agreeing
after every bucket (`capture_here` with the group's `agree`, as the plain decode graphs), and
rank 0 announces each replay to the others (dsv4_engine.parallel.spec.BroadcastSpecGraphs): the
forwards captured here are the local, unbroadcast ones, whose all-reduces the graphs hold.

Capture safety is checked on CPU by tests/unit/engine/test_spec_graphs.py and
test_spec_graphs_v4_verify.py, as test_cuda_graphs.py checks the plain decode step; the
replay at tp 2 by tests/unit/parallel/test_tp_spec_graphs.py.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from dsv4_engine.batch_buffers import HostBatch, host_batch
from dsv4_engine.cuda_graphs import Agree, DecodeGraphs, StaticDecodeInputs, alone, bucket_for, graph_buckets
from dsv4_engine.devices import use_device
from dsv4_engine.models.forward_batch import ForwardBatch

log = logging.getLogger("dsv4.engine")


def spec_buckets(max_bs: int, k: int) -> list[int]:
    """Row counts with a captured graph: the decode buckets (a chained draft step has one row a
    request) and each of them times k+1 (a verify step where every request has k drafts)."""
    base = graph_buckets(max_bs)
    return sorted(set(base) | {b * (k + 1) for b in base})


def widened(hb: HostBatch, width: int) -> HostBatch:
    """hb with its block table `width` columns wide (zeros past each row's pages)."""
    have = hb.block_table.shape[1]
    if have == width:
        return hb
    table = np.zeros((hb.block_table.shape[0], width), dtype=hb.block_table.dtype)
    table[:, :have] = hb.block_table
    return HostBatch(
        input_ids=hb.input_ids,
        positions=hb.positions,
        slot_mapping=hb.slot_mapping,
        block_table=table,
        seq_lens=hb.seq_lens,
        extend_lens=hb.extend_lens,
        logits_indices=hb.logits_indices,
        slot_ids=hb.slot_ids,
    )


TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")  # one per token; the rest one per request


def pad_extend(hb: HostBatch, bucket: int, n: int, rows: bool = False):
    """hb (requests of 1..n tokens) as `bucket` requests of n rows each: a request's real tokens,
    then padding tokens at the positions after them (the id and KV slot of its last token; the
    model masks their writes by `seq_lens`, the real run's end); requests past hb's repeat
    request 0 whole, so they write what it writes. extend_lens is n for every request.
    rows=True: only the row of hb each padded row copies, [bucket * n]."""
    lens = hb.extend_lens.astype(np.int64)
    row0 = np.cumsum(lens) - lens
    take = np.concatenate([np.arange(lens.shape[0]), np.zeros(bucket - lens.shape[0], dtype=np.int64)])
    j = np.arange(n)
    src = (row0[:, None] + np.minimum(j, lens[:, None] - 1))[take].reshape(-1)  # [bucket * n] token rows
    if rows:
        return src
    return HostBatch(
        input_ids=hb.input_ids[src],
        positions=(hb.positions[row0][:, None] + j)[take].reshape(-1),
        slot_mapping=hb.slot_mapping[src],
        block_table=hb.block_table[take],
        seq_lens=hb.seq_lens[take],
        extend_lens=np.full(bucket, n, dtype=hb.extend_lens.dtype),
        logits_indices=np.arange(bucket, dtype=np.int64) * n + n - 1,
        slot_ids=None if hb.slot_ids is None else hb.slot_ids[take],
    )


def real_rows(hb: HostBatch, n: int) -> np.ndarray:
    """The rows of a `pad_extend`ed step that hold hb's tokens, in hb's order."""
    lens = hb.extend_lens.astype(np.int64)
    b = np.repeat(np.arange(lens.shape[0]), lens)
    return b * n + np.arange(b.shape[0]) - (np.cumsum(lens) - lens)[b]


class StaticExtendInputs(StaticDecodeInputs):
    """The static buffers of an extend step of n tokens a request: the token fields n times
    longer than the request fields."""

    def __init__(self, max_bs: int, n: int, width: int, device: torch.device):
        super().__init__(max_bs, width, device)
        self.n = n
        for k in TOKEN_FIELDS:
            self.dev[k] = torch.zeros(max_bs * n, dtype=self.FIELDS[k], device=device)
            self.host[k] = torch.zeros(max_bs * n, dtype=self.FIELDS[k], pin_memory=device.type == "cuda")
        self.dev["extend_lens"].fill_(n)

    def view(self, bs: int) -> dict[str, torch.Tensor]:
        return {k: v[: bs * self.n] if k in TOKEN_FIELDS else v[:bs] for k, v in self.dev.items()}


class ExtendGraphs(DecodeGraphs):
    """DecodeGraphs over steps of requests with 1..n tokens each (a V4 verify step: the last
    token and up to k drafts), each run as n rows (`pad_extend`), buckets counted in requests;
    a step's output has a row per token of the step."""

    def __init__(self, run_forward, n: int, page_size: int, width: int, device, capture: bool, buckets: list[int]):
        super().__init__(run_forward, buckets[-1], width, device, capture, buckets)
        self.n, self.page_size = n, page_size
        self.inputs = StaticExtendInputs(buckets[-1], n, width, device)

    def takes(self, hb: HostBatch) -> bool:
        """Every request has 1..n tokens, there are few enough with few enough pages, and every
        padded run stays within the block table (its padding tokens' entries are looked up)."""
        lens = hb.extend_lens
        starts = hb.seq_lens.astype(np.int64) - lens
        return (
            bool(((lens >= 1) & (lens <= self.n)).all())
            and bool((starts + self.n <= self.width * self.page_size).all())
            and self.fits(lens.shape[0], hb.block_table.shape[1])
        )

    def step(self, hb: HostBatch) -> torch.Tensor:
        """Output rows of hb's tokens (padding rows dropped): an index copy of the graph's output."""
        out = super().step(hb)
        if bool((hb.extend_lens == self.n).all()):
            return out
        return out[torch.as_tensor(real_rows(hb, self.n), device=out.device)]

    def _padded(self, hb: HostBatch, bs: int) -> HostBatch:
        return pad_extend(hb, bs, self.n)

    def _warmup(self) -> HostBatch:
        """Request 0 at positions 0 .. n-1 of page 0 (every column of its table page 0), slot row
        0: it writes only there, zeroed after capturing."""
        pages = [0] * max(1, -(-self.n // self.page_size))
        return host_batch([0], [self.n], [pages], [[0] * self.n], [0], self.page_size, self.width)

    def _out_rows(self, hb: HostBatch) -> int:
        return hb.seq_lens.shape[0] * self.n


def supported(spec) -> bool:
    """The speculator's steps are capturable: DeepSeek-V3 or V4, at any --tp-size."""
    return spec.runner.model_type in ("deepseek_v3", "deepseek_v4")


class SpecGraphs:
    """Verify and draft forwards over one-token rows, one graph per row bucket of each.

    With capture=False (CPU, tests) the same padded steps run eagerly on the same static buffers:
    what the tests check is what the graphs would replay."""

    def __init__(self, spec, page_size: int, num_pages: int, max_bs: int, capture: bool):
        runner = spec.runner
        self.spec = spec
        self.states: dict[str, torch.Tensor] = {}  # the pool's tensors, which the graphs read
        cfg = runner.cfg
        width = max(1, min(num_pages, -(-cfg.max_position_embeddings // page_size)))
        v3 = runner.model_type == "deepseek_v3"
        buckets = spec_buckets(max_bs, spec.k) if v3 else graph_buckets(max_bs)
        dev = runner.device
        streams = () if v3 else (cfg.hc_mult,)  # V4's MTP block reads [hc, hidden] residual streams
        self.prev = torch.zeros(buckets[-1], *streams, cfg.hidden_size, dtype=runner.dtype, device=dev)
        # This process's own forwards: at tp > 1 rank 0's spec.target / spec.mtp send each eager
        # forward to the other ranks first, but a captured step runs the local ones on every rank.
        local_target, mtp = spec.local_target, spec.local_mtp
        target = local_target.model
        slots = runner.has_slot_states

        def fb_of(t: dict[str, torch.Tensor]) -> ForwardBatch:
            return ForwardBatch.of_tensors(t, page_size, all_decode=True, slots=slots)

        def run_verify(t: dict[str, torch.Tensor], bs: int) -> torch.Tensor:
            return target.hidden_states(fb_of(t), self.states)

        def run_draft(t: dict[str, torch.Tensor], bs: int) -> torch.Tensor:
            if v3:
                x, residual = mtp.body(fb_of(t), self.states, self.prev[:bs])
                return x + residual
            return mtp.body(fb_of(t), self.states, self.prev[:bs])

        def run_verify_v4(t: dict[str, torch.Tensor], bs: int) -> torch.Tensor:
            fb = ForwardBatch.of_tensors(t, page_size, all_decode=False, slots=True)
            return local_target.hidden(fb, self.states, fixed=spec.k + 1)

        def run_catch_up(t: dict[str, torch.Tensor], bs: int) -> torch.Tensor:
            fb = ForwardBatch.of_tensors(t, page_size, all_decode=False, slots=True)
            return mtp.body(fb, self.states, self.prev_ext[: bs * (spec.k + 1)], fixed=spec.k + 1)

        self.catch_up: Optional[ExtendGraphs] = None  # V4: the MTP block over 1..k+1 positions a request
        if v3:
            self.verify = DecodeGraphs(run_verify, buckets[-1], width, dev, capture, buckets)
        else:  # requests of k + 1 tokens each, over the plain decode buckets
            n = spec.k + 1
            self.verify = ExtendGraphs(run_verify_v4, n, page_size, width, dev, capture, buckets)
            self.catch_up = ExtendGraphs(run_catch_up, n, page_size, width, dev, capture, buckets)
            self.catch_up.name = "speculative catch-up"
        self.prev_ext = torch.zeros(
            buckets[-1] * (spec.k + 1) if not v3 else 0, *streams, cfg.hidden_size, dtype=runner.dtype, device=dev
        )  # the catch-up's `prev`, k + 1 rows a request
        self.draft = DecodeGraphs(run_draft, buckets[-1], width, dev, capture, buckets)
        self.draft.name = "speculative draft"
        self.verify.name = "speculative verify"
        self.buckets, self.width = buckets, width

    @property
    def sets(self) -> list[DecodeGraphs]:
        return [g for g in (self.verify, self.draft, self.catch_up) if g is not None]

    @property
    def captured(self) -> bool:
        return all(g.captured for g in self.sets)

    def fits(self, hb: HostBatch, verify: bool = False) -> bool:
        """A step a graph can run: one-token rows, few enough, pages within the width; a V4
        verify step: every request with k + 1 tokens (`ExtendGraphs.takes`)."""
        if verify and isinstance(self.verify, ExtendGraphs):
            return self.verify.takes(hb)
        return hb.input_ids.shape[0] <= self.buckets[-1] and hb.block_table.shape[1] <= self.width

    @property
    def verifies_extends(self) -> bool:
        """The verify graph takes whole requests (V4), not one-token rows (V3)."""
        return isinstance(self.verify, ExtendGraphs)

    def hidden(self, hb: HostBatch, pool) -> torch.Tensor:
        """The target's hidden states [T, hidden] at hb's rows (V4: streams [T, hc, hidden]; a
        view of the graph's output: valid until the next verify replay)."""
        self.states = pool.all_states
        return self.verify.step(hb)  # the used width only (StaticDecodeInputs.load)

    def draft_hidden(self, hb: HostBatch, prev: torch.Tensor, pool) -> torch.Tensor:
        """The MTP block's output hidden states [T, hidden] (V4: streams [T, hc, hidden]) at hb's
        rows, prev the same shape, what their tokens follow (a view: valid until the next draft
        replay)."""
        self.states = pool.all_states
        n = hb.input_ids.shape[0]
        bs = bucket_for(n, self.buckets)
        self.prev[:n].copy_(prev)
        self.prev[n:bs].copy_(prev[:1].expand(bs - n, *prev.shape[1:]))  # padding rows repeat row 0
        return self.draft.step(hb)

    def takes_catch_up(self, hb: HostBatch) -> bool:
        """A V4 catch-up of 1..k+1 positions a request the catch-up graph can run."""
        return self.catch_up is not None and self.catch_up.takes(hb)

    def catch_up_hidden(self, hb: HostBatch, prev: torch.Tensor, pool) -> torch.Tensor:
        """The MTP block's output streams [T, hc, hidden] at hb's rows (1..k+1 a request), prev
        the same shape, the target's streams its tokens follow (a view or a gathered copy: valid
        until the next catch-up replay). prev goes to the padded layout: a padding token takes
        its request's last row, a padding request request 0's rows (it writes what 0 writes)."""
        self.states = pool.all_states
        g = self.catch_up
        b = hb.extend_lens.shape[0]
        bs = bucket_for(b, g.buckets)
        src = pad_extend(hb, bs, g.n, rows=True)
        self.prev_ext[: bs * g.n].copy_(prev[torch.as_tensor(src, device=prev.device)])
        return g.step(hb)

    def capture_all(self, pool, agree: Agree = alone) -> Optional[str]:
        """Capture every bucket of every set, all or none; None, or why not in one line. Call on
        a fresh pool: the warm-ups write page 0 (and row 0 of prev), zeroed again after. `agree`:
        the group's verdict after each bucket (every rank stops at the same one, and then skips
        the remaining sets alike, since all hold the same failure line)."""
        self.states = pool.all_states
        failure = None
        for g in self.sets:
            failure = failure or g.capture_all(agree)
        with torch.no_grad():
            for t in pool.all_states.values():
                t.zero_()
            self.prev.zero_()
            self.prev_ext.zero_()
        if failure is not None:
            for g in self.sets:
                g.graphs.clear()
                g.outputs.clear()
                g.pool = None
        return failure


def capture_here(spec, pool, agree: Agree = alone) -> Optional[SpecGraphs]:
    """This rank's capture of the speculator's steps, over the runner's --cuda-graph-max-bs
    (at tp > 1 every rank calls it together, `agree` the group's verdict after each bucket):
    the captured graphs, or None with the reason in `runner.graphs_off` and the log. A rank that
    cannot capture at all still votes, no, at the first bucket, so the others stop there too."""
    runner = spec.runner
    if not runner.cuda_graph_max_bs or not supported(spec):
        if runner.graphs_off is None:
            runner.graphs_off = f"speculative steps of {runner.model_type} are not captured"
        if agree is not alone:
            agree(f"CUDA graphs off on this rank: {runner.graphs_off}")
        return None
    use_device(runner.device)  # captures on this thread's current device
    # --dp-size N: the data-parallel sets (parallel.dp_spec_graphs), set where the speculator is made
    graphs_class = getattr(spec, "graphs_class", SpecGraphs)
    graphs = graphs_class(spec, pool.page_size, pool.num_pages, runner.cuda_graph_max_bs, capture=True)
    failure = graphs.capture_all(pool, agree)
    if failure is not None:
        log.warning("CUDA graphs off: %s", failure)
        runner.graphs_off = failure
        return None
    if not graphs.captured:  # not a CUDA device after all: nothing to replay
        runner.graphs_off = "nothing captured on this device"
        return None
    return graphs


def capture_spec_graphs(spec, pool) -> bool:
    """At start-up with --cuda-graph-max-bs, at --tp-size 1: capture the speculator's verify and
    draft steps (instead of the plain decode step, which a speculating engine never runs). False,
    with one line saying why, when they run eagerly (tp > 1: parallel.spec.capture_on_every_rank)."""
    if not spec.runner.cuda_graph_max_bs:
        return False  # CPU, the torch backend or a model that is not capture-safe: said at start
    spec.graphs = capture_here(spec, pool)
    return spec.graphs is not None
