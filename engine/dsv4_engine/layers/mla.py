"""DeepSeek-V3's MLA attention over a paged latent KV cache.

Weight-absorbed for every token, prefill included: the cache holds only the compressed latent and
the rope key per token, the query's no-position part is folded through W_UK into latent space,
and the value is the latent itself, lifted back through W_UV after attention. One path serves
prefill, chunked prefill and decode; a long extend may attend in the per-head (expanded) form
where that costs fewer multiply-adds (`expanded_is_cheaper`).

Under tensor parallelism a rank holds its heads (q_b, kv_b rows, o_proj columns: dsv4_engine.
parallel.plan) and the whole latent (kv_a replicated); o_proj's partial sums are added up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from dsv4_engine import kv_quant
from dsv4_engine.devices import upload
from dsv4_engine.layers.linear import Linear
from dsv4_engine.layers.norm import RMSNorm
from dsv4_engine.layers.rope import RotaryEmbedding, yarn_mscale
from dsv4_engine.quant import dense

if TYPE_CHECKING:  # a type only: layers import no model module
    from dsv4_engine.models.forward_batch import ForwardBatch

# Mixed steps hand their one-token requests to the decode path (bench/experiments/ab_mixed_step.py
# --change mixed_decode turns it off for the A/B).
MIXED_DECODE_NATIVE = True
# The per-head (expanded) form lifts all of a step's expanded requests in one GEMM a weight and
# attends in causal row blocks (bench/experiments/ab_mixed_step.py --change prefill_attention
# turns it off for the A/B: the per-request lift and SDPA of attend_expanded).
EXPANDED_BATCHED = True
# Query rows a causal block of the per-head form: keys stop at the block's last row, so the
# upper triangle is computed only on the diagonal blocks.
EXPANDED_BLOCK = 64
_CAUSAL_BIAS: dict = {}  # (rows, dtype, device) -> the block's causal mask as 0 / -inf, see _causal_bias


def softmax_scale(cfg) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(mscale_all_dim) squared when the rope is scaled."""
    scale = cfg.qk_head_dim**-0.5
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type", "default")) not in (None, "default"):
        m_all = rs.get("mscale_all_dim", 0)
        factor = float(rs.get("factor", 1.0))
        if m_all and factor > 1:
            m = yarn_mscale(factor, m_all)
            scale *= m * m
    return scale


def expanded_is_cheaper(extend_len: int, seq_len: int, cfg) -> bool:
    """Whether a request's new tokens attend in fewer multiply-adds in the per-head (expanded)
    form than in the absorbed one. Absorbed: each new token's query is folded into and its
    output lifted out of the C-wide latent space (C·(nope+v) a head) and each (query, key) pair
    costs 2C+R; expanded: each cached token's latent is lifted into a key and a value instead
    (C·(nope+v) a head) and a pair costs nope+R+v. So the per-head form wins when
    (seq_len - extend_len)·C·(nope+v) < extend_len·seq_len·(2C - nope - v): always for a fresh
    prefill, never for a decode; at the mla512 widths, for extends past ~73 tokens of a long
    context (bench/experiments/mla_prefill_forms.py measured 1.5-1.7x at 128 new over 128)."""
    C, nope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    return (seq_len - extend_len) * C * (nope + v) < extend_len * seq_len * (2 * C - nope - v)


@dataclass
class MLA:
    cfg: Any  # this rank's ModelConfig (its heads)
    q_a: Optional[Linear]  # None without a q LoRA (q_b is then q_proj)
    q_a_norm: Optional[RMSNorm]
    q_b: Linear
    kv_a: Linear  # -> [latent C | rope key R]
    kv_a_norm: RMSNorm
    w_uk: torch.Tensor  # [H, nope, C]: q_nope -> latent space
    w_uv: torch.Tensor  # [H, v, C]: latent -> value per head
    absorb: dict  # the backend's own layouts of W_UK / W_UV (ops.mla_absorb_weights)
    o: Linear  # row parallel
    rope: RotaryEmbedding
    scale: float
    ops: Any

    @classmethod
    def build(cls, take, prefix: str, cfg, dtype: torch.dtype, rope: RotaryEmbedding, ops, tp) -> "MLA":
        """From DeepSeek-V3's `{prefix}self_attn.*` tensors (this rank's heads)."""
        H, nope, R, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        p = prefix + "self_attn."
        eps = cfg.rms_norm_eps
        kv_a = take(p + "kv_a_proj_with_mqa.weight")
        q_a = q_a_norm = None
        if cfg.q_lora_rank:
            q_a = Linear.column(take(p + "q_a_proj.weight"), ops)
            q_a_norm = RMSNorm(take(p + "q_a_layernorm.weight"), eps, ops)
            q_b = take(p + "q_b_proj.weight")
        else:
            q_b = take(p + "q_proj.weight")
        if not cfg.extra.get("rope_interleave", True):
            q_b, kv_a = dense(q_b, dtype), dense(kv_a, dtype)  # rows permuted in place below
            # The ops rotate interleaved pairs; a half-split checkpoint becomes interleaved by
            # permuting its rope rows, which leaves every q.k dot product unchanged.
            perm = torch.stack([torch.arange(R // 2), torch.arange(R // 2) + R // 2], 1).reshape(-1)
            qb = q_b.view(H, nope + R, -1)
            qb[:, nope:] = qb[:, nope:][:, perm]
            kv_a[cfg.kv_lora_rank :] = kv_a[cfg.kv_lora_rank :][perm]
        # kv_b is split per head for the absorbed form (bmm, not F.linear): dense, as DeepSeek's
        # own inference dequantizes it
        kv_b = dense(take(p + "kv_b_proj.weight"), dtype).view(H, nope + v, cfg.kv_lora_rank)
        w_uk, w_uv = kv_b[:, :nope].contiguous(), kv_b[:, nope:].contiguous()
        return cls(
            cfg,
            q_a,
            q_a_norm,
            Linear.column(q_b, ops),
            Linear.column(kv_a, ops),
            RMSNorm(take(p + "kv_a_layernorm.weight"), eps, ops),
            w_uk,
            w_uv,
            ops.mla_absorb_weights(w_uk, w_uv),
            Linear.row(take(p + "o_proj.weight"), ops, tp),
            rope,
            softmax_scale(cfg),
            ops,
        )

    def __call__(
        self, x: torch.Tensor, fb: ForwardBatch, kv_layer: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Attention of x [T, D] at fb's positions; writes their latent + rope key at `slots`
        (page, offset) of this layer's pages first. -> [T, D], summed over ranks."""
        cfg, ops = self.cfg, self.ops
        T = x.shape[0]
        H, nope, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.q_b(self.q_a_norm(self.q_a(x))[0]) if self.q_a is not None else self.q_b(x)
        q = q.view(T, H, cfg.qk_head_dim)
        ckv = self.kv_a(x)
        latent, _ = self.kv_a_norm(ckv[:, :C])
        k_rope = ckv[:, C:].unsqueeze(1)  # [T, 1, R]
        self.rope(q[:, :, nope:], fb.positions)
        self.rope(k_rope, fb.positions)
        # Write this step's latent + rope key into the pages before attending, so new tokens
        # see themselves and each other through the same paged read as the prefix.
        pages, offs = slots
        kv_quant.store_(kv_layer, (pages, offs), torch.cat([latent, k_rope.squeeze(1)], dim=-1))  # fp8kv: quantized
        kv_layer, fb = kv_quant.readable_pages(kv_layer, fb, q.dtype, ops)  # fp8kv: FP8 pages read as q's dtype
        if not fb.all_decode and ops.expanded_prefill and fb.extend_lens_host is not None:
            expand = [
                expanded_is_cheaper(e, n, cfg) if e else False for e, n in zip(fb.extend_lens_host, fb.seq_lens_host)
            ]
            if any(expand):
                return self.o(self.attend_mixed_forms(q, fb, kv_layer, expand).reshape(T, -1))
        return self.o(self.attend_absorbed(q, fb, kv_layer).transpose(0, 1).reshape(T, -1))

    def attend_absorbed(self, q: torch.Tensor, fb: ForwardBatch, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention in latent space (W_UK folded into the query, W_UV applied after):
        [H, T, v] for q [T, H, nope + R]."""
        cfg, ops = self.cfg, self.ops
        C = cfg.kv_lora_rank
        q_full = ops.mla_absorb_q(q, self.w_uk, self.absorb)  # [T, H, C + R]
        if fb.all_decode:
            o = ops.mla_decode(q_full, kv_layer, fb.block_table, fb.seq_lens, self.scale, C)
        else:
            bound = max(fb.extend_lens_host) if fb.extend_lens_host else None  # host int: no device read
            o = ops.mla_extend(
                q_full, kv_layer, fb.block_table, fb.seq_lens, fb.extend_lens, self.scale, C, max_extend_len=bound
            )
        return ops.mla_lift_v(o, q.dtype, self.w_uv, self.absorb)  # [H, T, v]

    def attend_mixed_forms(
        self, q: torch.Tensor, fb: ForwardBatch, kv_layer: torch.Tensor, expand: list[bool]
    ) -> torch.Tensor:
        """[T, H, v]: requests marked in `expand` attend in the per-head form, the others in
        the absorbed form (one call over all of them)."""
        cfg = self.cfg
        T, H = q.shape[0], cfg.num_attention_heads
        out = torch.empty(T, H, cfg.v_head_dim, dtype=q.dtype, device=q.device)
        exts, lens = fb.extend_lens_host, fb.seq_lens_host
        starts = [0]
        for e in exts:
            starts.append(starts[-1] + e)
        keep = [b for b, x in enumerate(expand) if not x and exts[b]]
        if keep:
            rows = upload([i for b in keep for i in range(starts[b], starts[b + 1])], torch.long, q.device)
            idx = upload(keep, torch.long, q.device)
            sub = type(fb)(
                input_ids=fb.input_ids[rows],
                positions=fb.positions[rows],
                slot_mapping=fb.slot_mapping[rows],
                block_table=fb.block_table[idx],
                seq_lens=fb.seq_lens[idx],
                extend_lens=fb.extend_lens[idx],
                logits_indices=fb.logits_indices[idx],
                # the decoding requests of a mixed step (one new token each) are a decode batch:
                # the native decode kernel instead of mla_extend's per-request loop
                all_decode=all(exts[b] == 1 for b in keep) and MIXED_DECODE_NATIVE,
                page_size=fb.page_size,
                seq_lens_host=[lens[b] for b in keep],
                extend_lens_host=[exts[b] for b in keep],
            )
            out[rows] = self.attend_absorbed(q[rows], sub, kv_layer).transpose(0, 1)
        if EXPANDED_BATCHED:
            self.attend_expanded_batched(q, fb, kv_layer, [b for b, x in enumerate(expand) if x], starts, out)
            return out
        for b, x in enumerate(expand):
            if x:
                out[starts[b] : starts[b + 1]] = self.attend_expanded(
                    q[starts[b] : starts[b + 1]], fb.block_table[b], lens[b], kv_layer
                )
        return out

    def attend_expanded_batched(
        self,
        q: torch.Tensor,
        fb: ForwardBatch,
        kv_layer: torch.Tensor,
        reqs: list[int],
        starts: list[int],
        out: torch.Tensor,
    ) -> None:
        """attend_expanded for the requests `reqs` of a step at once, into out [T, H, v]: their
        cached latents gathered in one read of the pages and lifted by one GEMM through W_UK and
        one through W_UV (weights viewed [H*nope, C], no copy), then causal attention per request
        in blocks of query rows (no SDPA math path: its mask ops and the full square)."""
        cfg = self.cfg
        C, H, R = cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_rope_head_dim
        nope, vd = cfg.qk_nope_head_dim, cfg.v_head_dim
        exts, lens = fb.extend_lens_host, fb.seq_lens_host
        page_size = kv_layer.shape[1]
        n_pages = [-(-lens[b] // page_size) for b in reqs]
        pages = torch.cat([fb.block_table[b, :n] for b, n in zip(reqs, n_pages)]).long()
        kv = kv_layer[pages].reshape(-1, kv_layer.shape[-1])
        first = [0]  # each request's first row in kv: its pages' start
        for n in n_pages:
            first.append(first[-1] + n * page_size)
        if any(lens[b] % page_size for b in reqs):  # drop the unwritten tails of last pages
            rows = torch.cat([torch.arange(f, f + lens[b]) for f, b in zip(first, reqs)]).to(kv.device)
            kv = kv[rows]
            first = [0]
            for b in reqs:
                first.append(first[-1] + lens[b])
        kv = kv.to(q.dtype)
        latent = kv[:, :C]
        k_nope = F.linear(latent, self.w_uk.reshape(H * nope, C)).view(-1, H, nope)
        v = F.linear(latent, self.w_uv.reshape(H * vd, C)).view(-1, H, vd)
        # scores, softmax and values in fp32 for half-precision models, as SDPA's math path does
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        for f, b in zip(first, reqs):
            s, e = lens[b], exts[b]
            k = torch.empty(H, s, nope + R, dtype=acc, device=q.device)
            k[:, :, :nope] = k_nope[f : f + s].transpose(0, 1)
            k[:, :, nope:] = kv[f : f + s, C:]
            kt = k.transpose(1, 2)  # [H, nope + R, s]
            vh = v[f : f + s].transpose(0, 1).to(acc)  # [H, s, v]
            qh = q[starts[b] : starts[b + 1]].transpose(0, 1).to(acc)  # [H, e, nope + R]
            for r0 in range(0, e, EXPANDED_BLOCK):
                r1 = min(e, r0 + EXPANDED_BLOCK)
                kc = s - e + r1  # keys visible to the block's last row
                scores = torch.baddbmm(
                    self._causal_bias(r1 - r0, kc, acc, q.device), qh[:, r0:r1], kt[:, :, :kc], alpha=self.scale
                )
                o = torch.bmm(torch.softmax(scores, -1), vh[:, :kc])  # [H, rows, v]
                out[starts[b] + r0 : starts[b] + r1] = o.transpose(0, 1)

    def _causal_bias(self, rows: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[rows, keys]: 0 where query row i (the last `rows` of `keys` positions) sees key j,
        -inf past it; a column slice of one cached tensor per (rows, dtype, device)."""
        t = _CAUSAL_BIAS.get((rows, dtype, device))
        if t is None or t.shape[1] < keys:
            width = max(keys, 2 * t.shape[1] if t is not None else 256)
            j = torch.arange(width, device=device)[None, :]
            i = torch.arange(width - rows, width, device=device)[:, None]
            t = torch.zeros(rows, width, dtype=dtype, device=device).masked_fill_(j > i, float("-inf"))
            _CAUSAL_BIAS[(rows, dtype, device)] = t
        return t[:, t.shape[1] - keys :]

    def attend_expanded(
        self, q: torch.Tensor, table_row: torch.Tensor, seq_len: int, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        """One request's new tokens q [e, H, nope + R] over its seq_len cached tokens in the
        per-head form: the cached latents lifted through W_UK / W_UV into per-head keys and
        values, then causal attention -> [e, H, v]."""
        cfg = self.cfg
        C, H, R = cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_rope_head_dim
        e = q.shape[0]
        page_size = kv_layer.shape[1]
        n_pages = -(-seq_len // page_size)
        kv = kv_layer[table_row[:n_pages].long()].reshape(-1, kv_layer.shape[-1])[:seq_len].to(q.dtype)
        latent, k_rope = kv[:, :C], kv[:, C:]
        k_nope = torch.matmul(latent, self.w_uk.transpose(1, 2))  # [H, S, nope]
        v = torch.matmul(latent, self.w_uv.transpose(1, 2))  # [H, S, v]
        k = torch.cat([k_nope, k_rope.unsqueeze(0).expand(H, seq_len, R)], dim=-1)
        qh = q.transpose(0, 1)  # [H, e, nope + R]
        if e == seq_len:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scale)
        else:
            visible = (
                torch.arange(seq_len, device=q.device)[None, :]
                <= torch.arange(seq_len - e, seq_len, device=q.device)[:, None]
            )
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible, scale=self.scale)
        return o.transpose(0, 1)
