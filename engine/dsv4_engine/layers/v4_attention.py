"""DeepSeek-V4's attention layer: shared-KV MQA (one KV head, K == V) with q LoRA, per-head
attention sinks and a grouped low-rank output projection, over a sliding window of raw keys and,
in compressed layers, compressed entries (CSA: the top-k the lightning indexer picks; HCA: all).

Paths: the kernel path (`kops`, Triton: windows close, the indexer picks, one attention launch
reads the ring, the chunk and the entries in place); the torch path (CPU, the kernels' oracle):
decode steps batched (`attend_decode`), prefill/mixed steps in groups of requests padded to the
longest chunk (`attend_varlen`); a verify step at a fixed shape (layers/v4_verify.py).

Under --tp-size N each rank holds num_attention_heads / N query heads and o_groups / N output
groups (the checkpoint is split at load, parallel/plan.py); the KV head, the compressors and the
indexer are replicated; the output projection's partial sums meet in one all-reduce."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dsv4_engine import kv_quant
from dsv4_engine.layers import v4_verify
from dsv4_engine.layers.v4_compressor import V4Compressor
from dsv4_engine.layers.v4_indexer import V4Indexer
from dsv4_engine.layers.v4_step import (
    CSA_INDEX_K,
    CSA_INDEX_STAGE,
    CSA_KV,
    CSA_STAGE,
    HCA_KV,
    HCA_STAGE,
    SWA_KV,
    V4Backend,
    V4Step,
    gather_entries,
    locate,
    save_snapshots,
)
from dsv4_engine.quant import dense, one_format

Take = Callable[..., torch.Tensor]  # take(name under the layer's attn., dtype) -> a placed tensor


class V4Attention:
    # Budget (elements) of the largest per-group score tensor of a prefill/mixed step: requests
    # are attended together in groups that stay under it (one group at serving sizes; a single
    # long prompt is one group of its own).
    GROUP_ELEMENTS = 1 << 25

    def __init__(self, take: Take, rate: int, indexed: bool, layer: int, j: Optional[int], backend: V4Backend, tp=None):
        """rate: tokens a compressed entry (0: a sliding-window layer); indexed: the lightning
        indexer picks the entries (CSA), else every entry is seen (HCA); layer: this layer's row in
        the window ring; j: its index among layers of its kind (their compressed states)."""
        f32 = torch.float32
        self.rate, self.layer, self.j, self.backend, self.tp = rate, layer, j, backend, tp
        self.q_norm, self.kv_norm = take("q_norm.weight", f32), take("kv_norm.weight", f32)
        self.wo_a = dense(take("wo_a.weight"), backend.dtype)  # used per group (bmm), not by F.linear
        self.wo_b = take("wo_b.weight")
        self.sink = take("attn_sink", f32)
        self.compressor = self.indexer = None
        # One matmul for everything a layer projects from its input (and one from the q LoRA):
        # the weights are concatenated once and the per-name tensors are views into it, so
        # nothing is held twice. At small widths this halves the op count of a step.
        names = {"wq_a": take("wq_a.weight"), "wkv": take("wkv.weight")}
        if self.rate:
            names["comp_wkv"], names["comp_wgate"] = take("compressor.wkv.weight"), take("compressor.wgate.weight")
        if indexed:
            names["icomp_wkv"] = take("indexer.compressor.wkv.weight")
            names["icomp_wgate"] = take("indexer.compressor.wgate.weight")
            names["idx_w"] = take("indexer.weights_proj.weight")
        self.w_in, self.w_in_split, v = self._fuse(names)
        self.wq_a, self.wkv = v["wq_a"], v["wkv"]
        if self.rate:
            stage, store = (CSA_STAGE, CSA_KV) if indexed else (HCA_STAGE, HCA_KV)
            self.compressor = V4Compressor(
                v["comp_wkv"],
                v["comp_wgate"],
                take("compressor.ape", f32),
                take("compressor.norm.weight", f32),
                self.rate,
                indexed,  # CSA's compressor overlaps windows, HCA's does not
                stage,
                store,
                "comp",
                backend,
            )
        if indexed:
            icomp = V4Compressor(
                v["icomp_wkv"],
                v["icomp_wgate"],
                take("indexer.compressor.ape", f32),
                take("indexer.compressor.norm.weight", f32),
                self.rate,
                True,
                CSA_INDEX_STAGE,
                CSA_INDEX_K,
                "icomp",
                backend,
            )
            self.w_qb, self.w_qb_split, qv = self._fuse(
                {"wq_b": take("wq_b.weight"), "idx_wq_b": take("indexer.wq_b.weight")}
            )
            self.wq_b = qv["wq_b"]
            self.indexer = V4Indexer(qv["idx_wq_b"], v["idx_w"], icomp, backend)
        else:
            self.wq_b = take("wq_b.weight")

    @staticmethod
    def _fuse(named: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int], dict[str, torch.Tensor]]:
        fused = torch.cat(one_format(list(named.values())), 0).contiguous()
        sizes = [t.shape[0] for t in named.values()]
        views, row = {}, 0
        for name, n in zip(named, sizes):
            views[name] = fused[row : row + n]
            row += n
        return fused, sizes, views

    @property
    def compressors(self) -> list[V4Compressor]:
        """This layer's compressors: the entries', then (CSA) the indexer's."""
        out = [self.compressor] if self.compressor is not None else []
        return out + ([self.indexer.compressor] if self.indexer is not None else [])

    @property
    def entry_store(self) -> Optional[str]:
        return self.compressor.store if self.compressor is not None else None

    # ---- the layer -----------------------------------------------------------------------------

    def forward(self, h: torch.Tensor, fb, states: dict[str, torch.Tensor], spans, rope: dict, step: V4Step):
        """h [T, D] -> [T, D]. spans: (first row, new tokens, first position) per request; None: a
        captured decode step (kernel path); a `v4_verify.FixedRows`: a verify step at a fixed shape."""
        q, kv, proj, table = self.project(h, rope)
        if kv_quant.is_packed(states[SWA_KV]):
            # fp8kv: a chunk's own keys are read as they are stored (as V3 reads its latent back
            # from its pages), so prefill, decode and an MTP verify of the same tokens agree
            kv = kv_quant.decode(kv_quant.quantize(kv), kv.dtype)
        if isinstance(spans, v4_verify.FixedRows):
            out = v4_verify.attend(self, q, kv, proj, fb, states, spans.n, step)
        elif self.backend.kops is not None:
            out = self.attend_kernels(q, kv, proj, fb, states, spans, step)
        elif all(n == 1 for _, n, _ in spans):
            out = self.attend_decode(q, kv, proj, fb, states, spans, step)
        else:
            out = self.attend_varlen(q, kv, proj, fb, states, spans, step)
        return self.project_out(out, table)

    def project(self, h: torch.Tensor, rope: dict):
        """(q [T, H, hd], kv [T, hd], the compressors' and indexer's projections, the rope table)."""
        cfg, ops = self.backend.cfg, self.backend.ops
        T, eps = h.shape[0], cfg.rms_norm_eps
        table = rope["compress" if self.rate else "main"]
        parts = F.linear(h, self.w_in).split(self.w_in_split, dim=-1)
        qr = ops.v4_rms_rope(parts[0][:, None], self.q_norm, eps, None).view(T, -1)
        kv = ops.v4_rms_rope(parts[1][:, None], self.kv_norm, eps, table).view(T, -1)  # [T, hd]: key == value
        proj = {}
        if self.rate:
            proj["comp"] = (parts[2], parts[3])
        if self.indexer is not None:
            proj["icomp"] = (parts[4], parts[5])
            q, iq = F.linear(qr, self.w_qb).split(self.w_qb_split, dim=-1)
            proj["iq"], proj["iw"] = self.indexer.queries(iq, parts[6], rope["compress"])
        else:
            q = F.linear(qr, self.wq_b)
        q = ops.v4_rms_rope(q.reshape(T, -1, cfg.head_dim), None, eps, table)
        return q, kv, proj, table

    def project_out(self, out: torch.Tensor, table) -> torch.Tensor:
        """Attention outputs [T, H, hd] (rope undone) through the grouped low-rank projection;
        under TP this rank's groups' share, summed over ranks."""
        cfg = self.backend.cfg
        T = out.shape[0]
        out = self.backend.ops.v4_rms_rope(out, None, cfg.rms_norm_eps, table, norm=False, conj=True, inplace=True)
        G = self.wo_a.shape[0] // cfg.o_lora_rank  # this rank's groups
        grouped = out.reshape(T, G, -1).transpose(0, 1)  # [G, T, H*hd/G]
        wa = self.wo_a.view(G, -1, grouped.shape[-1]).transpose(1, 2)  # [G, in, o_lora]
        o = F.linear(torch.bmm(grouped, wa).transpose(0, 1).reshape(T, -1), self.wo_b)
        return o if self.tp is None else self.tp.all_reduce(o)

    # ---- windows and entries -------------------------------------------------------------------

    def close_chunks(self, proj, tok, spans, slots, pages, fb, states, step: V4Step, group=None) -> None:
        """Feed a group's chunks to the layer's compressor(s) (V4Compressor.feed_chunks), with the
        windows each request closes in this step found once from host lengths."""
        rate, dev = self.rate, tok.device
        ckey = (tuple(spans), rate)
        closing = [(b, k) for b, (_, m, st) in enumerate(spans) for k in range((st + m) // rate - st // rate)]
        cb = step.index(("close_b", ckey), lambda: [b for b, _ in closing], dev)
        ck = step.index(("close_k", ckey), lambda: [k for _, k in closing], dev)
        for c in self.compressors:
            c.feed_chunks(proj, tok, spans, slots, pages, fb, states, self.j, step, (cb, ck), group)

    def stage_decode(self, proj, fb, states, spans, step: V4Step) -> None:
        """Decode tokens go to the stage rings; those that close a window close it (spans None:
        a captured step, every row runs the close, masked)."""
        closing = None
        if spans is not None:
            rate = self.rate
            closes = [b for b, (_, _, st) in enumerate(spans) if (st + 1) % rate == 0]
            closing = step.index(("decode_close", tuple(spans), rate), lambda: closes, fb.positions.device)
        for c in self.compressors:
            c.stage_decode(proj, fb, states, self.j, step, closing)

    # ---- the kernel path -----------------------------------------------------------------------

    def attend_kernels(self, q, kv, proj, fb, states, spans, step: V4Step) -> torch.Tensor:
        """Windows close first (their entries are visible to this step's later tokens), the
        indexer picks CSA entries, one attention launch reads the ring, the chunk's own keys and
        the entries in place; then the ring takes each request's last W tokens."""
        cfg, ops = self.backend.cfg, self.backend.kops
        W, i, j, rate = cfg.sliding_window, self.layer, self.j, self.rate
        dev, T = q.device, q.shape[0]
        decode = spans is None or all(n == 1 for _, n, _ in spans)
        slots = fb.slot_ids.long()
        comp_kv = comp_idx = None
        if rate:
            if decode:
                self.stage_decode(proj, fb, states, spans, step)
            else:
                row = step.span_tensors(spans, dev)[0]
                tok = (row[:, None] + torch.arange(max(s[1] for s in spans), device=dev)).clamp(max=T - 1)
                self.close_chunks(proj, tok, spans, slots, fb.block_table, fb, states, step)
            comp_kv = states[self.entry_store][:, j]
            if self.indexer is not None:
                comp_idx = self.indexer.topk_kernels(proj, states, j, fb, rate)
        ring_store = states[SWA_KV]
        args = (q, kv, ring_store[:, i], fb.slot_ids)
        tail = (fb.block_table, comp_kv, comp_idx, self.sink, cfg.head_dim**-0.5, rate, fb.page_size)
        if decode:
            out = ops.v4_attention_decode(*args, fb.positions, *tail)
            kv_quant.store_(ring_store, (slots, i, fb.positions % W), kv)  # fp8kv
            return out
        out = ops.v4_attention_extend(*args, fb.positions, fb.extend_lens, *tail)
        key = tuple(spans)  # each request's last W tokens go to its ring
        keep = step.index(
            ("ring_rows", key), lambda: [r + a for r, n, _ in spans for a in range(max(0, n - W), n)], dev
        )
        req = step.index(
            ("ring_req", key), lambda: [b for b, (_, n, _) in enumerate(spans) for _ in range(min(n, W))], dev
        )
        kv_quant.store_(ring_store, (slots[req], i, fb.positions[keep] % W), kv[keep])  # fp8kv
        return out

    # ---- the torch path ------------------------------------------------------------------------

    def softmax_attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [B, M, H, hd] over keys (== values) [B, K, hd] with allowed [B, M, K] and the
        per-head sink as one more logit whose value is dropped. One bmm per product: the keys
        are shared by every query and head of a request (never expanded per query)."""
        B, M, H, hd = q.shape
        K = keys.shape[1]
        # the scale rides in the GEMM, and the softmax runs in place on the fresh logits with the
        # sink joining the max and the denominator only (no concatenated copy of the scores)
        logits = torch.baddbmm(
            q.new_zeros(()), q.reshape(B, M * H, hd), keys.transpose(1, 2), beta=0, alpha=hd**-0.5
        ).view(B, M, H, K)
        logits.masked_fill_(~allowed.unsqueeze(-2), float("-inf"))
        sink = self.sink.to(logits.dtype).view(H, 1)
        top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)  # finite: padding rows see only the sink
        probs = logits.sub_(top).exp_()
        probs.div_(probs.sum(dim=-1, keepdim=True).add_((sink - top).exp_()))
        return torch.bmm(probs.view(B, M * H, K).to(keys.dtype), keys).view(B, M, H, hd)

    def groups(self, spans: list[tuple[int, int, int]], heads: int) -> list[list[int]]:
        """Requests attended together, each group's largest score tensor under GROUP_ELEMENTS."""
        cfg = self.backend.cfg
        heads = max(heads, cfg.index_n_heads)
        rate = min(cfg.compress_rates.values()) if cfg.compress_rates else 0
        groups: list[list[int]] = [[]]
        longest = keys = 0
        for r, (_, n, start) in enumerate(spans):
            lm = max(longest, n)
            km = max(keys, cfg.sliding_window + n + ((start + n) // rate if rate else 0))
            if groups[-1] and (len(groups[-1]) + 1) * lm * heads * km > self.GROUP_ELEMENTS:
                groups.append([])
                lm, km = n, cfg.sliding_window + n + ((start + n) // rate if rate else 0)
            groups[-1].append(r)
            longest, keys = lm, km
        return groups

    def attend_varlen(self, q, kv, proj, fb, states, spans, step: V4Step) -> torch.Tensor:
        """Any mix of prefill chunks and decode tokens, padded to the longest chunk of a group."""
        out = q.new_empty(q.shape[0] + 1, *q.shape[1:])  # the last row takes the padding's writes
        for group in self.groups(spans, q.shape[1]):
            self.attend_group(q, kv, proj, fb, states, [spans[r] for r in group], group, out, step)
        return out[:-1]

    def attend_group(self, q, kv, proj, fb, states, spans, group: list[int], out: torch.Tensor, step: V4Step) -> None:
        """Requests `group` at once. A request's keys are the window positions before its chunk
        (read from the ring, in position order) followed by the chunk itself, one row per request
        masked by position, then its visible compressed entries."""
        cfg = self.backend.cfg
        W, i, j, rate = cfg.sliding_window, self.layer, self.j, self.rate
        dev, dt = q.device, self.backend.dtype
        B = len(group)
        row, n, start = step.span_tensors(spans, dev)
        Lmax = max(s[1] for s in spans)
        ar = torch.arange(Lmax, device=dev)
        b_ix = torch.arange(B, device=dev)[:, None]
        tok = (row[:, None] + ar).clamp(max=q.shape[0] - 1)  # [B, Lmax]; rows past a chunk are padding
        valid = ar[None] < n[:, None]
        qpos = start[:, None] + ar
        rows = step.index(("group", tuple(group)), lambda: group, dev)
        slots = fb.slot_ids[rows].long()
        pages = fb.block_table[rows]

        ring_store = states[SWA_KV]
        kbase = start - W  # the ring holds positions start - W .. start - 1
        ring = ring_store[slots[:, None], i, (kbase[:, None] + torch.arange(W, device=dev)) % W]
        # [B, W + Lmax, hd] in position order (fp8kv: the ring decoded)
        ext_kv = torch.cat([kv_quant.decode(ring, kv.dtype), step.take(kv, tok)], 1)
        save_snapshots(fb, group, spans, SWA_KV, i, ext_kv)
        # only the last R ring positions can be seen (R < W when every chunk of the group starts
        # early: a fresh prompt attends to none of the ring)
        R = min(W, max(s[2] for s in spans))
        # a window much narrower than the chunk: each query's own W keys in one native call,
        # where the padded tile would score (and mask) R + Lmax keys per query
        native = self.backend.one_call and ext_kv.dtype == torch.float32 and 4 * W <= R + Lmax
        if not native:
            kpos = kbase[:, None] + torch.arange(W - R, W + Lmax, device=dev)
            kp, qp = kpos[:, None, :], qpos[:, :, None]
            allowed = (kp <= qp) & (kp > qp - W) & (kp >= 0)  # [B, Lmax, R + Lmax]
            keys = ext_kv[:, W - R :]
        entries = visible = None
        if rate:
            self.close_chunks(proj, tok, spans, slots, pages, fb, states, step, group)
            C = max((st + m) // rate for _, m, st in spans)  # entries closed so far, at most
            if C:
                w = torch.arange(C, device=dev)
                visible = w < ((qpos + 1) // rate)[:, :, None]  # [B, Lmax, C]: t sees w iff w < (t+1)//rate
                if self.indexer is not None:
                    ikeys = gather_entries(states[CSA_INDEX_K][:, j], pages, w, rate, fb.page_size, dt)
                    iq, iw = step.take(proj["iq"], tok), step.take(proj["iw"], tok)
                    visible = self.indexer.select(iq, iw, ikeys, visible)
                entries = gather_entries(states[self.entry_store][:, j], pages, w, rate, fb.page_size, dt)
                if not native:
                    keys = torch.cat([keys, entries.to(kv.dtype)], 1)
                    allowed = torch.cat([allowed, visible], 2)
        if native:
            scale = cfg.head_dim**-0.5
            self.backend.ops.v4_attend_extend(q, ext_kv, row, n, start, W, self.sink, scale, out, entries, visible)
        else:
            o = self.softmax_attend(q[tok], keys, allowed)  # [B, Lmax, H, hd]
            out[torch.where(valid, tok, out.shape[0] - 1)] = o  # padding lands on the scratch row
        # the ring keeps the last W positions (written after the reads above): position p of the
        # new ring is ext_kv's p - kbase; positions before the chunk rewrite what they held
        end = start + n
        keep = torch.arange(W, device=dev)
        ring_store[slots[:, None], i, (end[:, None] - W + keep) % W] = kv_quant.encode(  # fp8kv
            ext_kv[b_ix, n[:, None] + keep], ring_store
        )

    def attend_decode(self, q, kv, proj, fb, states, spans, step: V4Step) -> torch.Tensor:
        """One new token per request: every request at once, window closing included."""
        cfg = self.backend.cfg
        W, i, j, rate = cfg.sliding_window, self.layer, self.j, self.rate
        t = fb.positions  # [B]
        slots = fb.slot_ids.long()
        ring_store = states[SWA_KV]

        def window() -> torch.Tensor:
            ring_pos = (t[:, None] - 1) - torch.remainder(t[:, None] - 1 - torch.arange(W, device=t.device), W)
            kpos = torch.cat([ring_pos, t[:, None]], 1)
            return (kpos <= t[:, None]) & (kpos > t[:, None] - W) & (kpos >= 0)

        native = (
            self.backend.one_call
            and ring_store.dtype == q.dtype == torch.float32
            and (not rate or states[self.entry_store].dtype == torch.float32)
        )
        if not native:
            allowed = step.memo(("decode_window",), window)  # [B, W+1], the same in every layer
            keys = torch.cat([kv_quant.decode(ring_store[slots, i], kv.dtype), kv[:, None]], 1)  # [B, W+1, hd]
        entries_at = None  # the native call's (store, visible)
        if rate:
            self.stage_decode(proj, fb, states, spans, step)
            C = max((st + 1) // rate for _, _, st in spans)
            if C:

                def entry_indices(epp: int):
                    w = torch.arange(C, device=t.device)
                    page, off = locate(w, rate, fb.page_size, epp)
                    at = (fb.block_table[:, page].long(), off[None].expand(fb.block_table.shape[0], -1))
                    return w[None] < ((t + 1) // rate)[:, None], at  # visible [B, C], gather index

                def indices(epp: int):
                    return step.memo(("decode_entries", rate, epp), lambda: entry_indices(epp))

                store = states[self.entry_store][:, j]
                visible = indices(store.shape[1])[0]
                if self.indexer is not None:
                    ikeys = states[CSA_INDEX_K][:, j]
                    ikeys = kv_quant.decode(ikeys[indices(ikeys.shape[1])[1]], kv.dtype)  # [B, C, ihd]
                    sel = self.indexer.select(proj["iq"][:, None], proj["iw"][:, None], ikeys, visible[:, None])
                    visible = sel.squeeze(1)
                if native:
                    entries_at = (store, visible, rate)
                else:
                    keys = torch.cat([keys, kv_quant.decode(store[indices(store.shape[1])[1]], kv.dtype)], 1)
                    allowed = torch.cat([allowed, visible], 1)
        if native:
            store, visible, r = entries_at or (None, None, 0)
            return self._native_decode(q, kv, ring_store, slots, t, store, fb, visible, r)
        out = self.softmax_attend(q.unsqueeze(1), keys, allowed.unsqueeze(1)).squeeze(1)
        kv_quant.store_(ring_store, (slots, i, t % W), kv)  # fp8kv
        return out

    def _native_decode(self, q, kv, ring_store, slots, t, store, fb, visible, rate) -> torch.Tensor:
        i, W = self.layer, self.backend.cfg.sliding_window
        scale = self.backend.cfg.head_dim**-0.5
        out = self.backend.ops.v4_attend_decode(
            q, kv, ring_store[:, i], slots, t, self.sink, scale, store, fb.block_table, visible, rate, fb.page_size
        )
        ring_store[slots, i, t % W] = kv.to(ring_store.dtype)
        return out
