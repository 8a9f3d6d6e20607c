"""DeepSeek-V4's lightning indexer: which compressed entries a CSA query attends to. Its own
compressor writes one indexer key per window; a query's `index_n_heads` small heads score every
visible key (sum_h w_h * relu(q_h . k) * scale) and the top `index_topk` are kept."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_engine.layers.v4_compressor import V4Compressor
from dsv4_engine.layers.v4_step import CSA_INDEX_K, V4Backend


class V4Indexer:
    """wq_b [IH * ihd, q_lora] (a view into the attention's fused q projection), weights_proj
    [IH, D] (a view into its fused input projection), and its compressor."""

    def __init__(
        self,
        wq_b: Optional[torch.Tensor],
        weights_proj: Optional[torch.Tensor],
        compressor: V4Compressor,
        backend: V4Backend,
    ):
        self.wq_b, self.weights_proj, self.compressor = wq_b, weights_proj, compressor
        self.backend = backend
        cfg = backend.cfg
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.scale = cfg.index_head_dim**-0.5

    @property
    def topk(self) -> int:
        return self.backend.cfg.index_topk  # read per step (a test widens it on a built model)

    def queries(self, iq: torch.Tensor, iw: torch.Tensor, rope_table) -> tuple[torch.Tensor, torch.Tensor]:
        """The q projection's indexer part [T, IH * ihd] and the weights projection [T, IH] ->
        (roped queries [T, IH, ihd], head weights [T, IH] in fp32)."""
        T = iq.shape[0]
        iq = iq.reshape(T, self.heads, self.head_dim)
        iq = self.backend.ops.v4_rms_rope(iq, None, self.backend.cfg.rms_norm_eps, rope_table, norm=False)
        return iq, iw.float() * self.heads**-0.5

    def select(self, iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The visible entries each query keeps: iq [B, M, IH, d], iw [B, M, IH], ikeys [B, C, d],
        visible [B, M, C] (M queries of each of B requests) -> a mask like visible."""
        B, M, IH, d = iq.shape
        C = ikeys.shape[1]
        score = torch.bmm(iq.reshape(B, M * IH, d).float(), ikeys.float().transpose(1, 2)).view(B, M, IH, C)
        score = (F.relu(score) * self.scale * iw.unsqueeze(-1)).sum(dim=-2)
        score = score.masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.topk, C), dim=-1).indices
        return visible & torch.zeros_like(visible).scatter_(-1, top, True)

    def topk_kernels(self, proj: dict, states: dict, j: int, fb, rate: int) -> torch.Tensor:
        """The kernel path's top-k: entry ids per query over layer j's indexer keys."""
        return self.backend.kops.v4_indexer_topk(
            proj["iq"],
            proj["iw"],
            states[CSA_INDEX_K][:, j],
            fb.block_table,
            fb.positions,
            fb.extend_lens,
            self.topk,
            self.scale,
            rate,
            fb.page_size,
        )
