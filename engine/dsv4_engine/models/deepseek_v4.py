"""DeepSeek-V4 forward pass over engine-held per-request state (no growing tensors).

Architecture (transformers' `DeepseekV4ForCausalLM` is the oracle): shared-KV MQA (one KV head,
K == V) with q LoRA, attention sinks and a grouped low-rank output projection; three attention
layer types (sliding window; CSA = window + top-k of compressed entries chosen by a lightning
indexer; HCA = window + every compressed entry); mHC residual streams; MoE with sqrt-softplus
routing, hash-routed in the first layers.

Per-request state (`state_specs`), all of it fixed-size per request or paged by entry number:

  name             kind   layers  entries per request           entry
  swa_kv           slot   all     sliding_window (ring, pos % W) head_dim: kv of a token
  csa_kv           paged  CSA     one per csa_rate tokens        head_dim: compressed kv entry
  csa_index_k      paged  CSA     one per csa_rate tokens        index_head_dim: indexer key
  hca_kv           paged  HCA     one per hca_rate tokens        head_dim: compressed kv entry
  csa_stage        slot   CSA     2*csa_rate (ring, pos % 2r)    4*head_dim: [kv | gate] projections
  csa_index_stage  slot   CSA     2*csa_rate (ring)              4*index_head_dim: the indexer's
  hca_stage        slot   HCA     hca_rate (ring, pos % r)       2*head_dim: [kv | gate]

A "slot" state is one row per running request ([max_requests, layers, slots, *entry]) found
by `V4Batch.slot_ids`; the engine hands a row out at admission and takes it back on finish,
abort or preemption (a row needs no clearing: every read is masked by position). A "paged"
state is page-major ([num_pages, layers, entries_per_page, *entry]) and shares the request's
page ids: compressed entry w lives in the page of its window's first token, block_table[w * rate
// page_size] (`StateSpec.entry_location`), so any page size works, 128-token HCA windows included.

What it costs, v4-flash-shape in bf16 (one layer of each type): paged state 328 B per token
(csa_kv 256, csa_index_k 64, hca_kv 8) where DeepSeek-V3's 576-wide latent costs 3456 B over 3
layers; slot rows 680 KiB per running request (swa_kv 384, hca_stage 256, CSA stages 40).

Why these shapes: a query at t sees keys (t - W, t], so the ring holds the last W tokens' kv
(read before this step's tokens overwrite it). A compressed entry closes when the last token of
its window arrives; CSA entry w also needs window w-1's first series, so its stage ring keeps
two windows of raw projections; HCA keeps one. A chunk may split anywhere: whatever of a window
arrived in earlier steps is read back from the stage ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_engine.layers import v4_step
from dsv4_engine.layers.hyper_connections import HyperConnection, HyperHead
from dsv4_engine.layers.moe import V4MoE
from dsv4_engine.layers.v4_attention import V4Attention
from dsv4_engine.layers.v4_step import V4Backend, V4Step
from dsv4_engine.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_engine.models.deepseek_v4_weights import load_v4_weights, to_release_layout
from dsv4_engine.models.forward_batch import ForwardBatch, V4Batch, request_spans
from dsv4_engine.models.state import StateSpec
from dsv4_engine.quant import dense, log_resident, moe_experts_for, place
from dsv4_engine.step_phases import PHASES
from dsv4_kernels.api import get_ops

__all__ = ["SLIDING", "DeepseekV4", "V4Layer", "allocate_states"]


@dataclass
class V4Layer:
    """One transformer layer: mHC around attention and around the MoE."""

    hc_attn: HyperConnection
    attn_norm: torch.Tensor
    attn: V4Attention
    hc_ffn: HyperConnection
    ffn_norm: torch.Tensor
    ffn: V4MoE


class DeepseekV4:
    """Weights plus the forward pass; every per-request state lives in engine-owned tensors."""

    SWA_KV = v4_step.SWA_KV
    CSA_KV = v4_step.CSA_KV
    CSA_INDEX_K = v4_step.CSA_INDEX_K
    HCA_KV = v4_step.HCA_KV
    CSA_STAGE = v4_step.CSA_STAGE
    CSA_INDEX_STAGE = v4_step.CSA_INDEX_STAGE
    HCA_STAGE = v4_step.HCA_STAGE
    # On the kernel path a decode step given without host lengths closes windows masked, reads
    # nothing back and keeps its shapes: it may be captured in a CUDA graph
    # (tests/unit/engine/test_cuda_graphs.py). The torch path is not (its MoE reads expert ids).
    CUDA_GRAPH_SAFE = True

    @classmethod
    def state_specs(cls, cfg: DeepseekV4Config) -> list[StateSpec]:
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        n_csa, n_hca = len(cfg.layers_of(CSA)), len(cfg.layers_of(HCA))
        # quantizable: attention KV read and written through dsv4_engine.kv_quant (--kv-cache-dtype)
        specs = [
            StateSpec(cls.SWA_KV, cfg.num_hidden_layers, (hd,), kind="slot", slots=cfg.sliding_window, quantizable=True)
        ]
        if n_csa:
            r = cfg.csa_rate
            specs += [
                StateSpec(cls.CSA_KV, n_csa, (hd,), tokens_per_entry=r, quantizable=True),
                StateSpec(cls.CSA_INDEX_K, n_csa, (ihd,), tokens_per_entry=r, quantizable=True),
                StateSpec(cls.CSA_STAGE, n_csa, (4 * hd,), kind="slot", slots=2 * r),
                StateSpec(cls.CSA_INDEX_STAGE, n_csa, (4 * ihd,), kind="slot", slots=2 * r),
            ]
        if n_hca:
            r = cfg.hca_rate
            specs += [
                StateSpec(cls.HCA_KV, n_hca, (hd,), tokens_per_entry=r, quantizable=True),
                StateSpec(cls.HCA_STAGE, n_hca, (2 * hd,), kind="slot", slots=r),
            ]
        return specs

    @staticmethod
    def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
        return load_v4_weights(model_dir)

    def __init__(
        self,
        cfg: DeepseekV4Config,
        weights: dict[str, torch.Tensor],
        ops=None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp=None,
    ):
        self.cfg = cfg
        self.tp = tp  # one rank of --tp-size N: its heads and experts (dsv4_engine.parallel)
        ops = ops if ops is not None else get_ops("cpu")
        self.dtype = dtype
        self.device = torch.device(device)
        # The kernel path (attention, indexer, compressor pooling, mHC, MoE routing and experts
        # through dsv4_kernels' V4 API) runs when the backend asks for it, as the Triton one does;
        # the torch backend keeps the batched torch path, the same math tuned for the CPU
        # (dsv4_kernels.reference_v4 is its kernel-shaped twin: the kernels' oracle). Every
        # layer holds this one backend object.
        self.backend = V4Backend(cfg, ops, dtype, ops if ops.v4_kernel_path else None)
        # V4's window attention as one backend call where the backend has one for this width
        # (the CPU's C kernel: cheaper than the torch form's ~25 ops up to a few thousand wide)
        self.backend.one_call = self.kops is None and ops.v4_native_attention(
            cfg.num_attention_heads * cfg.head_dim, dtype
        )
        # The torch path writes prefix-cache snapshots at boundaries inside a chunk
        # (`save_snapshots`); on the kernel path the scheduler ends a chunk there instead.
        self.snapshots_in_forward = self.kops is None
        self.reuse_step_indices = True  # see V4Step.memo
        self.take_rows = True  # see V4Step.take
        self.inv_freq = self.backend.inv_freq
        self.inv_freq["main"] = cfg.rope_main.inv_freq().to(self.device)
        self.inv_freq["compress"] = cfg.rope_compress.inv_freq().to(self.device)
        self._build(to_release_layout(weights))  # a no-op on release names

    @property
    def ops(self):
        return self.backend.ops

    @property
    def kops(self):
        return self.backend.kops

    @kops.setter
    def kops(self, value) -> None:
        self.backend.kops = value

    @property
    def attend_in_one_call(self) -> bool:
        return self.backend.one_call

    @attend_in_one_call.setter
    def attend_in_one_call(self, value: bool) -> None:
        self.backend.one_call = value

    # ---- weights -------------------------------------------------------------------------------

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        cfg, dt, dev = self.cfg, self.dtype, self.device

        def take(name: str, dtype: Optional[torch.dtype] = dt) -> torch.Tensor:
            # fp8/fp4 weights stay quantized on CUDA (F.linear dispatches on them), dense elsewhere
            if name not in w:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return place(w[name], dev, dtype, self.ops)

        f32 = torch.float32  # mHC, norms, sinks, position biases stay fp32, as in the release
        self.moe_experts = moe_experts_for(self.ops, cfg.swiglu_limit)  # used when experts stay quantized
        self.embed = dense(take("embed.weight"), dt)
        self.head = take("head.weight")
        self.norm = take("norm.weight", f32)
        self.hc_head = HyperHead(*(take(f"hc_head_{k}", f32) for k in ("fn", "base", "scale")), self.backend)
        index = {i: j for t in (CSA, HCA) for j, i in enumerate(cfg.layers_of(t))}  # within its type's states
        self.layers = [
            self.build_layer(lambda n, d=dt, p=f"layers.{i}.": take(p + n, d), i, i, index.get(i))
            for i in range(cfg.num_hidden_layers)
        ]
        self.resident_bytes = log_resident(
            "deepseek_v4", dev, self.embed, self.head, self.norm, v4_step.held_tensors([self.hc_head, self.layers])
        )

    def build_layer(self, take, i: int, ring_layer: int, j: Optional[int], kind: Optional[str] = None) -> V4Layer:
        """Layer i of the checkpoint (take(name under `layers.{i}.`, dtype)) as a V4Layer whose
        window ring is row `ring_layer` of its states; the MTP block builds its layer here too."""
        cfg, f32 = self.cfg, torch.float32
        kind = kind or cfg.layer_types[i]
        attn_tp = self.tp if cfg.attention_tp_size > 1 else None  # heads split: partial sums to add
        hashed = i < cfg.num_hidden_layers and cfg.mlp_layer_types[i] == "hash_moe"
        return V4Layer(
            hc_attn=HyperConnection(*(take(f"hc_attn_{k}", f32) for k in ("fn", "base", "scale")), self.backend),
            attn_norm=take("attn_norm.weight", f32),
            attn=V4Attention(
                lambda n, d=self.dtype: take("attn." + n, d),
                cfg.compress_rates[kind] if kind in (CSA, HCA) else 0,
                kind == CSA,
                ring_layer,
                j,
                self.backend,
                attn_tp,
            ),
            hc_ffn=HyperConnection(*(take(f"hc_ffn_{k}", f32) for k in ("fn", "base", "scale")), self.backend),
            ffn_norm=take("ffn_norm.weight", f32),
            ffn=self.moe_layer(take, "ffn.", hashed),
        )

    # ---- MoE -----------------------------------------------------------------------------------

    def moe_layer(self, take, prefix: str, hashed: bool) -> V4MoE:
        """The MoE block of a layer (or of an MTP block) from its `{prefix}gate/experts/shared_experts`."""
        return V4MoE.build(take, prefix, self.cfg, hashed, self.ops, self.kops, self.tp, self.moe_experts)

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, fb: V4Batch | ForwardBatch, states: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits of each request's last new token, [B, vocab]."""
        if fb.slot_ids is None or fb.page_size is None:
            raise NotImplementedError(
                "DeepSeek-V4 needs a batch with slot_ids and page_size (its ring and compressor states are "
                "per-request slot rows); the engine's batch builder sets both for a model with slot states"
            )
        # A decode step without host lengths is a captured one (cuda_graphs): nothing in it may
        # depend on values, so it runs the kernel path's masked window closing instead.
        static = self.kops is not None and fb.all_decode and fb.seq_lens_host is None
        spans = None if static else request_spans(fb)
        step = self.new_step()
        rope = self.rope(fb.positions)
        x = self.embed_streams(fb.input_ids)
        for L in self.layers:
            x = self.run_layer(L, x, fb, states, spans, rope, step)
        return self.logits(x[fb.logits_indices])

    @torch.inference_mode()
    def forward_over_ranks(
        self, fb: Optional[ForwardBatch], states: dict[str, torch.Tensor], moe
    ) -> Optional[torch.Tensor]:
        """One step of one rank under data-parallel attention (dsv4_engine.parallel.dp_attention):
        its own requests' rows through embeddings, mHC, norms, attention, compressors and indexer
        against its own states; each layer's MoE through `moe(layer.ffn, h)`, which runs it over
        every rank's rows and returns this rank's. A rank with no request this step (fb None)
        still calls `moe` in every layer, with no rows. Its requests' fp32 logits, or None."""
        x = spans = rope = step = None
        if fb is not None:
            spans, step, rope = request_spans(fb), self.new_step(), self.rope(fb.positions)
            x = self.embed_streams(fb.input_ids)
        for L in self.layers:
            if fb is None:
                moe(L.ffn, torch.zeros(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device))
                continue
            x, h, post, comb = self.attend(L, x, fb, states, spans, rope, step)
            m = moe(L.ffn, h)
            PHASES.lap("moe")
            x = L.hc_ffn.expand(x, m, post, comb)
        return None if fb is None else self.logits(x[fb.logits_indices])

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings as the hc_mult residual streams [T, hc, D]."""
        x = F.embedding(input_ids, self.embed)
        x = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        PHASES.lap("embed")
        return x

    def new_step(self) -> V4Step:
        """What one step computes once for all of its layers."""
        return V4Step(self.reuse_step_indices, self.take_rows)

    def rope(self, positions: torch.Tensor, names=("main", "compress")) -> dict:
        return {name: self.ops.rope_table(positions, self.inv_freq[name]) for name in names}

    def run_layer(self, L: V4Layer, x: torch.Tensor, fb, states: dict, spans, rope: dict, step: V4Step) -> torch.Tensor:
        """Streams x [T, hc, D] through one layer: mHC, norm, attention, mHC, norm, MoE, mHC."""
        x, h, post, comb = self.attend(L, x, fb, states, spans, rope, step)
        m = L.ffn(h, fb.input_ids)
        PHASES.lap("moe")
        return L.hc_ffn.expand(x, m, post, comb)

    def attend(self, L: V4Layer, x: torch.Tensor, fb, states: dict, spans, rope: dict, step: V4Step):
        """One layer up to its MoE: (the streams after attention, the MoE's input [T, D], and the
        post / comb weights the MoE's output is mixed back with)."""
        eps = self.cfg.rms_norm_eps
        post, comb, collapsed = L.hc_attn.collapse(x)
        h = self.ops.rms(collapsed, L.attn_norm, eps)
        PHASES.lap("norms")
        a = L.attn.forward(h, fb, states, spans, rope, step)
        PHASES.lap("attention")
        x = L.hc_attn.expand(x, a, post, comb)
        post, comb, collapsed = L.hc_ffn.collapse(x)
        h = self.ops.rms(collapsed, L.ffn_norm, eps)
        PHASES.lap("norms")
        return x, h, post, comb

    def logits(self, x: torch.Tensor, hc_head: Optional[HyperHead] = None, norm: Optional[torch.Tensor] = None):
        """fp32 logits of streams x [N, hc, D]: the mHC head, the final norm, the output head
        (an MTP block passes its own head and norm; the output head is shared)."""
        h = (hc_head or self.hc_head)(x)
        logits = F.linear(
            self.ops.rms(h, self.norm if norm is None else norm, self.cfg.rms_norm_eps), self.head
        ).float()
        PHASES.lap("lm_head")
        return logits


def allocate_states(
    specs: list[StateSpec],
    num_pages: int,
    page_size: int,
    max_requests: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """One tensor per state: paged ones page-major, slot ones one row per running request."""
    out = {}
    for s in specs:
        shape = (num_pages, *s.page_shape(page_size)) if s.paged else (max_requests, *s.slot_shape())
        out[s.name] = torch.zeros(shape, dtype=dtype, device=device)
    return out
