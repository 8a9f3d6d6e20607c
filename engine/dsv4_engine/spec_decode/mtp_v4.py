"""DeepSeek-V4's multi-token-prediction block, run as a drafter, and the V4 target's side of a
speculative step.

Layout: the release keeps block n under `mtp.{n}.` (transformers skips those tensors when it loads;
a checkpoint that stores them as `model.mtp.{n}.` with transformers' module names is read too):
an ordinary V4 layer with release names (`attn.*`, `ffn.*` with routed experts, `attn_norm`,
`ffn_norm`, `hc_attn_*`, `hc_ffn_*`) plus `e_proj` and `h_proj` ([hidden, hidden]), `enorm`,
`hnorm`, `norm` and its own mHC head (`hc_head_fn`, `hc_head_base`, `hc_head_scale`). The
embedding and the output head are the main model's.

At position i the block reads the main model's residual streams h_i [hc, hidden] (the last
layer's output, before the mHC head collapses them) and the embedding e of token i+1:
x = e_proj(enorm(e)) + h_proj(hnorm(h_i)) on every stream, one V4 layer, then its own mHC head,
`norm` and the shared head predict token i+2. Chained on its own output streams it drafts further.

The block's attention is a sliding-window layer (no compressor; DeepSeek's release has no
compressor or indexer tensors in it): its only state is a ring of the last `sliding_window`
tokens' kv, `STATE`, a slot state of one layer. A block with a compressor is refused at start.
Being a slot state, it is part of every prefix-cache snapshot of the row and moves with PD.

Rollback: V4's per-request rings (the window ring and the compressor stages of every layer) are
overwritten at position p % size by whatever a step writes, rejected drafts included, so the
speculator saves the ring entries a step's drafts will overwrite and puts back those of rejected
positions (`RingRollback`), and does the same for the MTP block's own ring around the draft chain.
Compressed entries need nothing: an entry whose window a rejected position closed is invisible
until a real token closes that window, which writes it again before any read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_engine.layers.hyper_connections import HyperHead
from dsv4_engine.layers.v4_verify import FixedRows
from dsv4_engine.models.deepseek_v4 import SLIDING, DeepseekV4, V4Layer
from dsv4_engine.models.deepseek_v4_weights import to_release_layout
from dsv4_engine.models.forward_batch import request_spans
from dsv4_engine.models.state import StateSpec
from dsv4_engine.parallel.sharded import rank_slicer
from dsv4_engine.quant import place
from dsv4_engine.spec_decode.mtp_layer import load_layer_weights

STATE = "mtp_swa_kv"


def v4_mtp_state_spec(cfg) -> StateSpec:
    return StateSpec(STATE, 1, (cfg.head_dim,), kind="slot", slots=cfg.sliding_window, quantizable=True)


def load_v4_mtp_weights(model_dir: str | Path, n: int, layer: int, slicer=None) -> dict:
    """Block n's tensors, renamed to release names under `layers.{layer}.` (experts split); with
    a slicer (one rank of --tp-size N), this rank's routed experts only, under local ids."""
    out = {}
    for prefix in (f"mtp.{n}.", f"model.mtp.{n}."):
        for name, t in load_layer_weights(model_dir, prefix, slicer).items():
            rest = re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name[len(prefix) :])
            out[f"layers.{layer}.{rest}"] = t
    return to_release_layout(out)


# ---- the target's side: streams for every position, the head on chosen rows -------------------


def run_layers(m: DeepseekV4, layers: list[V4Layer], x: torch.Tensor, fb, states: dict, fixed: Optional[int] = None):
    """x [T, hc, D] through `layers` as DeepseekV4.forward runs its own; returns the streams after
    the last one. fixed=n: every request has n new tokens and nothing is read from the host (a
    captured verify step: layers/v4_verify.py)."""
    # A decode step without host lengths is a captured one (spec_decode.graphs): as the model's
    # own forward, no span is read from the device; the kernel path closes windows masked.
    static = m.kops is not None and fb.all_decode and fb.seq_lens_host is None
    if fixed is not None:
        spans = FixedRows(fixed)
    else:
        spans = None if static else request_spans(fb)
    step = m.new_step()
    # only the tables these layers read (the MTP block, a sliding layer: the main rope alone)
    rope = m.rope(fb.positions, {"compress" if L.attn.rate else "main" for L in layers})
    for L in layers:
        x = m.run_layer(L, x, fb, states, spans, rope, step)
    return x


class V4Target:
    """The main model as the speculator reads it: hidden streams at every position of a step."""

    def __init__(self, model: DeepseekV4):
        self.model = model

    @torch.inference_mode()
    def hidden(self, fb, states: dict, fixed: Optional[int] = None) -> torch.Tensor:
        """Streams [T, hc, D] at every token; fixed=n: a verify step of n tokens a request at a
        fixed shape, its windows found on the device (what spec_decode.graphs captures)."""
        m = self.model
        x = F.embedding(fb.input_ids, m.embed).unsqueeze(1).expand(-1, m.cfg.hc_mult, -1).contiguous()
        return run_layers(m, m.layers, x, fb, states, fixed)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.logits(rows)


class V4MTPLayer:
    """The weights of one V4 MTP block and its forward, with the main model's ops."""

    def __init__(self, model: DeepseekV4, model_dir: str | Path, index: int = 0):
        cfg, dt, dev = model.cfg, model.dtype, model.device
        self.model = model
        self.layer = cfg.num_hidden_layers + index
        p = f"layers.{self.layer}."
        w = load_v4_mtp_weights(model_dir, index, self.layer, rank_slicer(model, model_dir))
        if not w:
            raise ValueError(
                f"config.json says num_nextn_predict_layers >= 1 but the checkpoint has no mtp.{index}.* "
                "tensors (DeepSeek-V4's MTP block)"
            )
        if any(k.startswith(p + "attn.compressor.") or k.startswith(p + "attn.indexer.") for k in w):
            raise ValueError(
                "--speculative-algorithm mtp: this V4 MTP block has a compressor (compressed "
                "attention); only a sliding-window MTP block is supported"
            )
        f32 = torch.float32

        def take(name: str, dtype: Optional[torch.dtype] = dt):
            if p + name not in w:
                raise ValueError(f"checkpoint lacks tensor mtp.{index}.{name} (its MTP block)")
            return place(w[p + name], dev, dtype, model.ops)

        self.L = model.build_layer(take, self.layer, 0, None, kind=SLIDING)  # its ring: a state of one layer
        self.e_proj, self.h_proj = take("e_proj.weight"), take("h_proj.weight")
        self.enorm, self.hnorm, self.norm = (take(n + ".weight", f32) for n in ("enorm", "hnorm", "norm"))
        self.hc_head = HyperHead(*(take(f"hc_head_{k}", f32) for k in ("fn", "base", "scale")), model.backend)

    @torch.inference_mode()
    def forward(
        self, fb, states: dict[str, torch.Tensor], prev: torch.Tensor, rows: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fb's input_ids are the next tokens (i+1 for position i), prev [T, hc, D] the streams
        they follow. Writes the block's ring at fb's positions. Returns (fp32 logits, output
        streams) of the tokens at `rows` (default: each request's last)."""
        out = self.body(fb, states, prev)[fb.logits_indices if rows is None else rows]
        return self.logits(out), out

    @torch.inference_mode()
    def body(
        self, fb, states: dict[str, torch.Tensor], prev: torch.Tensor, fixed: Optional[int] = None
    ) -> torch.Tensor:
        """The block's output streams [T, hc, D] at every token: what a captured draft step runs
        (fixed=n: a catch-up of n rows a request at a fixed shape, as the target's verify)."""
        return run_layers(self.model, [self.L], self.inputs(fb, prev), fb, self.layer_states(states), fixed)

    def inputs(self, fb, prev: torch.Tensor) -> torch.Tensor:
        """What the block's layer reads [T, hc, D]: the next tokens' embeddings and the streams
        they follow, each normed and projected, added on every stream."""
        m, eps = self.model, self.model.cfg.rms_norm_eps
        e = m.ops.rms(F.embedding(fb.input_ids, m.embed), self.enorm, eps)
        h = m.ops.rms(prev.to(e.dtype), self.hnorm, eps)
        return (F.linear(e, self.e_proj).unsqueeze(1) + F.linear(h, self.h_proj)).contiguous()

    @staticmethod
    def layer_states(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The states its sliding layer reads: its own ring as the window ring."""
        return {**states, DeepseekV4.SWA_KV: states[STATE]}

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """fp32 logits of output streams [N, hc, D]."""
        return self.model.logits(out, self.hc_head, self.norm)


class RingRollback:
    """Ring entries (slot states: [rows, layers, size, ...], position p at p % size) that a step
    is about to overwrite at `positions`, saved so those of rejected positions can be put back."""

    def __init__(self, rings: dict[str, torch.Tensor], rows: list[int], positions: list[int]):
        dev = next(iter(rings.values())).device if rings else "cpu"
        self.rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self.pos = torch.tensor(positions, dtype=torch.long, device=dev)
        self.rings = rings
        self.saved = (
            {name: st[self.rows, :, self.pos % st.shape[2]].clone() for name, st in rings.items()} if rows else {}
        )

    def restore(self, keep_below: Optional[list[int]] = None) -> None:
        """Put back the saved entries: all of them, or those at positions >= keep_below[k] (one
        bound per saved entry: its request's first rejected position)."""
        if not self.saved:
            return
        sel = (
            slice(None)
            if keep_below is None
            else self.pos >= torch.tensor(keep_below, dtype=torch.long, device=self.pos.device)
        )
        for name, st in self.rings.items():
            st[self.rows[sel], :, (self.pos % st.shape[2])[sel]] = self.saved[name][sel]


def min_ring(specs: list[StateSpec]) -> int:
    """The smallest ring of the main model's slot states: a step's drafts (plus its last real
    token) must not wrap around it, or a rejected draft would overwrite an accepted one."""
    return min((s.slots for s in specs if not s.paged), default=1 << 30)
