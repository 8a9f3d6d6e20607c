"""DeepSeek-V3 as a composition of layers (dsv4_engine.layers) over a paged latent KV cache.

A decoder layer is RMSNorm -> MLA attention -> RMSNorm -> MoE (or a dense MLP in the first
layers), with the residual carried by the norms' fused add. Every op goes through `ops`, the
engine's kernel backend (dsv4_kernels.api.get_ops: torch, cpu or triton); `tp` is this rank's
place under --tp-size N (the weights handed in are its slice: dsv4_engine.parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from dsv4_engine.config import ModelConfig
from dsv4_engine.layers.linear import Linear
from dsv4_engine.layers.mla import MLA
from dsv4_engine.layers.mlp import GatedMLP
from dsv4_engine.layers.moe import DeepseekMoE
from dsv4_engine.layers.norm import RMSNorm
from dsv4_engine.layers.rope import RotaryEmbedding
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.models.state import StateSpec
from dsv4_engine.quant import dense, log_resident, moe_experts_for, place
from dsv4_engine.step_phases import PHASES


@dataclass
class DecoderLayer:
    input_norm: RMSNorm
    attn: MLA
    post_norm: RMSNorm
    mlp: DeepseekMoE | GatedMLP

    def __call__(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        fb: ForwardBatch,
        kv_layer: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) as the next layer's norm takes them."""
        h, residual = self.input_norm(x, residual)
        PHASES.lap("norms")
        x = self.attn(h, fb, kv_layer, slots)
        PHASES.lap("attention")
        h, residual = self.post_norm(x, residual)
        PHASES.lap("norms")
        x = self.mlp(h)
        PHASES.lap("moe")
        return x, residual


class DeepseekV3:
    """Weights plus the forward pass; holds no per-request state (that lives in the KV pool)."""

    LATENT_KV = "latent_kv"
    # A decode forward reads nothing back to the host and has value-independent shapes (on the
    # Triton backend): it may be captured in a CUDA graph (tests/unit/engine/test_cuda_graphs.py).
    CUDA_GRAPH_SAFE = True

    @classmethod
    def state_specs(cls, cfg: ModelConfig) -> list[StateSpec]:
        """Per request: the MLA latent and the rope key of every token in every layer."""
        return [StateSpec(cls.LATENT_KV, cfg.num_hidden_layers, (cfg.kv_cache_dim,), quantizable=True)]

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ops, dtype: torch.dtype, device: torch.device, tp=None
    ):
        self.cfg = cfg
        self.tp: Any = tp
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.rope = RotaryEmbedding.build(cfg, device, ops)
        w = weights

        def take(name: str, dtype: torch.dtype = dtype) -> torch.Tensor:
            # fp8/fp4 weights stay quantized on CUDA (F.linear dispatches on them), dense elsewhere
            if name not in w:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return place(w[name], device, dtype, ops)

        self.moe_experts = moe_experts_for(ops)
        self.embed = dense(take("model.embed_tokens.weight"), dtype)
        self.final_norm = RMSNorm(take("model.norm.weight"), cfg.rms_norm_eps, ops)
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in w
        self.lm_head = Linear.column(self.embed if tied else take("lm_head.weight"), ops)
        self.layers = [self.build_layer(w, i, take) for i in range(cfg.num_hidden_layers)]
        self.resident_bytes = log_resident(
            "deepseek_v3", device, self.embed, self.lm_head, self.final_norm, self.layers
        )

    def build_layer(self, w: dict[str, torch.Tensor], i: int, take) -> DecoderLayer:
        """Decoder layer i (also the decoder layer of an MTP block, stored at index
        num_hidden_layers: dsv4_engine.spec_decode)."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        p = f"model.layers.{i}."
        # --dp-size N: attention and dense MLPs are whole on each rank (no sum over ranks)
        split = None if getattr(self.tp, "replicated_attention", False) else self.tp
        if cfg.is_moe_layer(i):
            mlp = DeepseekMoE.build(take, w, p + "mlp.", cfg, ops, self.tp, self.moe_experts)
        else:
            mlp = GatedMLP.build(take, p + "mlp.", ops, split)
        return DecoderLayer(
            RMSNorm(take(p + "input_layernorm.weight"), eps, ops),
            MLA.build(take, p, cfg, self.dtype, self.rope, ops, split),
            RMSNorm(take(p + "post_attention_layernorm.weight"), eps, ops),
            mlp,
        )

    @torch.inference_mode()
    def hidden_states(
        self, fb: ForwardBatch, states: dict[str, torch.Tensor], rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The final-normed hidden state (what the lm_head reads) of the tokens at `rows` (all
        tokens when None), [len(rows), hidden]: speculative decoding verifies every position."""
        kv_pool = states[self.LATENT_KV]
        x = F.embedding(fb.input_ids, self.embed)
        residual: Optional[torch.Tensor] = None
        page_size = kv_pool.shape[2]
        slots = (fb.slot_mapping // page_size, fb.slot_mapping % page_size)  # (page, offset), every layer
        PHASES.lap("embed")
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, fb, kv_pool[:, i], slots)
        h = x + residual if rows is None else x[rows] + residual[rows]
        return self.final_norm(h)[0]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, states: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits of each request's last new token, [B, vocab]."""
        logits = self.lm_head(self.hidden_states(fb, states, fb.logits_indices)).float()
        PHASES.lap("lm_head")
        return logits
