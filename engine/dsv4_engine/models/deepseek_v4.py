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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_engine.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_engine.models.state import StateSpec
from dsv4_engine.quant import dense, log_resident, place
from dsv4_engine.weights import load_weights


@dataclass
class V4Batch:
    """One step's tokens, flattened over requests in order (varlen). The engine's ForwardBatch
    has every field but `slot_ids` and `page_size`; with those two it serves V4 as is (the model
    reads only these attributes)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64; a request's new tokens are consecutive positions
    extend_lens: torch.Tensor  # [B] new tokens of each request
    logits_indices: torch.Tensor  # [B] row of each request's last new token
    block_table: torch.Tensor  # [B, max_pages] page ids of the paged states
    slot_ids: torch.Tensor  # [B] row of each request in the slot states
    page_size: int  # tokens per page


# ---- weights: release names, and what transformers' save_pretrained / state_dict write -----------

_MTP = re.compile(r"(^|\.)mtp\.")

# Native transformers module names -> DeepSeek release names (the inverse of transformers'
# conversion mapping for deepseek_v4). Applied in order, after "model." is stripped.
_TO_RELEASE = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    # transformers' reverse mapping on save turns the attention's kv_norm into a bare `norm`
    (r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm."),
]


def release_name(name: str) -> str:
    """The DeepSeek release name of a tensor named in any layout we read."""
    n = name[len("model."):] if name.startswith("model.") else name
    for pat, rep in _TO_RELEASE:
        n = re.sub(pat, rep, n)
    return n


def to_release_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename to release names and split transformers' fused expert tensors per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if _MTP.search(name):
            continue
        n = release_name(name)
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$", n)
        if m:
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.w1.weight"], out[f"{prefix}.{e}.w3.weight"] = w1, w3
                else:
                    out[f"{prefix}.{e}.w2.weight"] = t[e]
            continue
        out[n] = t
    return out


def load_v4_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read a V4 checkpoint in release or transformers layout; MTP tensors are never read."""
    return to_release_layout(load_weights(model_dir))


# ---- small math helpers, written as transformers computes them ------------------------------------

def _rms(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y).to(x.dtype) if weight is not None else y.to(x.dtype)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, conj: bool = False) -> torch.Tensor:
    """Interleaved rope on the trailing rope slice of x [N, ..., dim]; positions [N].
    conj rotates by -angle (undoes the rope that values picked up, at the query position)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if conj:
        sin = -sin
    cos = cos.repeat_interleave(2, dim=-1).to(x.dtype)
    sin = sin.repeat_interleave(2, dim=-1).to(x.dtype)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rot.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _ring_positions(start: int, slots: int, device) -> torch.Tensor:
    """Position held by each slot of a ring (slot = position % slots) just before `start` is
    written: the latest position < start in that residue class (negative: never written)."""
    j = torch.arange(slots, device=device)
    return (start - 1) - torch.remainder(start - 1 - j, slots)


class DeepseekV4:
    """Weights plus the forward pass; every per-request state lives in engine-owned tensors."""

    SWA_KV = "swa_kv"
    CSA_KV = "csa_kv"
    CSA_INDEX_K = "csa_index_k"
    HCA_KV = "hca_kv"
    CSA_STAGE = "csa_stage"
    CSA_INDEX_STAGE = "csa_index_stage"
    HCA_STAGE = "hca_stage"

    @classmethod
    def state_specs(cls, cfg: DeepseekV4Config) -> list[StateSpec]:
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        n_csa, n_hca = len(cfg.layers_of(CSA)), len(cfg.layers_of(HCA))
        specs = [StateSpec(cls.SWA_KV, cfg.num_hidden_layers, (hd,), kind="slot", slots=cfg.sliding_window)]
        if n_csa:
            r = cfg.csa_rate
            specs += [
                StateSpec(cls.CSA_KV, n_csa, (hd,), tokens_per_entry=r),
                StateSpec(cls.CSA_INDEX_K, n_csa, (ihd,), tokens_per_entry=r),
                StateSpec(cls.CSA_STAGE, n_csa, (4 * hd,), kind="slot", slots=2 * r),
                StateSpec(cls.CSA_INDEX_STAGE, n_csa, (4 * ihd,), kind="slot", slots=2 * r),
            ]
        if n_hca:
            r = cfg.hca_rate
            specs += [
                StateSpec(cls.HCA_KV, n_hca, (hd,), tokens_per_entry=r),
                StateSpec(cls.HCA_STAGE, n_hca, (2 * hd,), kind="slot", slots=r),
            ]
        return specs

    @staticmethod
    def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
        return load_v4_weights(model_dir)

    def __init__(self, cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], ops=None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.ops = ops  # unused yet: the V4 path is plain torch until its kernels exist
        self.dtype = dtype
        self.device = torch.device(device)
        self.inv_freq = {
            "main": cfg.rope_main.inv_freq().to(self.device),
            "compress": cfg.rope_compress.inv_freq().to(self.device),
        }
        # index of each CSA / HCA layer within the states of its type
        self.type_index = {}
        for t in (CSA, HCA):
            for j, i in enumerate(cfg.layers_of(t)):
                self.type_index[i] = j
        self._build(to_release_layout(weights))  # a no-op on release names

    # ---- weights -------------------------------------------------------------------------------

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        cfg, dt, dev = self.cfg, self.dtype, self.device

        def take(name: str, dtype: Optional[torch.dtype] = dt) -> torch.Tensor:
            # fp8/fp4 weights stay quantized on CUDA (F.linear dispatches on them), dense elsewhere
            if name not in w:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return place(w[name], dev, dtype)

        f32 = torch.float32  # mHC, norms, sinks, position biases stay fp32, as in the release
        self.embed = dense(take("embed.weight"), dt)
        self.head = take("head.weight")
        self.norm = take("norm.weight", f32)
        self.hc_head = (take("hc_head_fn", f32), take("hc_head_base", f32), take("hc_head_scale", f32))
        self.layers: list[dict] = []
        E = cfg.n_routed_experts
        for i in range(cfg.num_hidden_layers):
            p, a, f = f"layers.{i}.", f"layers.{i}.attn.", f"layers.{i}.ffn."
            L: dict = {
                "type": cfg.layer_types[i],
                "attn_norm": take(p + "attn_norm.weight", f32),
                "ffn_norm": take(p + "ffn_norm.weight", f32),
                "hc_attn": tuple(take(p + f"hc_attn_{k}", f32) for k in ("fn", "base", "scale")),
                "hc_ffn": tuple(take(p + f"hc_ffn_{k}", f32) for k in ("fn", "base", "scale")),
                "wq_a": take(a + "wq_a.weight"),
                "q_norm": take(a + "q_norm.weight", f32),
                "wq_b": take(a + "wq_b.weight"),
                "wkv": take(a + "wkv.weight"),
                "kv_norm": take(a + "kv_norm.weight", f32),
                "wo_a": dense(take(a + "wo_a.weight"), dt),  # used per group (bmm), not by F.linear
                "wo_b": take(a + "wo_b.weight"),
                "sink": take(a + "attn_sink", f32),
            }
            if L["type"] in (CSA, HCA):
                c = a + "compressor."
                L["comp"] = (take(c + "wkv.weight"), take(c + "wgate.weight"), take(c + "ape", f32),
                             take(c + "norm.weight", f32))
            if L["type"] == CSA:
                c = a + "indexer.compressor."
                L["icomp"] = (take(c + "wkv.weight"), take(c + "wgate.weight"), take(c + "ape", f32),
                              take(c + "norm.weight", f32))
                L["idx_wq_b"] = take(a + "indexer.wq_b.weight")
                L["idx_w"] = take(a + "indexer.weights_proj.weight")
            L["gate"] = take(f + "gate.weight")
            if cfg.mlp_layer_types[i] == "hash_moe":
                L["tid2eid"] = take(f + "gate.tid2eid", None).long()
            else:
                L["bias"] = take(f + "gate.bias", f32)
            ex = f + "experts."
            L["w13"] = torch.stack(
                [torch.cat([take(ex + f"{e}.w1.weight"), take(ex + f"{e}.w3.weight")], 0) for e in range(E)]
            )
            L["w2"] = torch.stack([take(f + f"experts.{e}.w2.weight") for e in range(E)])
            L["s_w13"] = torch.cat([take(f + "shared_experts.w1.weight"), take(f + "shared_experts.w3.weight")], 0)
            L["s_w2"] = take(f + "shared_experts.w2.weight")
            self.layers.append(L)
        self.resident_bytes = log_resident("deepseek_v4", dev, self.embed, self.head, self.norm, self.hc_head, self.layers)

    # ---- mHC -----------------------------------------------------------------------------------

    def _hc(self, x: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        cfg = self.cfg
        fn, base, scale = params
        hc = cfg.hc_mult
        flat = _unweighted_rms(x.reshape(x.shape[0], -1).float(), cfg.rms_norm_eps)
        mixes = F.linear(flat, fn)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + cfg.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        return post, comb, collapsed

    def _hc_mix(self, x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # comb is applied transposed: stream k gets sum_j comb[j, k] * x[j]
        dt = x.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)

    # ---- MoE -----------------------------------------------------------------------------------

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        lim = self.cfg.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def _moe(self, L: dict, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        logits = F.linear(x, L["gate"])
        scores = F.softplus(logits).sqrt() if cfg.scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)
        if "tid2eid" in L:
            ids = L["tid2eid"][input_ids]
        else:
            ids = torch.topk(scores + L["bias"], cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, k = torch.where(ids == e)
            h = self._swiglu(F.linear(x[tok], L["w13"][e]))
            out.index_add_(0, tok, (F.linear(h, L["w2"][e]) * wts[tok, k, None]).to(out.dtype))
        return out + F.linear(self._swiglu(F.linear(x, L["s_w13"])), L["s_w2"])

    # ---- compressors ---------------------------------------------------------------------------

    def _compress(self, kvp: torch.Tensor, gp: torch.Tensor, start: int, stage: torch.Tensor, params,
                  rate: int, overlap: bool, out: torch.Tensor, pages: torch.Tensor, page_size: int) -> None:
        """Close every window whose last token is in this chunk and write its entry to `out`.

        kvp, gp [n, width]: this chunk's projections at positions start..start+n-1. stage
        [slots, 2*width] is the request's ring of earlier projections (slot = position % slots);
        out [num_pages, entries_per_page, dim] is the layer's paged entry store."""
        n, width = kvp.shape
        end = start + n
        slots = stage.shape[0]
        first_w, last_w = start // rate, end // rate  # windows closing now: [first_w, last_w)
        if last_w > first_w:
            wkv, wgate, ape, norm_w = params
            base = max(0, (first_w - (1 if overlap else 0)) * rate)
            if base < start:
                held = stage[torch.arange(base, start, device=stage.device) % slots]
                seq_kv = torch.cat([held[:, :width].to(kvp.dtype), kvp], 0)
                seq_gate = torch.cat([held[:, width:].to(gp.dtype), gp], 0)
            else:
                seq_kv, seq_gate = kvp, gp
            nw = last_w - first_w
            lo = first_w * rate - base
            win_kv = seq_kv[lo: lo + nw * rate].view(nw, rate, width)
            win_gate = seq_gate[lo: lo + nw * rate].view(nw, rate, width) + ape
            if overlap:
                hd = width // 2
                new_kv = win_kv.new_zeros((nw, 2 * rate, hd))
                new_gate = win_gate.new_full((nw, 2 * rate, hd), float("-inf"))
                new_kv[:, rate:] = win_kv[..., hd:]
                new_gate[:, rate:] = win_gate[..., hd:]
                # window w also weighs window w-1's first series (none before window 0)
                prev_lo = lo - rate
                k0 = 1 if first_w == 0 else 0  # only window 0 lacks a predecessor
                if nw > k0:
                    pk = seq_kv[prev_lo + k0 * rate: prev_lo + nw * rate].view(nw - k0, rate, width)
                    pg = seq_gate[prev_lo + k0 * rate: prev_lo + nw * rate].view(nw - k0, rate, width) + ape
                    new_kv[k0:, :rate] = pk[..., :hd]
                    new_gate[k0:, :rate] = pg[..., :hd]
            else:
                new_kv, new_gate = win_kv, win_gate
            pooled = (new_kv * new_gate.softmax(dim=1, dtype=torch.float32).to(new_kv.dtype)).sum(dim=1)
            entries = _rms(pooled, norm_w, self.cfg.rms_norm_eps)
            w_ids = torch.arange(first_w, last_w, device=kvp.device)
            entries = _rope(entries, w_ids * rate, self.inv_freq["compress"])
            page, off = self._locate(w_ids, rate, page_size, out.shape[1])
            out[pages[page].long(), off] = entries.to(out.dtype)
        # keep this chunk's last `slots` projections for windows that close later
        keep = min(n, slots)
        pos = torch.arange(end - keep, end, device=stage.device)
        stage[pos % slots] = torch.cat([kvp[n - keep:], gp[n - keep:]], dim=-1).to(stage.dtype)

    @staticmethod
    def _locate(w: torch.Tensor, rate: int, page_size: int, epp: int) -> tuple[torch.Tensor, torch.Tensor]:
        # as StateSpec.entry_location: the page of the window's first token
        return (w * rate) // page_size, w % epp

    def _entries(self, store: torch.Tensor, pages: torch.Tensor, count: int, rate: int, page_size: int) -> torch.Tensor:
        """Entries 0..count-1 of one request from a paged store [num_pages, epp, dim]."""
        page, off = self._locate(torch.arange(count, device=store.device), rate, page_size, store.shape[1])
        return store[pages[page].long(), off]

    # ---- attention -----------------------------------------------------------------------------

    def _attention(self, i: int, L: dict, h: torch.Tensor, fb: V4Batch, states: dict[str, torch.Tensor],
                   spans: list[tuple[int, int, int]]) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        kind = L["type"]
        inv = self.inv_freq["main" if kind == SLIDING else "compress"]
        pos = fb.positions
        qr = _rms(F.linear(h, L["wq_a"]), L["q_norm"], eps)
        q = _unweighted_rms(F.linear(qr, L["wq_b"]).view(T, H, hd), eps)
        q = _rope(q, pos, inv)
        kv = _rope(_rms(F.linear(h, L["wkv"]), L["kv_norm"], eps), pos, inv)  # [T, hd]: key == value
        proj = {}
        if kind in (CSA, HCA):
            proj["comp"] = (F.linear(h, L["comp"][0]), F.linear(h, L["comp"][1]))
        if kind == CSA:
            proj["icomp"] = (F.linear(h, L["icomp"][0]), F.linear(h, L["icomp"][1]))
            proj["iq"] = _rope(F.linear(qr, L["idx_wq_b"]).view(T, cfg.index_n_heads, cfg.index_head_dim), pos,
                               self.inv_freq["compress"])
            proj["iw"] = F.linear(h, L["idx_w"]).float() * cfg.index_n_heads ** -0.5
        if all(n == 1 for _, n, _ in spans):
            out = self._attend_decode(i, L, q, kv, proj, fb, states)
        else:
            out = self._attend_varlen(i, L, q, kv, proj, fb, states, spans)
        out = _rope(out, pos, inv, conj=True)
        G = cfg.o_groups
        grouped = out.reshape(T, G, -1).transpose(0, 1)  # [G, T, H*hd/G]
        wa = L["wo_a"].view(G, -1, grouped.shape[-1]).transpose(1, 2)  # [G, in, o_lora]
        o = torch.bmm(grouped, wa).transpose(0, 1).reshape(T, -1)
        return F.linear(o, L["wo_b"])

    def _close_windows(self, i: int, L: dict, proj: dict, rows: slice, start: int, slot: int, pages: torch.Tensor,
                       fb: V4Batch, states: dict[str, torch.Tensor]) -> None:
        """Feed tokens rows (positions start..) of one request to the layer's compressor(s)."""
        kind, j = L["type"], self.type_index[i]
        rate = self.cfg.compress_rates[kind]
        if kind == CSA:
            self._compress(*(p[rows] for p in proj["comp"]), start, states[self.CSA_STAGE][slot, j], L["comp"], rate,
                           True, states[self.CSA_KV][:, j], pages, fb.page_size)
            self._compress(*(p[rows] for p in proj["icomp"]), start, states[self.CSA_INDEX_STAGE][slot, j],
                           L["icomp"], rate, True, states[self.CSA_INDEX_K][:, j], pages, fb.page_size)
        else:
            self._compress(*(p[rows] for p in proj["comp"]), start, states[self.HCA_STAGE][slot, j], L["comp"], rate,
                           False, states[self.HCA_KV][:, j], pages, fb.page_size)

    def _select(self, L: dict, iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """Lightning indexer: score sum_h w_h * relu(q_h . k) * scale per entry, keep the top-k
        visible entries of each query. iq [..., IH, d], iw [..., IH], ikeys [..., C, d], visible [..., C]."""
        cfg = self.cfg
        score = torch.matmul(iq.float(), ikeys.float().transpose(-1, -2))  # [..., IH, C]
        score = (F.relu(score) * cfg.index_head_dim ** -0.5 * iw.unsqueeze(-1)).sum(dim=-2)
        score = score.masked_fill(~visible, float("-inf"))
        top = score.topk(min(cfg.index_topk, score.shape[-1]), dim=-1).indices
        return visible & torch.zeros_like(visible).scatter_(-1, top, True)

    def _softmax_attend(self, L: dict, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [..., H, hd] over keys (== values) [..., K, hd] with allowed [..., K] and the
        per-head sink as one more logit whose value is dropped."""
        H, hd = q.shape[-2], q.shape[-1]
        logits = torch.matmul(q, keys.transpose(-1, -2)) * hd ** -0.5  # [..., H, K]
        logits = logits.masked_fill(~allowed.unsqueeze(-2), float("-inf"))
        sink = L["sink"].to(logits.dtype).view(H, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys)

    def _attend_varlen(self, i: int, L: dict, q: torch.Tensor, kv: torch.Tensor, proj: dict, fb: V4Batch,
                       states: dict[str, torch.Tensor], spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """Any mix of prefill chunks and decode tokens: one request at a time."""
        cfg = self.cfg
        W, kind, j = cfg.sliding_window, L["type"], self.type_index.get(i)
        pos = fb.positions
        ring_store = states[self.SWA_KV]
        out = torch.empty_like(q)
        for r, (row, n, start) in enumerate(spans):
            end = start + n
            slot = int(fb.slot_ids[r])
            pages = fb.block_table[r]
            sl = slice(row, row + n)
            qpos = pos[sl]
            # window keys: the ring (positions < start) then this chunk's own tokens
            ring = ring_store[slot, i]
            ring_pos = _ring_positions(start, W, q.device)
            keys = torch.cat([ring.to(kv.dtype), kv[sl]], 0)
            kpos = torch.cat([ring_pos, qpos])
            allowed = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W) & (kpos[None] >= 0)
            if kind in (CSA, HCA):
                rate = cfg.compress_rates[kind]
                self._close_windows(i, L, proj, sl, start, slot, pages, fb, states)
                count = end // rate  # entries closed so far; query t sees entry w iff w < (t+1)//rate
                if count:
                    visible = torch.arange(count, device=q.device)[None] < ((qpos + 1) // rate)[:, None]
                    if kind == CSA:
                        ikeys = self._entries(states[self.CSA_INDEX_K][:, j], pages, count, rate, fb.page_size)
                        visible = self._select(L, proj["iq"][sl], proj["iw"][sl], ikeys, visible)
                    store = states[self.CSA_KV if kind == CSA else self.HCA_KV][:, j]
                    entries = self._entries(store, pages, count, rate, fb.page_size)
                    keys = torch.cat([keys, entries.to(kv.dtype)], 0)
                    allowed = torch.cat([allowed, visible], 1)
            out[sl] = self._softmax_attend(L, q[sl], keys.unsqueeze(0), allowed)
            # the ring keeps the last W tokens (written after the reads above)
            keep = min(n, W)
            wpos = torch.arange(end - keep, end, device=q.device)
            ring[wpos % W] = kv[row + n - keep: row + n].to(ring.dtype)
        return out

    def _attend_decode(self, i: int, L: dict, q: torch.Tensor, kv: torch.Tensor, proj: dict, fb: V4Batch,
                       states: dict[str, torch.Tensor]) -> torch.Tensor:
        """One new token per request: every request at once (a loop only over the few requests
        whose token closes a compression window)."""
        cfg = self.cfg
        W, kind, j = cfg.sliding_window, L["type"], self.type_index.get(i)
        t = fb.positions  # [B]
        slots = fb.slot_ids.long()
        ring_store = states[self.SWA_KV]
        ring_pos = (t[:, None] - 1) - torch.remainder(t[:, None] - 1 - torch.arange(W, device=t.device), W)
        keys = torch.cat([ring_store[slots, i].to(kv.dtype), kv[:, None]], 1)  # [B, W+1, hd]
        kpos = torch.cat([ring_pos, t[:, None]], 1)
        allowed = (kpos <= t[:, None]) & (kpos > t[:, None] - W) & (kpos >= 0)
        if kind in (CSA, HCA):
            rate = cfg.compress_rates[kind]
            closing = ((t + 1) % rate == 0).tolist()
            for b, closes in enumerate(closing):
                if closes:
                    self._close_windows(i, L, proj, slice(b, b + 1), int(t[b]), int(slots[b]), fb.block_table[b],
                                        fb, states)
            still = ~torch.tensor(closing, dtype=torch.bool, device=t.device)
            if still.any():  # the others only stage their projections
                stages = [(self.CSA_STAGE, "comp"), (self.CSA_INDEX_STAGE, "icomp")] if kind == CSA \
                    else [(self.HCA_STAGE, "comp")]
                for name, key in stages:
                    st = states[name]
                    st[slots[still], j, t[still] % st.shape[2]] = torch.cat(
                        [p[still] for p in proj[key]], dim=-1).to(st.dtype)
            counts = (t + 1) // rate
            C = int(counts.max())
            if C:
                w = torch.arange(C, device=t.device)
                visible = w[None] < counts[:, None]  # [B, C]

                def gather(store: torch.Tensor) -> torch.Tensor:
                    page, off = self._locate(w, rate, fb.page_size, store.shape[1])
                    return store[fb.block_table[:, page].long(), off[None].expand(len(t), -1)]

                if kind == CSA:
                    ikeys = gather(states[self.CSA_INDEX_K][:, j])  # [B, C, ihd]
                    visible = self._select(L, proj["iq"], proj["iw"], ikeys, visible)
                entries = gather(states[self.CSA_KV if kind == CSA else self.HCA_KV][:, j])
                keys = torch.cat([keys, entries.to(kv.dtype)], 1)
                allowed = torch.cat([allowed, visible], 1)
        out = self._softmax_attend(L, q.unsqueeze(1), keys.unsqueeze(1), allowed.unsqueeze(1)).squeeze(1)
        ring_store[slots, i, t % W] = kv.to(ring_store.dtype)
        return out

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, fb: V4Batch, states: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits of each request's last new token, [B, vocab]."""
        if getattr(fb, "slot_ids", None) is None or getattr(fb, "page_size", None) is None:
            raise NotImplementedError(
                "DeepSeek-V4 needs a batch with slot_ids and page_size (its ring and compressor states are "
                "per-request slot rows); this engine loop does not hand them out yet"
            )
        cfg = self.cfg
        lens = [int(n) for n in fb.extend_lens.tolist()]
        spans, row = [], 0
        for n in lens:
            spans.append((row, n, int(fb.positions[row]) if n else 0))
            row += n
        x = F.embedding(fb.input_ids, self.embed)
        x = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, hc, D] residual streams
        for i, L in enumerate(self.layers):
            post, comb, collapsed = self._hc(x, L["hc_attn"])
            a = self._attention(i, L, _rms(collapsed, L["attn_norm"], cfg.rms_norm_eps), fb, states, spans)
            x = self._hc_mix(x, a, post, comb)
            post, comb, collapsed = self._hc(x, L["hc_ffn"])
            m = self._moe(L, _rms(collapsed, L["ffn_norm"], cfg.rms_norm_eps), fb.input_ids)
            x = self._hc_mix(x, m, post, comb)
        x = x[fb.logits_indices]
        fn, base, scale = self.hc_head
        flat = _unweighted_rms(x.flatten(1).float(), cfg.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + cfg.hc_eps
        h = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        h = _rms(h, self.norm, cfg.rms_norm_eps)
        return F.linear(h, self.head).float()


def allocate_states(specs: list[StateSpec], num_pages: int, page_size: int, max_requests: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One tensor per state: paged ones page-major, slot ones one row per running request."""
    out = {}
    for s in specs:
        shape = (num_pages, *s.page_shape(page_size)) if s.paged else (max_requests, *s.slot_shape())
        out[s.name] = torch.zeros(shape, dtype=dtype, device=device)
    return out
