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

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_engine import kv_quant
from dsv4_engine.devices import upload
from dsv4_engine.layers.moe import V4MoE
from dsv4_engine.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_engine.models.deepseek_v4_weights import load_v4_weights, to_release_layout
from dsv4_engine.models.forward_batch import ForwardBatch, V4Batch, request_spans
from dsv4_engine.models import v4_verify
from dsv4_engine.models.v4_compressor import V4Compressors
from dsv4_engine.models.v4_torch_attention import V4TorchAttention
from dsv4_engine.models.state import StateSpec
from dsv4_engine.quant import dense, log_resident, moe_experts_for, one_format, place
from dsv4_engine.step_phases import PHASES
from dsv4_kernels.api import get_ops


class DeepseekV4(V4Compressors, V4TorchAttention):
    """Weights plus the forward pass; every per-request state lives in engine-owned tensors."""

    SWA_KV = "swa_kv"
    CSA_KV = "csa_kv"
    CSA_INDEX_K = "csa_index_k"
    HCA_KV = "hca_kv"
    CSA_STAGE = "csa_stage"
    CSA_INDEX_STAGE = "csa_index_stage"
    HCA_STAGE = "hca_stage"
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
        self.tp = tp  # one rank of --tp-size N: this rank's experts only (dsv4_engine.parallel)
        self._step_index: dict = {}  # see _index
        self.ops = ops if ops is not None else get_ops("cpu")
        # The kernel path (attention, indexer, compressor pooling, mHC, MoE routing and experts
        # through dsv4_kernels' V4 API) runs when the backend asks for it, as the Triton one does;
        # the torch backend keeps the batched torch path below, the same math tuned for the CPU
        # (dsv4_kernels.reference_v4 is its kernel-shaped twin: the kernels' oracle).
        self.kops = self.ops if self.ops.v4_kernel_path else None
        # The torch path writes prefix-cache snapshots at boundaries inside a chunk
        # (`_save_snapshots`); on the kernel path the scheduler ends a chunk there instead.
        self.snapshots_in_forward = self.kops is None
        self.dtype = dtype
        self.device = torch.device(device)
        self.reuse_step_indices = True  # see _memo
        # V4's window attention as one backend call where the backend has one for this width
        # (the CPU's C kernel: cheaper than the torch form's ~25 ops up to a few thousand wide)
        self.attend_in_one_call = self.kops is None and self.ops.v4_native_attention(
            cfg.num_attention_heads * cfg.head_dim, dtype
        )
        self.take_rows = True  # see _take
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
            return place(w[name], dev, dtype, self.ops)

        f32 = torch.float32  # mHC, norms, sinks, position biases stay fp32, as in the release
        self.moe_experts = moe_experts_for(self.ops, cfg.swiglu_limit)  # used when experts stay quantized
        self.embed = dense(take("embed.weight"), dt)
        self.head = take("head.weight")
        self.norm = take("norm.weight", f32)
        self.hc_head = (take("hc_head_fn", f32), take("hc_head_base", f32), take("hc_head_scale", f32))
        self.layers: list[dict] = []
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
                L["comp"] = (
                    take(c + "wkv.weight"),
                    take(c + "wgate.weight"),
                    take(c + "ape", f32),
                    take(c + "norm.weight", f32),
                )
            if L["type"] == CSA:
                c = a + "indexer.compressor."
                L["icomp"] = (
                    take(c + "wkv.weight"),
                    take(c + "wgate.weight"),
                    take(c + "ape", f32),
                    take(c + "norm.weight", f32),
                )
                L["idx_wq_b"] = take(a + "indexer.wq_b.weight")
                L["idx_w"] = take(a + "indexer.weights_proj.weight")
            L["moe"] = self.moe_layer(take, f, hashed=cfg.mlp_layer_types[i] == "hash_moe")
            self._fuse_projections(L)
            self.layers.append(L)
        self.resident_bytes = log_resident(
            "deepseek_v4", dev, self.embed, self.head, self.norm, self.hc_head, self.layers
        )

    @staticmethod
    def _fuse_projections(L: dict) -> None:
        """One matmul for everything a layer projects from its input (and one from the q LoRA):
        the weights are concatenated once and the per-name entries become views into it, so
        nothing is held twice. At small widths this halves the op count of a step."""

        def fuse(key: str, names: list[str]) -> None:
            fused = torch.cat(one_format([L[n] for n in names]), 0).contiguous()
            L[key], L[key + "_split"], row = fused, [L[n].shape[0] for n in names], 0
            for n in names:
                L[n] = fused[row : row + L[n].shape[0]]
                row += L[n].shape[0]

        names = ["wq_a", "wkv"]
        if "comp" in L:
            L["comp_wkv"], L["comp_wgate"] = L["comp"][0], L["comp"][1]
            names += ["comp_wkv", "comp_wgate"]
        if "icomp" in L:
            L["icomp_wkv"], L["icomp_wgate"] = L["icomp"][0], L["icomp"][1]
            names += ["icomp_wkv", "icomp_wgate", "idx_w"]
        fuse("w_in", names)
        if "comp" in L:
            L["comp"] = (L["comp_wkv"], L["comp_wgate"], *L["comp"][2:])
        if "icomp" in L:
            L["icomp"] = (L["icomp_wkv"], L["icomp_wgate"], *L["icomp"][2:])
            fuse("w_qb", ["wq_b", "idx_wq_b"])

    # ---- mHC -----------------------------------------------------------------------------------

    def _hc(self, x: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        cfg = self.cfg
        fn, base, scale = params
        if self.kops is not None:
            return self.kops.v4_hc_pre(x, fn, base, scale, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        flat = x.reshape(x.shape[0], -1).float()
        # rms by a norm: one reduction, no squared copy of the streams
        ms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square_().div_(flat.shape[-1])
        mixes = F.linear(flat * ms.add_(cfg.rms_norm_eps).rsqrt_(), fn)
        return self.ops.v4_hc_pre_tail(mixes, base, scale, x, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def _hc_mix(self, x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # comb is applied transposed: stream k gets sum_j comb[j, k] * x[j]
        if self.kops is not None:
            return self.kops.v4_hc_post(x, out, post, comb)
        return self.ops.v4_hc_mix(x, out, post, comb)

    # ---- MoE -----------------------------------------------------------------------------------

    def moe_layer(self, take, prefix: str, hashed: bool) -> V4MoE:
        """The MoE block of a layer (or of an MTP block) from its `{prefix}gate/experts/shared_experts`."""
        return V4MoE.build(take, prefix, self.cfg, hashed, self.ops, self.kops, self.tp, self.moe_experts)

    def _moe(self, L: dict, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return L["moe"](x, input_ids)

    # ---- compressors ---------------------------------------------------------------------------

    def _gather_entries(
        self, store: torch.Tensor, block_table: torch.Tensor, w: torch.Tensor, rate: int, page_size: int
    ) -> torch.Tensor:
        """Entries w [C] of every request of block_table [B, pages] from a layer's paged store
        [num_pages, epp, dim]: [B, C, dim] (entries a request has not closed are masked by the caller)."""
        page, off = self._locate(w, rate, page_size, store.shape[1])
        got = store[block_table[:, page].long(), off[None].expand(block_table.shape[0], -1)]
        return kv_quant.decode(got, self.dtype)  # fp8kv: FP8 entries read as the model's dtype

    def _index(self, key: tuple, values, device: torch.device) -> torch.Tensor:
        """An index tensor of this step built from host ints (the batch's lengths), uploaded once
        per step and shared by every layer. Uploading does not wait for the device; learning the
        same indices from device values (nonzero, boolean masks, .max()) would, on a GPU."""
        t = self._step_index.get(key)
        if t is None:
            t = self._step_index[key] = upload(values(), torch.long, device)
        return t

    def _memo(self, key: tuple, make):
        """Anything a decode step computes from positions, slots and the block table alone (the
        sliding-window masks, the entries' gather and window-closing indices) is the same for
        every layer of a rate: made by the first layer and reused by the rest of the step."""
        if not self.reuse_step_indices:  # bench/ab_v4_step.py's "before"
            return make()
        got = self._step_index.get(key)
        if got is None:
            got = self._step_index[key] = make()
        return got

    def _span_tensors(self, spans: list[tuple[int, int, int]], device: torch.device):
        """(first row, new tokens, first position) of each request as [B] tensors."""
        key = tuple(spans)
        return tuple(
            self._index((what, key), lambda c=c: [s[c] for s in spans], device)
            for c, what in enumerate(("row", "n", "start"))
        )

    def _take(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x[idx] for an index tensor over x's first dim: by index_select, one copy per row,
        where advanced indexing walks every element (the same values, bit for bit)."""
        if not self.take_rows:  # bench/ab_v4_step.py's "before"
            return x[idx]
        return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])

    @staticmethod
    def _locate(w: torch.Tensor, rate: int, page_size: int, epp: int) -> tuple[torch.Tensor, torch.Tensor]:
        # as StateSpec.entry_location: the page of the window's first token
        return (w * rate) // page_size, w % epp

    # ---- attention -----------------------------------------------------------------------------

    def _attention(
        self,
        i: int,
        L: dict,
        h: torch.Tensor,
        fb: V4Batch,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int, int]],
        rope: dict,
    ) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        kind = L["type"]
        table = rope["main" if kind == SLIDING else "compress"]
        parts = F.linear(h, L["w_in"]).split(L["w_in_split"], dim=-1)
        ops = self.ops  # norms + rope: one backend call each
        qr = ops.v4_rms_rope(parts[0][:, None], L["q_norm"], eps, None).view(T, -1)
        kv = ops.v4_rms_rope(parts[1][:, None], L["kv_norm"], eps, table).view(T, -1)  # [T, hd]: key == value
        proj = {}
        if kind in (CSA, HCA):
            proj["comp"] = (parts[2], parts[3])
        if kind == CSA:
            proj["icomp"] = (parts[4], parts[5])
            proj["iw"] = parts[6].float() * cfg.index_n_heads**-0.5
            q, iq = F.linear(qr, L["w_qb"]).split(L["w_qb_split"], dim=-1)
            iq = iq.reshape(T, cfg.index_n_heads, cfg.index_head_dim)
            proj["iq"] = ops.v4_rms_rope(iq, None, eps, rope["compress"], norm=False)
        else:
            q = F.linear(qr, L["wq_b"])
        q = ops.v4_rms_rope(q.reshape(T, H, hd), None, eps, table)
        if isinstance(spans, v4_verify.FixedRows):  # a verify step at a fixed shape (a CUDA graph's)
            out = v4_verify.attend(self, i, L, q, kv, proj, fb, states, spans.n)
        elif self.kops is not None:
            out = self._attend_kernels(i, L, q, kv, proj, fb, states, spans)  # spans None: a captured decode
        elif all(n == 1 for _, n, _ in spans):
            out = self._attend_decode(i, L, q, kv, proj, fb, states, spans)
        else:
            out = self._attend_varlen(i, L, q, kv, proj, fb, states, spans)
        out = ops.v4_rms_rope(out, None, eps, table, norm=False, conj=True, inplace=True)
        G = cfg.o_groups
        grouped = out.reshape(T, G, -1).transpose(0, 1)  # [G, T, H*hd/G]
        wa = L["wo_a"].view(G, -1, grouped.shape[-1]).transpose(1, 2)  # [G, in, o_lora]
        o = torch.bmm(grouped, wa).transpose(0, 1).reshape(T, -1)
        return F.linear(o, L["wo_b"])

    def _save_snapshots(
        self, fb: V4Batch, group: list[int], spans: list[tuple[int, int, int]], name: str, layer: int, ext: torch.Tensor
    ) -> None:
        """The prefix cache's snapshots inside this step's chunks (torch path): slot state `name`
        of request group[k] as it stands at a boundary b its chunk passes, taken from ext [B,
        S + Lmax, ...] (positions start - S ..: what the row held, then the chunk), into
        snapshot row sid at the ring offsets b - S .. b - 1 (mod S), as the row itself would
        hold them had the chunk ended at b. `fb.snapshots`: (request, b, sid) with start < b < end."""
        snaps = fb.snapshots
        if not snaps:
            return
        store = fb.snapshot_states[name]
        S = store.shape[2]
        keep = torch.arange(S, device=ext.device)
        for k, g in enumerate(group):
            for req, b, sid in snaps:
                if req == g:
                    start = spans[k][2]
                    store[sid, layer, (b - S + keep) % S] = kv_quant.encode(ext[k, b - start : b - start + S], store)

    def _csa_topk(self, proj: dict, states: dict, j: int, fb, rate: int) -> torch.Tensor:
        """The kernel path's CSA top-k: the lightning indexer over a layer's indexer keys."""
        cfg = self.cfg
        return self.kops.v4_indexer_topk(
            proj["iq"],
            proj["iw"],
            states[self.CSA_INDEX_K][:, j],
            fb.block_table,
            fb.positions,
            fb.extend_lens,
            cfg.index_topk,
            cfg.index_head_dim**-0.5,
            rate,
            fb.page_size,
        )

    def _attend_kernels(
        self,
        i: int,
        L: dict,
        q: torch.Tensor,
        kv: torch.Tensor,
        proj: dict,
        fb: V4Batch,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """The kernel path: windows close first (their entries are visible to this step's later
        tokens), the indexer picks CSA entries, one attention launch reads the ring, the chunk's
        own keys and the entries in place; then the ring takes each request's last W tokens."""
        cfg, ops = self.cfg, self.kops
        W, kind, j = cfg.sliding_window, L["type"], self.type_index.get(i)
        dev, T = q.device, q.shape[0]
        decode = spans is None or all(n == 1 for _, n, _ in spans)
        slots = fb.slot_ids.long()
        comp_kv = comp_idx = None
        rate = 0
        if kind in (CSA, HCA):
            rate = cfg.compress_rates[kind]
            if decode:
                self._stage_decode(L, proj, fb, states, j, rate, spans)
            else:
                row = self._span_tensors(spans, dev)[0]
                tok = (row[:, None] + torch.arange(max(s[1] for s in spans), device=dev)).clamp(max=T - 1)
                self._close_windows(L, proj, tok, spans, slots, fb.block_table, fb, states, j, rate)
            comp_kv = states[self.CSA_KV if kind == CSA else self.HCA_KV][:, j]
            if kind == CSA:
                comp_idx = self._csa_topk(proj, states, j, fb, rate)
        ring_store = states[self.SWA_KV]
        args = (q, kv, ring_store[:, i], fb.slot_ids)
        tail = (fb.block_table, comp_kv, comp_idx, L["sink"], cfg.head_dim**-0.5, rate, fb.page_size)
        if decode:
            out = ops.v4_attention_decode(*args, fb.positions, *tail)
            kv_quant.store_(ring_store, (slots, i, fb.positions % W), kv)  # fp8kv
            return out
        out = ops.v4_attention_extend(*args, fb.positions, fb.extend_lens, *tail)
        key = tuple(spans)  # each request's last W tokens go to its ring
        keep = self._index(
            ("ring_rows", key), lambda: [r + a for r, n, _ in spans for a in range(max(0, n - W), n)], dev
        )
        req = self._index(
            ("ring_req", key), lambda: [b for b, (_, n, _) in enumerate(spans) for _ in range(min(n, W))], dev
        )
        kv_quant.store_(ring_store, (slots[req], i, fb.positions[keep] % W), kv[keep])  # fp8kv
        return out

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, fb: V4Batch | ForwardBatch, states: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits of each request's last new token, [B, vocab]."""
        if fb.slot_ids is None or fb.page_size is None:
            raise NotImplementedError(
                "DeepSeek-V4 needs a batch with slot_ids and page_size (its ring and compressor states are "
                "per-request slot rows); the engine's batch builder sets both for a model with slot states"
            )
        cfg = self.cfg
        # A decode step without host lengths is a captured one (cuda_graphs): nothing in it may
        # depend on values, so it runs the kernel path's masked window closing instead.
        static = self.kops is not None and fb.all_decode and fb.seq_lens_host is None
        spans = None if static else request_spans(fb)
        self._step_index = {}
        rope = {name: self.ops.rope_table(fb.positions, inv) for name, inv in self.inv_freq.items()}
        x = F.embedding(fb.input_ids, self.embed)
        x = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, hc, D] residual streams
        PHASES.lap("embed")
        for i, L in enumerate(self.layers):
            post, comb, collapsed = self._hc(x, L["hc_attn"])
            h = self.ops.rms(collapsed, L["attn_norm"], cfg.rms_norm_eps)
            PHASES.lap("norms")
            a = self._attention(i, L, h, fb, states, spans, rope)
            PHASES.lap("attention")
            x = self._hc_mix(x, a, post, comb)
            post, comb, collapsed = self._hc(x, L["hc_ffn"])
            h = self.ops.rms(collapsed, L["ffn_norm"], cfg.rms_norm_eps)
            PHASES.lap("norms")
            m = self._moe(L, h, fb.input_ids)
            PHASES.lap("moe")
            x = self._hc_mix(x, m, post, comb)
        x = x[fb.logits_indices]
        fn, base, scale = self.hc_head
        flat = self.ops.unweighted_rms(x.flatten(1).float(), cfg.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + cfg.hc_eps
        h = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        h = self.ops.rms(h, self.norm, cfg.rms_norm_eps)
        logits = F.linear(h, self.head).float()
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
