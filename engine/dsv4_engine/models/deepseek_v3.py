"""DeepSeek-V3 forward pass over a paged latent KV cache.

Attention is MLA in its weight-absorbed form for every token, prefill included: the cache holds
only the compressed latent and the rope key per token, the query's no-position part is folded
through W_UK into latent space, and the value is the latent itself, lifted back through W_UV
after attention. One attention path serves prefill, chunked prefill and decode.

Every op (attention, MoE routing and experts, RMSNorm, rotary embedding, the dense projections)
goes through `ops`, the engine's kernel backend (dsv4_kernels.api.get_ops: torch, cpu or triton).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_engine.config import ModelConfig
from dsv4_engine import kv_quant
from dsv4_engine.devices import upload
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.models.state import StateSpec
from dsv4_engine.quant import dense, log_resident, moe_experts_for, place
from dsv4_engine.step_phases import PHASES


def yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of the rope, with yarn scaling when configured."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = cfg.rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type in (None, "default"):
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (default or yarn)")
    factor = float(rs["factor"])
    orig_max = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = get_mscale(factor, m) / get_mscale(factor, m_all) if (m and m_all) else get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig_max / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type", "default")) not in (None, "default"):
        m_all = rs.get("mscale_all_dim", 0)
        factor = float(rs.get("factor", 1.0))
        if m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale *= m * m
    return scale


# Mixed steps hand their one-token requests to the decode path (bench/ab_decode_step.py
# --change mixed_decode turns it off for the A/B).
MIXED_DECODE_NATIVE = True
# The per-head (expanded) form lifts all of a step's expanded requests in one GEMM a weight and
# attends in causal row blocks (bench/ab_mixed_step.py --change prefill_attention turns it off
# for the A/B: the per-request lift and SDPA of _attend_expanded).
EXPANDED_BATCHED = True
# Query rows a causal block of the per-head form: keys stop at the block's last row, so the
# upper triangle is computed only on the diagonal blocks.
EXPANDED_BLOCK = 64
_CAUSAL_BIAS: dict = {}  # (rows, dtype, device) -> the block's causal mask as 0 / -inf, see _causal_bias


def expanded_is_cheaper(extend_len: int, seq_len: int, cfg: ModelConfig) -> bool:
    """Whether a request's new tokens attend in fewer multiply-adds in the per-head (expanded)
    form than in the absorbed one. Absorbed: each new token's query is folded into and its
    output lifted out of the C-wide latent space (C·(nope+v) a head) and each (query, key) pair
    costs 2C+R; expanded: each cached token's latent is lifted into a key and a value instead
    (C·(nope+v) a head) and a pair costs nope+R+v. So the per-head form wins when
    (seq_len - extend_len)·C·(nope+v) < extend_len·seq_len·(2C - nope - v): always for a fresh
    prefill, never for a decode; at the mla512 widths, for extends past ~73 tokens of a long
    context (bench/mla_prefill_forms.py measured 1.5-1.7x at 128 new over 128)."""
    C, nope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    return (seq_len - extend_len) * C * (nope + v) < extend_len * seq_len * (2 * C - nope - v)


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
        # One rank of --tp-size N (dsv4_engine.parallel): cfg and weights are this rank's heads,
        # MLP width and experts; tp sums the partial results and maps expert ids to local ones.
        self.tp = tp
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.scale = softmax_scale(cfg)
        inv_freq, attn_factor = yarn_inv_freq(cfg)
        max_pos = max(cfg.max_position_embeddings, 1)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        self.cos = (freqs.cos() * attn_factor).to(device)
        self.sin = (freqs.sin() * attn_factor).to(device)
        self._build(weights)

    # ---- weights -------------------------------------------------------------------------------

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        cfg, dt, dev = self.cfg, self.dtype, self.device

        def take(name: str, dtype: torch.dtype = dt) -> torch.Tensor:
            # fp8/fp4 weights stay quantized on CUDA (F.linear dispatches on them), dense elsewhere
            if name not in w:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return place(w[name], dev, dtype, self.ops)

        self.moe_experts = moe_experts_for(self.ops)
        self.embed = dense(take("model.embed_tokens.weight"), dt)
        self.final_norm = take("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings and "lm_head.weight" not in w else take("lm_head.weight")
        self.layers = [self.build_layer(w, i, take) for i in range(cfg.num_hidden_layers)]
        self.resident_bytes = log_resident("deepseek_v3", dev, self.embed, self.lm_head, self.final_norm, self.layers)

    def build_layer(self, w: dict[str, torch.Tensor], i: int, take) -> dict[str, torch.Tensor]:
        """Decoder layer i's weights as the forward uses them (also the decoder layer of an MTP
        block, stored at index num_hidden_layers: dsv4_engine.spec_decode)."""
        cfg, dt = self.cfg, self.dtype
        H, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        interleaved = cfg.extra.get("rope_interleave", True)
        p = f"model.layers.{i}."
        L: dict[str, torch.Tensor] = {
            "input_norm": take(p + "input_layernorm.weight"),
            "post_norm": take(p + "post_attention_layernorm.weight"),
            "kv_a": take(p + "self_attn.kv_a_proj_with_mqa.weight"),
            "kv_a_norm": take(p + "self_attn.kv_a_layernorm.weight"),
            "o": take(p + "self_attn.o_proj.weight"),
        }
        if cfg.q_lora_rank:
            L["q_a"] = take(p + "self_attn.q_a_proj.weight")
            L["q_a_norm"] = take(p + "self_attn.q_a_layernorm.weight")
            q_b = take(p + "self_attn.q_b_proj.weight")
        else:
            q_b = take(p + "self_attn.q_proj.weight")
        if not interleaved:
            q_b, L["kv_a"] = dense(q_b, dt), dense(L["kv_a"], dt)  # rows permuted in place below
            # The ops rotate interleaved pairs; a half-split checkpoint becomes interleaved by
            # permuting its rope rows, which leaves every q.k dot product unchanged.
            perm = torch.stack([torch.arange(rope // 2), torch.arange(rope // 2) + rope // 2], 1).reshape(-1)
            qb = q_b.view(H, nope + rope, -1)
            qb[:, nope:] = qb[:, nope:][:, perm]
            L["kv_a"][cfg.kv_lora_rank :] = L["kv_a"][cfg.kv_lora_rank :][perm]
        L["q_b"] = q_b
        # kv_b is split per head for the absorbed form (bmm, not F.linear): dense, as DeepSeek's
        # own inference dequantizes it
        kv_b = dense(take(p + "self_attn.kv_b_proj.weight"), dt).view(H, nope + v, cfg.kv_lora_rank)
        L["w_uk"] = kv_b[:, :nope].contiguous()  # [H, nope, C]: q_nope -> latent space
        L["w_uv"] = kv_b[:, nope:].contiguous()  # [H, v, C]: latent -> value per head
        L.update(self.ops.mla_absorb_weights(L["w_uk"], L["w_uv"]))  # the backend's own layouts of them
        if cfg.is_moe_layer(i):
            L["gate"] = take(p + "mlp.gate.weight", torch.float32)
            L["bias"] = take(p + "mlp.gate.e_score_correction_bias", torch.float32)
            L["w13"], L["w2"] = self._experts(w, p + "mlp.experts", take)
            if cfg.n_shared_experts:
                s = p + "mlp.shared_experts."
                L["s_w13"] = torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")], 0)
                L["s_w2"] = take(s + "down_proj.weight")
        else:
            L["d_w13"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
            L["d_w2"] = take(p + "mlp.down_proj.weight")
        return L

    def _experts(self, w, prefix: str, take) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack experts into [E, 2I, hidden] and [E, hidden, I]; reads DeepSeek's per-expert
        tensors or the fused ones some transformers versions write."""
        if prefix + ".gate_up_proj" in w:
            return take(prefix + ".gate_up_proj"), take(prefix + ".down_proj")
        E = self.cfg.n_routed_experts
        w13 = torch.stack(
            [
                torch.cat([take(f"{prefix}.{e}.gate_proj.weight"), take(f"{prefix}.{e}.up_proj.weight")], 0)
                for e in range(E)
            ]
        )
        w2 = torch.stack([take(f"{prefix}.{e}.down_proj.weight") for e in range(E)])
        return w13.contiguous(), w2.contiguous()

    # ---- forward -------------------------------------------------------------------------------

    def _rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rmsnorm(x, weight, self.cfg.rms_norm_eps, residual)

    def _rope_(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.ops.rope_interleaved_(x, positions, self.cos, self.sin)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, w)

    def _mlp(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return self.ops.mlp(x, w13, w2)

    def _attention(
        self,
        L: dict,
        x: torch.Tensor,
        fb: ForwardBatch,
        kv_layer: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        T = x.shape[0]
        H, nope, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            qa, _ = self._rmsnorm(self._linear(x, L["q_a"]), L["q_a_norm"])
            q = self._linear(qa, L["q_b"])
        else:
            q = self._linear(x, L["q_b"])
        q = q.view(T, H, cfg.qk_head_dim)
        ckv = self._linear(x, L["kv_a"])
        latent, _ = self._rmsnorm(ckv[:, :C], L["kv_a_norm"])
        k_rope = ckv[:, C:].unsqueeze(1)  # [T, 1, R]
        q_rope = q[:, :, nope:]
        self._rope_(q_rope, fb.positions)
        self._rope_(k_rope, fb.positions)
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
                o = self._attend_mixed_forms(L, q, fb, kv_layer, expand)
                return self._reduce(self._linear(o.reshape(T, -1), L["o"]))
        o = self._attend_absorbed(L, q, fb, kv_layer)
        return self._reduce(self._linear(o.transpose(0, 1).reshape(T, -1), L["o"]))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x)

    def _attend_absorbed(self, L: dict, q: torch.Tensor, fb: ForwardBatch, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention in latent space (W_UK folded into the query, W_UV applied after):
        [H, T, v] for q [T, H, nope + R]."""
        cfg, ops = self.cfg, self.ops
        C = cfg.kv_lora_rank
        q_full = ops.mla_absorb_q(q, L["w_uk"], L)  # [T, H, C + R]
        if fb.all_decode:
            o = ops.mla_decode(q_full, kv_layer, fb.block_table, fb.seq_lens, self.scale, C)
        else:
            bound = max(fb.extend_lens_host) if fb.extend_lens_host else None  # host int: no device read
            o = ops.mla_extend(
                q_full, kv_layer, fb.block_table, fb.seq_lens, fb.extend_lens, self.scale, C, max_extend_len=bound
            )
        return ops.mla_lift_v(o, q.dtype, L["w_uv"], L)  # [H, T, v]

    def _attend_mixed_forms(
        self, L: dict, q: torch.Tensor, fb: ForwardBatch, kv_layer: torch.Tensor, expand: list[bool]
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
            sub = ForwardBatch(
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
            out[rows] = self._attend_absorbed(L, q[rows], sub, kv_layer).transpose(0, 1)
        if EXPANDED_BATCHED:
            self._attend_expanded_batched(L, q, fb, kv_layer, [b for b, x in enumerate(expand) if x], starts, out)
            return out
        for b, x in enumerate(expand):
            if x:
                out[starts[b] : starts[b + 1]] = self._attend_expanded(
                    L, q[starts[b] : starts[b + 1]], fb.block_table[b], lens[b], kv_layer
                )
        return out

    def _attend_expanded_batched(
        self,
        L: dict,
        q: torch.Tensor,
        fb: ForwardBatch,
        kv_layer: torch.Tensor,
        reqs: list[int],
        starts: list[int],
        out: torch.Tensor,
    ) -> None:
        """_attend_expanded for the requests `reqs` of a step at once, into out [T, H, v]: their
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
        k_nope = F.linear(latent, L["w_uk"].reshape(H * nope, C)).view(-1, H, nope)
        v = F.linear(latent, L["w_uv"].reshape(H * vd, C)).view(-1, H, vd)
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

    def _attend_expanded(
        self, L: dict, q: torch.Tensor, table_row: torch.Tensor, seq_len: int, kv_layer: torch.Tensor
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
        k_nope = torch.matmul(latent, L["w_uk"].transpose(1, 2))  # [H, S, nope]
        v = torch.matmul(latent, L["w_uv"].transpose(1, 2))  # [H, S, v]
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

    def _moe(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        logits = self._linear(x.float(), L["gate"])
        weights, ids = ops.moe_route(
            logits,
            L["bias"],
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        # EPLB hook (dsv4_engine.parallel.eplb_apply.LayerRoute): counts this layer's expert loads
        # and maps logical expert ids to physical slots (a replicated expert's copies)
        route = L.get("eplb")
        if route is not None:
            ids = route(ids)
        if self.tp is not None:
            weights, ids = self.tp.local_experts(weights, ids)
        shared = (L["s_w13"], L["s_w2"]) if "s_w13" in L else None
        return self._reduce(ops.moe_block(x, L["w13"], L["w2"], weights, ids, shared, self.moe_experts))

    def decoder_layer(
        self,
        L: dict,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        fb: ForwardBatch,
        kv_layer: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: (output, residual) as the next layer's rmsnorm takes them."""
        h, residual = self._rmsnorm(x, L["input_norm"], residual)
        PHASES.lap("norms")
        x = self._attention(L, h, fb, kv_layer, slots)
        PHASES.lap("attention")
        h, residual = self._rmsnorm(x, L["post_norm"], residual)
        PHASES.lap("norms")
        x = self._moe(L, h) if "gate" in L else self._reduce(self._mlp(h, L["d_w13"], L["d_w2"]))
        PHASES.lap("moe")
        return x, residual

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
        for i, L in enumerate(self.layers):
            x, residual = self.decoder_layer(L, x, residual, fb, kv_pool[:, i], slots)
        h = x + residual if rows is None else x[rows] + residual[rows]
        h, _ = self._rmsnorm(h, self.final_norm)
        return h

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, states: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits of each request's last new token, [B, vocab]."""
        logits = self._linear(self.hidden_states(fb, states, fb.logits_indices), self.lm_head).float()
        PHASES.lap("lm_head")
        return logits
