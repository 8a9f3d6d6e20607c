"""DeepSeek-V4's compressor: a window of `rate` tokens' [kv | gate] projections pooled into one
compressed entry (softmax-gated sum with a learned position bias, norm, rope at the window's first
position). The overlapping one (CSA's, and its indexer's) pools 2 * rate series: window w-1's
first half joins window w's second. A window's projections wait in a stage ring (a slot state)
until its last token arrives, in decode steps (`stage_decode`) and in chunks (`feed_chunks`)."""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_engine import kv_quant
from dsv4_engine.layers.v4_step import V4Backend, V4Step, locate, save_snapshots


class V4Compressor:
    """wkv, wgate [width, D] (views into the attention's fused input projection), ape [rate,
    width], norm [head width]; entries of `rate` tokens go to paged state `store`, the raw
    projections wait in slot state `stage`; `key` names its projections in the attention's
    per-step dict."""

    def __init__(
        self,
        wkv: Optional[torch.Tensor],
        wgate: Optional[torch.Tensor],
        ape: torch.Tensor,
        norm: torch.Tensor,
        rate: int,
        overlap: bool,
        stage: str,
        store: str,
        key: str,
        backend: V4Backend,
    ):
        self.wkv, self.wgate, self.ape, self.norm = wkv, wgate, ape, norm
        self.rate, self.overlap = rate, overlap
        self.stage, self.store, self.key = stage, store, key
        self.backend = backend

    def pool(self, win: torch.Tensor, prev: Optional[torch.Tensor], w_ids: torch.Tensor) -> torch.Tensor:
        """`pool_split` over stage rows win, prev [N, rate, 2 * width] ([kv | gate]): one call where
        the kernel backend has one (the CPU's C kernel on fp32)."""
        be = self.backend
        width = win.shape[-1] // 2
        pooled = be.ops.v4_pool_windows(
            win, prev, w_ids, (None, None, self.ape, self.norm), self.rate, be.cfg.rms_norm_eps, be.inv_freq["compress"]
        )
        if pooled is not None:
            return pooled
        pk, pg = (None, None) if prev is None else (prev[..., :width], prev[..., width:])
        return self.pool_split(win[..., :width], win[..., width:], pk, pg, w_ids)

    def pool_split(
        self,
        win_kv: torch.Tensor,
        win_gate: torch.Tensor,
        prev_kv: Optional[torch.Tensor],
        prev_gate: Optional[torch.Tensor],
        w_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Compressed entries of windows w_ids [N] from their projections [N, rate, width] (and,
        overlapping, window w-1's: its first series joins the pool; window 0 has none)."""
        be, ape, rate = self.backend, self.ape, self.rate
        eps, inv_freq = be.cfg.rms_norm_eps, be.inv_freq["compress"]
        if be.kops is not None:
            entries = be.kops.v4_compress_pool(win_kv, win_gate, prev_kv, prev_gate, ape, self.norm, w_ids, eps)
            return be.ops.rope_at(entries, w_ids * rate, inv_freq)
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
        return be.ops.rope_at(be.ops.rms(pooled, self.norm, eps), w_ids * rate, inv_freq)

    def close_decode(
        self,
        rows: torch.Tensor,
        t: torch.Tensor,
        slots: torch.Tensor,
        fb,
        j: int,
        states: dict[str, torch.Tensor],
        step: V4Step,
        closes: Optional[torch.Tensor] = None,
    ) -> None:
        """Decode tokens at positions t [N] that close a window, all at once: the stage ring
        already holds every projection of the window (this step's included), so the window and,
        overlapping, its predecessor are read back from it. With `closes` [N] (a captured step,
        whose launches cannot depend on which rows close): every row pools its latest full window,
        and a row that closes none writes back the entry it read: the same bytes, so harmless even
        in a page the prefix cache shares, whose windows are all closed and never written otherwise."""
        rate, stage, store = self.rate, states[self.stage], states[self.store][:, j]
        S = stage.shape[2]

        def indices():
            w = (t + 1) // rate - 1
            if closes is not None:
                w = w.clamp(min=0)
            first = w[:, None] * rate + torch.arange(rate, device=t.device)  # [N, rate] positions
            page, off = locate(w, rate, fb.page_size, store.shape[1])
            # ring slots of the window and of its predecessor (unused rows masked for w == 0)
            return w, slots[:, None], first % S, (first - rate) % S, (fb.block_table[rows, page].long(), off)

        if closes is None:  # rows, t and slots are this step's closing rows at this rate
            w, srow, cur, prev, at = step.memo(("close_decode", rate, S, store.shape[1]), indices)
        else:
            w, srow, cur, prev, at = indices()
        win = stage[srow, j, cur]  # [N, rate, 2 * width]: [kv | gate] rows
        entries = kv_quant.encode(self.pool(win, stage[srow, j, prev] if self.overlap else None, w), store)  # fp8kv
        store[at] = entries if closes is None else torch.where(closes[:, None], entries, store[at])

    def stage_decode(self, proj: dict, fb, states: dict, j: int, step: V4Step, closing: Optional[torch.Tensor]) -> None:
        """Decode tokens go to the stage ring; `closing` (rows) close their window; None: a
        captured step, where every row runs the close, masked."""
        t, slots = fb.positions, fb.slot_ids.long()
        st = states[self.stage]
        st[slots, j, t % st.shape[2]] = torch.cat(proj[self.key], dim=-1).to(st.dtype)
        if closing is None:
            rows = torch.arange(t.shape[0], device=t.device)
            self.close_decode(rows, t, slots, fb, j, states, step, closes=(t + 1) % self.rate == 0)
        elif closing.numel():
            self.close_decode(closing, t[closing], slots[closing], fb, j, states, step)

    def feed_chunks(
        self,
        proj: dict,
        tok: torch.Tensor,
        spans: list[tuple[int, int, int]],
        slots: torch.Tensor,
        pages: torch.Tensor,
        fb,
        states: dict[str, torch.Tensor],
        j: int,
        step: V4Step,
        closing: tuple[torch.Tensor, torch.Tensor],
        group: Optional[list[int]] = None,
    ) -> None:
        """A group's chunks (token rows tok [B, Lmax]): close every window whose last token arrived
        (closing: (request, k) of the k-th window a request closes now) and keep each request's
        last projections in its stage ring. A window may have started in an earlier step: its
        first tokens are read back from the ring, which covers the S positions before the chunk."""
        rate, dev = self.rate, tok.device
        B = tok.shape[0]
        b_ix = torch.arange(B, device=dev)[:, None]
        _, n, start = step.span_tensors(spans, dev)
        end = start + n
        st = states[self.stage]  # [rows, layers, S, 2 * width]: [kv | gate] projections
        S = st.shape[2]
        chunk = step.take(torch.cat(proj[self.key], dim=-1), tok)  # [B, Lmax, 2 * width]
        ebase = start - S
        held = st[slots[:, None], j, (ebase[:, None] + torch.arange(S, device=dev)) % S]
        ext = torch.cat([held.to(chunk.dtype), chunk], 1)  # positions ebase .. ebase + S + Lmax - 1
        if group is not None:
            save_snapshots(fb, group, spans, self.stage, j, ext)
        cb, ck = closing
        if cb.numel():
            w_ids = start[cb] // rate + ck  # [N] the windows closing now
            offs = (w_ids * rate - ebase[cb])[:, None] + torch.arange(rate, device=dev)  # [N, rate] rows of ext
            at = cb[:, None] * ext.shape[1] + offs  # rows of ext flattened over its first two dims
            win = step.take(ext.flatten(0, 1), at)
            prev = step.take(ext.flatten(0, 1), at - rate) if self.overlap else None  # window 0's masked
            entries = self.pool(win, prev, w_ids)
            store = states[self.store][:, j]
            page, off = locate(w_ids, rate, fb.page_size, store.shape[1])
            kv_quant.store_(store, (pages[cb, page].long(), off), entries)  # fp8kv
        keep = torch.arange(S, device=dev)
        st[slots[:, None], j, (end[:, None] - S + keep) % S] = ext[b_ix, n[:, None] + keep].to(st.dtype)
