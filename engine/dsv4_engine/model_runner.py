"""Turns a scheduled step into tensors, runs the model and samples one token per request that
reached its last known token."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch

from dsv4_engine.batch_buffers import BatchBuffers, HostBatch, host_batch
from dsv4_engine.cuda_graphs import Agree, DecodeGraphs, alone
from dsv4_engine.devices import resolve, use_device
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.kv_quant import with_kv_cache_dtype
from dsv4_engine.models import entry_for_dir
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.models.state import StateSpec
from dsv4_engine.sampling import Sampled, sample
from dsv4_engine.scheduler import ScheduledSeq
from dsv4_engine.step_phases import PHASES
from dsv4_engine.weights import load_weights

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> str:
    """bfloat16 on CUDA (tensor cores, half the weights and KV of float32; the kernels' AOT list
    is compiled for it), float32 on CPU (where the oracle tests compare at fp32 tolerances)."""
    return "bfloat16" if device.type == "cuda" else "float32"


def default_kernel_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "cpu"


def kernel_summary(backend: str, implementations: dict[str, str]) -> str:
    from dsv4_kernels.ops_torch import summary

    return summary(backend, implementations)


def get_ops(backend: str):
    """The kernel API object of `backend`, built once per engine (dsv4_kernels.api.get_ops)."""
    from dsv4_kernels.api import get_ops as kernels_get_ops

    return kernels_get_ops(backend)


def _new_tokens(seq, start: int, n: int) -> list[int]:
    """Token ids start..start+n-1 of a request (list slices: no per-token Python loop)."""
    p = len(seq.prompt_ids)
    if start >= p:
        return seq.output_ids[start - p : start - p + n]
    return seq.prompt_ids[start : start + n] + seq.output_ids[: max(0, start + n - p)]


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: Optional[str] = None,
        device: Optional[str] = None,
        kernel_backend: Optional[str] = None,
        cuda_graph_max_bs: int = 0,
        tp=None,
        kv_cache_dtype: Optional[str] = None,
        ep_redundant_experts: int = 0,
        ep_loads_file: Optional[str] = None,
    ):
        entry = entry_for_dir(model_dir)
        self.model_type = entry.model_type
        self.cfg = entry.config_class().from_dir(model_dir)
        model_cls = entry.model_class()
        # the model's states, its attention KV stored as --kv-cache-dtype says (dsv4_engine.kv_quant)
        self.state_specs: list[StateSpec] = with_kv_cache_dtype(model_cls.state_specs(self.cfg), kv_cache_dtype)
        self.device = resolve(torch.device(device) if device else default_device())
        use_device(self.device)  # the thread that builds the model may launch (weight prep, capture)
        self.dtype = DTYPES[dtype or default_dtype(self.device)]
        self.kernel_backend = kernel_backend or default_kernel_backend(self.device)
        if tp is None:
            self.model = model_cls(
                self.cfg, load_weights(model_dir), get_ops(self.kernel_backend), self.dtype, self.device
            )
        else:  # one rank of --tp-size N: its own slice of the weights only (dsv4_engine.parallel)
            from dsv4_engine.parallel.sharded import build_sharded

            self.model = build_sharded(
                model_cls,
                self.model_type,
                self.cfg,
                model_dir,
                get_ops(self.kernel_backend),
                self.dtype,
                self.device,
                tp,
            )
        # Expert load counters, and the experts' placement with --ep-redundant-experts (EPLB)
        from dsv4_engine.parallel.eplb_apply import attach_eplb

        self.eplb = attach_eplb(self.model, model_dir, ep_redundant_experts, ep_loads_file)
        # Which implementation each op runs, and why (the start-up log, /v1/loads `kernels`)
        ops = self.model.ops
        self.kernel_ops: dict[str, str] = ops.implementations()
        self.native_build_failures = ops.build_failures()
        self.kernel_summary = kernel_summary(self.kernel_backend, self.kernel_ops)
        log.info("kernels %s", self.kernel_summary)
        # The model this process computes with; `self.model` may be wrapped (rank 0 of a TP group
        # broadcasts each eager step first), but a captured step runs this one on every rank.
        self.local_model = self.model
        self.group = None  # rank 0's TPGroup at --tp-size > 1: captured steps reach the other ranks through it
        # DeepSeek-V4 (the models with slot states) pads a prefill/mixed step to its longest
        # chunk, so a mixed step runs as two forwards, decodes then the rest: decode rows are
        # never padded to a prefill chunk's length.
        self.has_slot_states = any(not spec.paged for spec in self.state_specs)
        self.decode_apart = self.has_slot_states
        self.buffers = BatchBuffers(self.device)
        # What min_tokens holds back besides stop_token_ids (the engine adds its tokenizer's).
        self.eos_ids: list[int] = list(self.cfg.eos_token_ids)
        # Captured decode graphs: CUDA, the Triton backend (the torch backend's MoE reads expert
        # counts on the host) and a model whose decode forward is capture-safe (V3, V4).
        self.cuda_graph_max_bs = cuda_graph_max_bs if self.graphs_supported() else 0
        # Why decodes run eagerly (None: graphs on), for the log and /v1/loads.
        self.graphs_off: Optional[str] = None if cuda_graph_max_bs else "--cuda-graph-max-bs 0"
        if cuda_graph_max_bs and not self.cuda_graph_max_bs:
            self.graphs_off = "need a CUDA device, the triton kernel backend and a capture-safe model"
            log.info("CUDA graphs off: %s", self.graphs_off)
        self.graphs: Optional[DecodeGraphs] = None
        self._states: dict[str, torch.Tensor] = {}  # the pool's tensors, which a captured graph reads
        self._masks = None  # structured outputs' MaskFiller, made when a request first has a grammar
        self.snapshot_states: Optional[dict[str, torch.Tensor]] = None  # the prefix cache's (V4)

    def graphs_supported(self) -> bool:
        return (
            self.device.type == "cuda"
            and self.kernel_backend == "triton"
            and getattr(self.model, "CUDA_GRAPH_SAFE", False)
        )

    def decode_graphs(self, page_size: int, num_pages: int, capture: bool = True) -> DecodeGraphs:
        """The graphs for this runner (made on first use): block tables as wide as the most
        pages one request can hold."""
        if self.graphs is None:
            width = max(1, min(num_pages, -(-self.cfg.max_position_embeddings // page_size)))
            max_bs = self.cuda_graph_max_bs or 8

            def run_forward(t: dict[str, torch.Tensor], bs: int) -> torch.Tensor:
                fb = ForwardBatch.of_tensors(t, page_size, all_decode=True, slots=self.has_slot_states)
                return self.local_model.forward(fb, self._states)

            self.graphs = DecodeGraphs(run_forward, max_bs, width, self.device, capture)
        return self.graphs

    def enable_graphs(self, max_bs: int) -> None:
        """Another rank of a TP group: rank 0 says which buckets to capture."""
        self.cuda_graph_max_bs = max_bs if self.graphs_supported() else 0
        self.graphs_off = (
            None if self.cuda_graph_max_bs else "need a CUDA device, the triton kernel backend and a capture-safe model"
        )

    def capture_graphs(self, pool: KVPool, agree: Agree = alone) -> bool:
        """Capture every decode bucket now, at start-up, before any request: all or none, on
        every rank (`agree`: the group's verdict after each bucket). A failure drops them all
        and says why in one line; decodes then run eagerly. Call on a fresh pool (all zeros):
        the warm-up forwards write page 0 and slot row 0, zeroed again."""
        if not self.cuda_graph_max_bs:
            if agree is not alone:  # asked by rank 0 all the same: vote no at its first batch size, as one
                agree(f"CUDA graphs off on this rank: {self.graphs_off}")
            return False
        use_device(self.device)  # captures on this thread's current device
        self._states = pool.all_states
        graphs = self.decode_graphs(pool.page_size, pool.num_pages)
        failure = graphs.capture_all(agree)
        with torch.no_grad():
            for t in pool.all_states.values():
                t.zero_()
        if failure is not None or not graphs.captured:
            if failure is not None:
                log.warning("CUDA graphs off, decodes run eagerly: %s", failure)
            self.drop_graphs(failure or "nothing captured on this device")
            return False
        return True

    def drop_graphs(self, why: str = "another rank could not capture its decode graphs") -> None:
        self.graphs = None
        self.cuda_graph_max_bs = 0
        if self.graphs_off is None:
            self.graphs_off = why

    def graphs_status(self, spec_graphs=None) -> dict:
        """What /v1/loads says of the decode graphs (a speculator's when it has them): on, with
        their batch sizes, or why decodes run eagerly."""
        g = spec_graphs if spec_graphs is not None else self.graphs
        on = g is not None and g.captured and bool(self.cuda_graph_max_bs)
        return {"enabled": on, "batch_sizes": list(g.buckets) if on else [], "eager_reason": self.graphs_off}

    def host_batch(self, batch: list[ScheduledSeq], page_size: int, width: Optional[int] = None) -> HostBatch:
        starts = [b.seq.num_computed for b in batch]
        news = [b.num_new for b in batch]
        tokens = [_new_tokens(b.seq, s, n) for b, s, n in zip(batch, starts, news)]
        return host_batch(
            starts, news, [b.seq.pages for b in batch], tokens, [b.seq.slot for b in batch], page_size, width
        )

    def build_batch(self, batch: list[ScheduledSeq], page_size: int) -> ForwardBatch:
        """The step's tensors, computed over all requests at once (no per-token loop) and
        copied into persistent device buffers without waiting on the device."""
        hb = self.host_batch(batch, page_size)
        news = hb.extend_lens.tolist()
        t = self.buffers.upload(hb)
        snapshots = [(k, pos, snap) for k, b in enumerate(batch) for pos, snap in b.snapshots] or None
        all_decode = all(n == 1 for n in news)
        if not all_decode:
            PHASES.decode = False
        fb = ForwardBatch.of_tensors(
            t, page_size, all_decode, seq_lens_host=hb.seq_lens.tolist(), extend_lens_host=news
        )
        fb.snapshots = snapshots
        fb.snapshot_states = self.snapshot_states if snapshots else None
        PHASES.lap("batch_build")
        return fb

    def forward(self, batch: list[ScheduledSeq], pool: KVPool) -> torch.Tensor:
        """Logits of each request's last new token, [len(batch), vocab], in batch order."""
        decodes = [i for i, b in enumerate(batch) if b.num_new == 1]
        if len(decodes) == len(batch):
            graphed = self._graph_forward(batch, pool)
            if graphed is not None:
                return graphed
        if not self.decode_apart or not decodes or len(decodes) == len(batch):
            return self.model.forward(self.build_batch(batch, pool.page_size), pool.all_states)
        # A mixed step of a model that runs its decode rows apart (V4): those rows replay the
        # decode graphs when they fit, as an all-decode step would, instead of ~300 eager ops a layer.
        others = [i for i, b in enumerate(batch) if b.num_new != 1]
        out: list[torch.Tensor] = [None] * len(batch)  # type: ignore[list-item]
        for rows in (decodes, others):
            sub = [batch[i] for i in rows]
            logits = self._graph_forward(sub, pool) if rows is decodes else None
            if logits is None:
                logits = self.model.forward(self.build_batch(sub, pool.page_size), pool.all_states)
            for j, i in enumerate(rows):
                out[i] = logits[j]
        return torch.stack(out)

    def _graph_forward(self, batch: list[ScheduledSeq], pool: KVPool) -> Optional[torch.Tensor]:
        """Logits of an all-decode batch replayed from the captured graphs, or None when it does
        not fit them (no graphs, too many rows or pages, a snapshot to write in the forward).
        The logits are the graph's static output: read them before the next replay."""
        graphs = self.graphs
        if not (
            self.cuda_graph_max_bs
            and graphs is not None
            and graphs.captured
            and graphs.fits(len(batch), max(len(b.seq.pages) for b in batch))
            and not any(b.snapshots for b in batch)
        ):
            return None
        self._states = pool.all_states
        hb = self.host_batch(batch, pool.page_size)  # the used width only (StaticDecodeInputs.load)
        PHASES.lap("batch_build")
        if self.group is None:  # one rank, or --dp-size N (whose graphs send each step themselves)
            out = graphs.step(hb)
            PHASES.lap("graph_replay")
            return out
        with self.group.step("a captured decode step on rank 0"):
            self.group.send_graph_step(hb)  # host arrays: no read of the device for the header
            return graphs.step(hb)

    def grammar_masks(self, seqs: list):
        """This step's token masks for the requests with structured output (None: no such request)."""
        if not any(s.grammar is not None for s in seqs):
            return None
        if self._masks is None:
            from dsv4_engine.structured.bitmask import MaskFiller

            self._masks = MaskFiller(self.cfg.vocab_size, self.device, self.eos_ids)
        return self._masks.fill(seqs)

    def step(self, batch: list[ScheduledSeq], pool: KVPool) -> list[Union[Sampled, Exception, None]]:
        """Forward the step (a forward failure raises: it fails the batch). For each request that
        samples: a Sampled, or the exception its row raised (it fails that request alone);
        None for the others."""
        logits = self.forward(batch, pool)
        rows = [i for i, b in enumerate(batch) if b.samples]
        results: list[Union[Sampled, Exception, None]] = [None] * len(batch)
        if rows:
            seqs = [batch[i].seq for i in rows]
            # Grammar masks are filled on the CPU here, while the device still runs the forward.
            mask = self.grammar_masks(seqs)
            picked = sample(
                logits[rows], [s.params for s in seqs], [s.generator for s in seqs], seqs, self.eos_ids, mask
            )
            for i, r in zip(rows, picked):
                results[i] = r
        PHASES.lap("sampling")
        return results
