"""DeepSeek-V3's multi-token-prediction block, run as a drafter.

Layout (the release and `dsv4 model init --mtp`; transformers' save_pretrained keeps these
names): block k lives at `model.layers.{num_hidden_layers + k}.` and holds an ordinary decoder
layer (attention + MoE, same tensor names as any layer) plus `enorm`, `hnorm` (RMSNorms of the
next token's embedding and of the previous hidden state), `eh_proj` ([hidden, 2 * hidden], over
the two concatenated in that order), `shared_head.norm` and `shared_head.head` (its output norm
and head), and `embed_tokens` (a copy of the main embedding). A checkpoint that leaves out the
copies of the embedding or the head shares the main model's.

At position i the block reads the hidden state h_i the main model computed there (final-normed,
what its lm_head reads) and the embedding of token i+1, and predicts token i+2. Chained on its own
output hidden state, it drafts further. It attends over its own paged latent KV, one layer of it:
`STATE`, declared to the pool so pages hold it and memory sizing counts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from dsv4_engine.models.deepseek_v3 import DeepseekV3
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.models.state import StateSpec
from dsv4_engine.parallel.sharded import rank_slicer
from dsv4_engine.quant import checkpoint_scheme, dense, pair_quantized, place

STATE = "mtp_latent_kv"


def num_mtp_layers(model_dir: str | Path) -> int:
    with open(Path(model_dir) / "config.json") as f:
        return int(json.load(f).get("num_nextn_predict_layers") or 0)


def mtp_state_spec(cfg) -> StateSpec:
    """The MTP block's latent KV: one layer, the same entry as the main layers'."""
    return StateSpec(STATE, 1, (cfg.kv_cache_dim,), quantizable=True)  # fp8kv: as the model's latent


def load_layer_weights(model_dir: str | Path, prefix: str, slicer=None) -> dict[str, Any]:
    """The tensors whose names start with `prefix`, quantized ones paired with their scales;
    with a slicer (one rank of --tp-size N: dsv4_engine.parallel), only this rank's part."""
    from safetensors import safe_open

    if slicer is not None:
        from dsv4_engine.parallel.loader import load_shard

        return load_shard(model_dir, slicer, keep=lambda key: key.startswith(prefix))
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    raw = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    raw[key] = f.get_tensor(key)
    paired, _ = pair_quantized(raw, checkpoint_scheme(d))
    return paired


class V3Target:
    """The main model as the speculator reads it: final-normed hidden states at every position."""

    def __init__(self, model: DeepseekV3):
        self.model = model

    def hidden(self, fb: ForwardBatch, states: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.hidden_states(fb, states)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.model.lm_head.weight).float()


class MTPLayer:
    """The weights of one MTP block and its forward; runs with the main model's ops and layers."""

    def __init__(self, model: DeepseekV3, model_dir: str | Path, index: int = 0):
        cfg = model.cfg
        self.model = model
        self.layer = cfg.num_hidden_layers + index
        p = f"model.layers.{self.layer}."
        w = load_layer_weights(model_dir, p, rank_slicer(model, model_dir))  # split like the target's layers
        dt, dev = model.dtype, model.device

        def take(name: str, dtype: torch.dtype = dt):
            if name not in w:
                raise KeyError(f"checkpoint lacks tensor {name} (its MTP layer)")
            return place(w[name], dev, dtype, model.ops)

        self.L = model.build_layer(w, self.layer, take)
        self.enorm = take(p + "enorm.weight")
        self.hnorm = take(p + "hnorm.weight")
        self.eh_proj = take(p + "eh_proj.weight")
        self.head_norm = take(p + "shared_head.norm.weight")
        self.head = take(p + "shared_head.head.weight") if p + "shared_head.head.weight" in w else model.lm_head.weight
        self.embed = dense(take(p + "embed_tokens.weight"), dt) if p + "embed_tokens.weight" in w else model.embed

    @torch.inference_mode()
    def forward(
        self,
        fb: ForwardBatch,
        states: dict[str, torch.Tensor],
        prev_hidden: torch.Tensor,
        rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fb's input_ids are the next tokens (i+1 for position i), prev_hidden [T, hidden] the
        hidden states they follow. Writes the block's KV at fb's slots. Returns (fp32 logits,
        output hidden state) of the tokens at `rows` (default: each request's last)."""
        x, residual = self.body(fb, states, prev_hidden)
        idx = fb.logits_indices if rows is None else rows
        out = x[idx] + residual[idx]
        return self.logits(out), out

    @torch.inference_mode()
    def body(
        self, fb: ForwardBatch, states: dict[str, torch.Tensor], prev_hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to its output, at every token: (x, residual) [T, hidden], their sum the
        output hidden state. What a captured draft step runs (dsv4_engine.spec_decode.graphs)."""
        kv = states[STATE]
        page_size = kv.shape[2]
        slots = (fb.slot_mapping // page_size, fb.slot_mapping % page_size)
        return self.L(self.inputs(fb, prev_hidden), None, fb, kv[:, 0], slots)

    def inputs(self, fb: ForwardBatch, prev_hidden: torch.Tensor) -> torch.Tensor:
        """What the block's decoder layer reads [T, hidden]: the next tokens' embeddings and the
        previous hidden states, each normed, concatenated and projected."""
        ops, eps = self.model.ops, self.model.cfg.rms_norm_eps
        e, _ = ops.rmsnorm(F.embedding(fb.input_ids, self.embed), self.enorm, eps)
        h, _ = ops.rmsnorm(prev_hidden.to(e.dtype), self.hnorm, eps)
        return F.linear(torch.cat([e, h], dim=-1), self.eh_proj)

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """fp32 logits of output hidden states [N, hidden]."""
        hn, _ = self.model.ops.rmsnorm(out, self.head_norm, self.model.cfg.rms_norm_eps)
        return F.linear(hn, self.head).float()
