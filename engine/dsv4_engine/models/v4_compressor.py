"""DeepSeek-V4's compressors, a mixin of `DeepseekV4`: the stage rings that keep a window's raw
projections until its last token arrives, and the pooling (softmax-gated sum, norm, rope) that
turns a closed window into a compressed entry (and, for CSA, an indexer key), in decode steps
(`_stage_decode`, `_close_decode`) and in prefill/extend chunks (`_close_windows`); both the
kernel and the torch attention paths write entries through them."""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_engine import kv_quant
from dsv4_engine.models.deepseek_v4_config import CSA
from dsv4_engine.models.forward_batch import V4Batch


class V4Compressors:
    def _pool(
        self, win: torch.Tensor, prev: Optional[torch.Tensor], w_ids: torch.Tensor, params, rate: int
    ) -> torch.Tensor:
        """`_pool_windows` over stage rows win, prev [N, rate, 2 * width] ([kv | gate]): one
        call where the kernel backend has one (the CPU's C kernel on fp32)."""
        width = win.shape[-1] // 2
        pooled = self.ops.v4_pool_windows(
            win, prev, w_ids, params, rate, self.cfg.rms_norm_eps, self.inv_freq["compress"]
        )
        if pooled is not None:
            return pooled
        pk, pg = (None, None) if prev is None else (prev[..., :width], prev[..., width:])
        return self._pool_windows(win[..., :width], win[..., width:], pk, pg, w_ids, params, rate)

    def _pool_windows(
        self,
        win_kv: torch.Tensor,
        win_gate: torch.Tensor,
        prev_kv: Optional[torch.Tensor],
        prev_gate: Optional[torch.Tensor],
        w_ids: torch.Tensor,
        params,
        rate: int,
    ) -> torch.Tensor:
        """Compressed entries of windows w_ids [N] from their projections [N, rate, width] (and,
        for the overlapping CSA compressor, window w-1's: its first series joins the pool; window
        0 has none): gated softmax pooling, norm, rope at the window's first position."""
        _, _, ape, norm_w = params
        if self.kops is not None:
            entries = self.kops.v4_compress_pool(
                win_kv, win_gate, prev_kv, prev_gate, ape, norm_w, w_ids, self.cfg.rms_norm_eps
            )
            return self.ops.rope_at(entries, w_ids * rate, self.inv_freq["compress"])
        win_gate = win_gate + ape
        if prev_kv is not None:
            hd = win_kv.shape[-1] // 2
            none = (w_ids < 1)[:, None, None]
            prev_kv = prev_kv[..., :hd].masked_fill(none, 0)
            prev_gate = (prev_gate + ape)[..., :hd].masked_fill(none, float("-inf"))
            new_kv = torch.cat([prev_kv, win_kv[..., hd:]], dim=1)
            new_gate = torch.cat([prev_gate, win_gate[..., hd:]], dim=1)
        else:
            new_kv, new_gate = win_kv, win_gate
        pooled = (new_kv * new_gate.softmax(dim=1, dtype=torch.float32).to(new_kv.dtype)).sum(dim=1)
        entries = self.ops.rms(pooled, norm_w, self.cfg.rms_norm_eps)
        return self.ops.rope_at(entries, w_ids * rate, self.inv_freq["compress"])

    def _close_decode(
        self,
        rows: torch.Tensor,
        t: torch.Tensor,
        slots: torch.Tensor,
        fb: V4Batch,
        j: int,
        stage: torch.Tensor,
        params,
        rate: int,
        overlap: bool,
        store: torch.Tensor,
        closes: Optional[torch.Tensor] = None,
    ) -> None:
        """Decode tokens at positions t [N] that close a window, all at once: the stage ring
        already holds every projection of the window (this step's included), so the window and,
        for CSA, its predecessor are read back from it. With `closes` [N] (a captured step, whose
        launches cannot depend on which rows close): every row pools its latest full window, and
        a row that closes none writes back the entry it read: the same bytes, so harmless even in
        a page the prefix cache shares, whose windows are all closed and never written otherwise."""
        S = stage.shape[2]

        def indices():
            w = (t + 1) // rate - 1
            if closes is not None:
                w = w.clamp(min=0)
            first = w[:, None] * rate + torch.arange(rate, device=t.device)  # [N, rate] positions
            page, off = self._locate(w, rate, fb.page_size, store.shape[1])
            # ring slots of the window and of its predecessor (unused rows masked for w == 0)
            return w, slots[:, None], first % S, (first - rate) % S, (fb.block_table[rows, page].long(), off)

        if closes is None:  # rows, t and slots are this step's closing rows at this rate
            w, srow, cur, prev, at = self._memo(("close_decode", rate, S, store.shape[1]), indices)
        else:
            w, srow, cur, prev, at = indices()

        win = stage[srow, j, cur]  # [N, rate, 2 * width]: [kv | gate] rows
        entries = self._pool(win, stage[srow, j, prev] if overlap else None, w, params, rate)
        entries = kv_quant.encode(entries, store)  # fp8kv: quantized when the store is FP8
        store[at] = entries if closes is None else torch.where(closes[:, None], entries, store[at])

    def _compressors(self, kind: str) -> list[tuple[str, str, str, bool]]:
        """A compressed layer's compressors: (stage ring, projections, entry store, overlapping)."""
        if kind == CSA:
            return [
                (self.CSA_STAGE, "comp", self.CSA_KV, True),
                (self.CSA_INDEX_STAGE, "icomp", self.CSA_INDEX_K, True),
            ]
        return [(self.HCA_STAGE, "comp", self.HCA_KV, False)]

    def _close_windows(
        self,
        L: dict,
        proj: dict,
        tok: torch.Tensor,
        spans: list[tuple[int, int, int]],
        slots: torch.Tensor,
        pages: torch.Tensor,
        fb: V4Batch,
        states: dict[str, torch.Tensor],
        j: int,
        rate: int,
        group: Optional[list[int]] = None,
    ) -> None:
        """Feed a group's chunks to the layer's compressor(s): close every window whose last token
        arrived (its entry goes to the paged store) and keep each request's last projections in
        its stage ring. A window may have started in an earlier step: its first tokens are read
        back from the ring, which covers the S positions before the chunk."""
        kind, dev = L["type"], tok.device
        B, Lmax = tok.shape
        b_ix = torch.arange(B, device=dev)[:, None]
        _, n, start = self._span_tensors(spans, dev)
        end = start + n
        # (request, k): the k-th window that request closes in this step, from host lengths
        ckey = (tuple(spans), rate)
        closing = [(b, k) for b, (_, m, st) in enumerate(spans) for k in range((st + m) // rate - st // rate)]
        cb = self._index(("close_b", ckey), lambda: [b for b, _ in closing], dev)
        ck = self._index(("close_k", ckey), lambda: [k for _, k in closing], dev)
        for name, key, store_name, overlap in self._compressors(kind):
            st = states[name]  # [rows, layers, S, 2 * width]: [kv | gate] projections
            S = st.shape[2]
            chunk = self._take(torch.cat(proj[key], dim=-1), tok)  # [B, Lmax, 2 * width]
            ebase = start - S
            held = st[slots[:, None], j, (ebase[:, None] + torch.arange(S, device=dev)) % S]
            ext = torch.cat([held.to(chunk.dtype), chunk], 1)  # positions ebase .. ebase + S + Lmax - 1
            if group is not None:
                self._save_snapshots(fb, group, spans, name, j, ext)
            if closing:
                w_ids = start[cb] // rate + ck  # [N] the windows closing now
                offs = (w_ids * rate - ebase[cb])[:, None] + torch.arange(rate, device=dev)  # [N, rate] rows of ext
                rows = cb
                at = rows[:, None] * ext.shape[1] + offs  # rows of ext flattened over its first two dims
                win = self._take(ext.flatten(0, 1), at)
                prev = self._take(ext.flatten(0, 1), at - rate) if overlap else None  # rows of window 0 are masked
                entries = self._pool(win, prev, w_ids, L[key], rate)
                store = states[store_name][:, j]
                page, off = self._locate(w_ids, rate, fb.page_size, store.shape[1])
                kv_quant.store_(store, (pages[rows, page].long(), off), entries)  # fp8kv
            keep = torch.arange(S, device=dev)
            st[slots[:, None], j, (end[:, None] - S + keep) % S] = ext[b_ix, n[:, None] + keep].to(st.dtype)

    def _stage_decode(
        self,
        L: dict,
        proj: dict,
        fb: V4Batch,
        states: dict[str, torch.Tensor],
        j: int,
        rate: int,
        spans: Optional[list[tuple[int, int, int]]],
    ) -> None:
        """Decode tokens go to their stage rings; those that close a window close it (spans None:
        a captured step, where every row runs the close, masked)."""
        t, slots = fb.positions, fb.slot_ids.long()
        if spans is None:
            closes = []
        else:
            closes = [b for b, (_, _, st) in enumerate(spans) if (st + 1) % rate == 0]
            closing = self._index(("decode_close", tuple(spans), rate), lambda: closes, t.device)
        for name, key, store, overlap in self._compressors(L["type"]):
            st = states[name]
            st[slots, j, t % st.shape[2]] = torch.cat(proj[key], dim=-1).to(st.dtype)
            if spans is None:
                rows = torch.arange(t.shape[0], device=t.device)
                self._close_decode(
                    rows, t, slots, fb, j, st, L[key], rate, overlap, states[store][:, j], closes=(t + 1) % rate == 0
                )
            elif closes:
                self._close_decode(
                    closing, t[closing], slots[closing], fb, j, st, L[key], rate, overlap, states[store][:, j]
                )
