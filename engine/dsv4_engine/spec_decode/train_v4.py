"""Differentiable DeepSeek-V4 forwards over whole sequences, for `dsv4 model init --preset v4-*
--train --train-mtp` (dsv4_engine.spec_decode.train runs the training; this is V4's part of it).

The engine's V4 forward is built for serving: it reads and writes per-request rings and paged
compressed entries, in place, one chunk at a time, under inference mode. Training needs none of
that: every sequence here starts at position 0 and is seen whole, so the sliding window is a
band mask over the sequence's own keys, and the compressed entries of window w are pooled from
the sequence's own projections of positions [w * rate, (w + 1) * rate) (CSA's overlapping
series also from window w - 1), visible to the queries at t >= (w + 1) * rate - 1. The math is
the engine's torch path (dsv4_engine.models.deepseek_v4), written without in-place ops, and is
checked against it (tests/unit/engine/test_mtp_train_v4.py). The lightning indexer's top-k
choice and the routing choice carry no gradient (both are selections); the routed weights do.

Weights are the checkpoint's release names (`layers.{i}.attn.wq_a.weight`, `mtp.0.e_proj.weight`,
...), as float leaf tensors, so training writes back exactly the tensors it read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_engine.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config

# Not trained: the learned routing's bias (set by load balancing, not by gradient) and the hash
# routing table (integers).
FROZEN = ("ffn.gate.bias", "ffn.gate.tid2eid")


def _rms(x: torch.Tensor, w, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else w * y


def _rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the trailing 2 * cis.shape[-1] channels of x [..., T, (heads,) dim]
    (the engine's convention); cis [T, pairs] complex, broadcast over the heads axis if any."""
    rd = 2 * cis.shape[-1]
    while cis.dim() < x.dim() - 1:
        cis = cis.unsqueeze(-2)
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    return torch.cat([x[..., :-rd], torch.view_as_real(pairs * cis).flatten(-2)], dim=-1)


def _cis(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(freqs), freqs)


class V4Forward:
    """V4's layers over a batch of whole sequences [B, T] (positions 0 .. T-1), weights `w` by
    release name. One instance serves the main model and the MTP block (same layer code)."""

    def __init__(self, cfg: DeepseekV4Config, w: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, w
        self.inv = {"main": cfg.rope_main.inv_freq(), "compress": cfg.rope_compress.inv_freq()}

    # ---- mHC ---------------------------------------------------------------------------------

    def hc_pre(self, x: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hc, D] -> (post [..., hc], comb [..., hc, hc], collapsed [..., D])."""
        cfg, w = self.cfg, self.w
        hc, eps = cfg.hc_mult, cfg.hc_eps
        fn, base, scale = w[p + "_fn"], w[p + "_base"], w[p + "_scale"]
        mixes = F.linear(_rms(x.flatten(-2), None, cfg.rms_norm_eps), fn)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = F.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(-2)

    @staticmethod
    def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # stream k gets post[k] * out + sum_j comb[j, k] * x[j]
        return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.einsum("...jk,...jd->...kd", comb, x)

    def head(self, x: torch.Tensor, p: str, norm: str) -> torch.Tensor:
        """Streams [..., hc, D] -> fp32 logits: the mHC head (prefix p: `hc_head_*`), norm, head."""
        cfg, w = self.cfg, self.w
        pre = torch.sigmoid(
            F.linear(_rms(x.flatten(-2), None, cfg.rms_norm_eps), w[p + "hc_head_fn"]) * w[p + "hc_head_scale"]
            + w[p + "hc_head_base"]
        )
        h = ((pre + cfg.hc_eps).unsqueeze(-1) * x).sum(-2)
        return F.linear(_rms(h, w[norm], cfg.rms_norm_eps), w["head.weight"])

    # ---- a layer ------------------------------------------------------------------------------

    def layer(self, x: torch.Tensor, p: str, kind: str, mlp: str, ids: torch.Tensor) -> torch.Tensor:
        """Streams x [B, T, hc, D] through one layer (prefix p, attention `kind`, MoE `mlp`);
        ids [B, T] route a hash MoE."""
        eps, w = self.cfg.rms_norm_eps, self.w
        post, comb, h = self.hc_pre(x, p + "hc_attn")
        x = self.hc_post(x, self.attention(_rms(h, w[p + "attn_norm.weight"], eps), p + "attn.", kind), post, comb)
        post, comb, h = self.hc_pre(x, p + "hc_ffn")
        return self.hc_post(x, self.moe(_rms(h, w[p + "ffn_norm.weight"], eps), p + "ffn.", mlp, ids), post, comb)

    def attention(self, h: torch.Tensor, a: str, kind: str) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        B, T, _ = h.shape
        H, hd, W, eps = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps
        pos = torch.arange(T)
        cis = _cis(pos, self.inv["main" if kind == SLIDING else "compress"])
        qr = _rms(F.linear(h, w[a + "wq_a.weight"]), w[a + "q_norm.weight"], eps)
        q = _rope(_rms(F.linear(qr, w[a + "wq_b.weight"]).unflatten(-1, (H, hd)), None, eps), cis)
        kv = _rope(_rms(F.linear(h, w[a + "wkv.weight"]), w[a + "kv_norm.weight"], eps), cis)  # key == value
        kp, qp = pos[None, :], pos[:, None]
        allowed = ((kp <= qp) & (kp > qp - W)).expand(B, T, T)
        keys = kv
        if kind in (CSA, HCA):
            rate = cfg.compress_rates[kind]
            C = T // rate  # windows the sequence closes
            if C:
                entries = self.compress(h, a + "compressor.", rate, C, overlap=kind == CSA)
                visible = (torch.arange(C)[None, :] < ((pos + 1) // rate)[:, None]).expand(B, T, C)
                if kind == CSA:
                    visible = self.select(h, qr, a, visible, rate, C)
                keys = torch.cat([kv, entries], 1)
                allowed = torch.cat([allowed, visible], 2)
        logits = torch.einsum("bthd,bkd->bthk", q, keys) * hd**-0.5
        logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
        sink = w[a + "attn_sink"].view(1, 1, H, 1).expand(B, T, H, 1)
        probs = F.softmax(torch.cat([logits, sink], -1), dim=-1)[..., :-1]
        out = _rope(torch.einsum("bthk,bkd->bthd", probs, keys), cis.conj())
        G = cfg.o_groups
        wa = w[a + "wo_a.weight"].view(G, -1, H * hd // G)  # [G, o_lora, in]
        o = torch.einsum("btgi,goi->btgo", out.reshape(B, T, G, -1), wa).flatten(-2)
        return F.linear(o, w[a + "wo_b.weight"])

    def compress(self, h: torch.Tensor, c: str, rate: int, C: int, overlap: bool) -> torch.Tensor:
        """Compressed entries [B, C, dim] of windows 0 .. C-1: gated softmax pooling of the
        window's projections (with `overlap`, CSA's: window w-1's first series joins window w's
        second), norm, rope at the window's first position."""
        w = self.w
        B = h.shape[0]
        kv = F.linear(h[:, : C * rate], w[c + "wkv.weight"]).unflatten(1, (C, rate))  # [B, C, rate, width]
        gate = F.linear(h[:, : C * rate], w[c + "wgate.weight"]).unflatten(1, (C, rate)) + w[c + "ape"]
        if overlap:
            d = kv.shape[-1] // 2
            prev_kv = torch.cat([kv.new_zeros(B, 1, rate, d), kv[:, :-1, :, :d]], 1)
            prev_gate = torch.cat([gate.new_full((B, 1, rate, d), float("-inf")), gate[:, :-1, :, :d]], 1)
            kv = torch.cat([prev_kv, kv[..., d:]], 2)
            gate = torch.cat([prev_gate, gate[..., d:]], 2)
        pooled = (kv * gate.softmax(dim=2)).sum(2)
        entries = _rms(pooled, w[c + "norm.weight"], self.cfg.rms_norm_eps)
        return _rope(entries, _cis(torch.arange(C) * rate, self.inv["compress"]))

    @torch.no_grad()
    def select(
        self, h: torch.Tensor, qr: torch.Tensor, a: str, visible: torch.Tensor, rate: int, C: int
    ) -> torch.Tensor:
        """The lightning indexer's choice: of the visible entries, the top-k by its score."""
        cfg, w = self.cfg, self.w
        IH, ihd = cfg.index_n_heads, cfg.index_head_dim
        T = h.shape[1]
        cis = _cis(torch.arange(T), self.inv["compress"])
        iq = _rope(F.linear(qr, w[a + "indexer.wq_b.weight"]).unflatten(-1, (IH, ihd)), cis)
        iw = F.linear(h, w[a + "indexer.weights_proj.weight"]) * IH**-0.5
        ikeys = self.compress(h, a + "indexer.compressor.", rate, C, overlap=True)
        score = (F.relu(torch.einsum("bthd,bcd->bthc", iq, ikeys)) * ihd**-0.5 * iw.unsqueeze(-1)).sum(2)
        top = score.masked_fill(~visible, float("-inf")).topk(min(cfg.index_topk, C), dim=-1).indices
        return visible & torch.zeros_like(visible).scatter_(-1, top, True)

    def moe(self, h: torch.Tensor, f: str, mlp: str, ids: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        logits = F.linear(h, w[f + "gate.weight"])
        scores = F.softplus(logits).sqrt() if cfg.scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)
        with torch.no_grad():
            if mlp == "hash_moe":
                chosen = w[f + "gate.tid2eid"].long()[ids]
            else:
                chosen = torch.topk(scores + w[f + "gate.bias"], cfg.num_experts_per_tok, dim=-1).indices
        wts = scores.gather(-1, chosen)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        flat, out = h.reshape(-1, h.shape[-1]), self.expert(h, f + "shared_experts.")
        routed = torch.zeros_like(flat)
        wflat, cflat = wts.reshape(-1, wts.shape[-1]), chosen.reshape(-1, chosen.shape[-1])
        for e in range(cfg.n_routed_experts):
            gate = (wflat * (cflat == e)).sum(-1)
            rows = gate.detach().nonzero().squeeze(-1)  # only the tokens routed to e are computed
            if rows.numel():
                routed = routed.index_add(0, rows, gate[rows, None] * self.expert(flat[rows], f"{f}experts.{e}."))
        return out + routed.view_as(h)

    def expert(self, h: torch.Tensor, p: str) -> torch.Tensor:
        lim = self.cfg.swiglu_limit
        gate, up = F.linear(h, self.w[p + "w1.weight"]), F.linear(h, self.w[p + "w3.weight"])
        return F.linear(F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim), self.w[p + "w2.weight"])


class TrainableV4:
    """The main model as float leaf tensors (the MTP block's left out) and its forward."""

    def __init__(self, cfg: DeepseekV4Config, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = {k: v.float().clone() for k, v in weights.items() if not k.startswith(("mtp.", "model.mtp."))}
        for k in [k for k in self.w if k.endswith("tid2eid")]:
            self.w[k] = weights[k]  # integers: kept as they are
        self.params = [v.requires_grad_() for k, v in self.w.items() if not k.endswith(FROZEN)]
        self.f = V4Forward(cfg, self.w)

    def streams(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the last layer's residual streams [B, T, hc, D] (what the MTP block reads)."""
        cfg = self.cfg
        x = F.embedding(ids, self.w["embed.weight"]).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
        for i in range(cfg.num_hidden_layers):
            x = self.f.layer(x, f"layers.{i}.", cfg.layer_types[i], cfg.mlp_layer_types[i], ids)
        return x

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.f.head(streams, "", "norm.weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]."""
        return self.logits(self.streams(ids))


class TrainableV4MTP:
    """MTP block n (`mtp.{n}.*`) as float leaf tensors and its forward; the embedding and the
    head are the main model's (not trained here)."""

    def __init__(self, cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], n: int = 0):
        self.cfg, self.p = cfg, f"mtp.{n}."
        self.w = {k: v.float().clone() for k, v in weights.items() if k.startswith(self.p)}
        self.params = [v.requires_grad_() for k, v in self.w.items() if not k.endswith(FROZEN)]
        shared = {k: weights[k].float() for k in ("embed.weight", "head.weight")}
        self.f = V4Forward(cfg, {**self.w, **shared})

    def forward_with_hidden(self, next_ids: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """next_ids [B, T] (token i+1 at position i), streams [B, T, hc, D] (the main model's at
        i) -> (logits [B, T, V] of token i+2, the block's output streams [B, T, hc, D])."""
        p, w, eps = self.p, self.f.w, self.cfg.rms_norm_eps
        e = _rms(F.embedding(next_ids, w["embed.weight"]), w[p + "enorm.weight"], eps)
        h = _rms(streams, w[p + "hnorm.weight"], eps)
        x = F.linear(e, w[p + "e_proj.weight"]).unsqueeze(2) + F.linear(h, w[p + "h_proj.weight"])
        x = self.f.layer(x, p, SLIDING, "moe", next_ids)
        return self.f.head(x, p, p + "norm.weight"), x


def seed_mtp_from_last_layer(cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], n: int = 0) -> None:
    """Start block n from the main model's last layer (every tensor of the same name and shape:
    attention, norms, mHC, experts; its compressor has no counterpart) and from its head (mHC
    head, final norm): a better start than random weights once the main model is trained."""
    last = f"layers.{cfg.num_hidden_layers - 1}."
    for k in [k for k in weights if k.startswith(last)]:
        dst = f"mtp.{n}." + k[len(last) :]
        if dst in weights and weights[dst].shape == weights[k].shape and weights[dst].dtype == weights[k].dtype:
            weights[dst] = weights[k].clone()
    for src in ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight"):
        weights[f"mtp.{n}.{src}"] = weights[src].clone()


class V4Kit:
    """DeepSeek-V4's side of dsv4_engine.spec_decode.train's loops: the trainable forwards, the
    block's inputs (the main model's residual streams before its mHC head, as the engine's
    drafter reads them) and its seeding. V4 keeps no copies of the embedding or the head in the
    block, so nothing follows the main model after training."""

    # train_mtp's recipe: the soft loss plus as much cross-entropy against the target's top-1, at
    # 5e-3 (2e-3 and soft targets only: held-out agreement 41% on v4-tiny; this: 53%).
    MTP_LR, MTP_HARD_WEIGHT = 5e-3, 1.0

    def __init__(self, d):
        self.dir, self.cfg = d, DeepseekV4Config.from_dir(d)
        self.num_mtp = self.cfg.num_nextn_predict_layers

    def base(self, weights: dict) -> TrainableV4:
        return TrainableV4(self.cfg, weights)

    @torch.no_grad()
    def targets(self, weights: dict, seqs: list[list[int]], chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model's streams [N, T, hc, D] and fp32 logits [N, T, V] of the sequences."""
        net, out = TrainableV4(self.cfg, weights), []
        for i in range(0, len(seqs), chunk):
            s = net.streams(torch.tensor(seqs[i : i + chunk]))
            out.append((s, net.logits(s)))
        return torch.cat([s for s, _ in out]), torch.cat([lg for _, lg in out])

    def seed_mtp(self, weights: dict) -> None:
        seed_mtp_from_last_layer(self.cfg, weights)

    def mtp(self, weights: dict) -> TrainableV4MTP:
        return TrainableV4MTP(self.cfg, weights)

    def sync_copies(self, weights: dict) -> None:
        pass
