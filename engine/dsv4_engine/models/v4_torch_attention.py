"""DeepSeek-V4's attention in torch, a mixin of `DeepseekV4`: the path without the Triton
kernels (CPU, and the oracle for the kernels): extend/prefill chunks attended in groups of
requests over window + compressed entries (`_attend_varlen`, `_attend_group`), the CSA top-k
(`_select`), and the decode step's batched form (`_attend_decode`); where the kernel backend
attends in one call (`attend_in_one_call`: the CPU's C kernel), it replaces parts of it."""

from __future__ import annotations


import torch
import torch.nn.functional as F

from dsv4_engine import kv_quant
from dsv4_engine.models.deepseek_v4_config import CSA, HCA
from dsv4_engine.models.forward_batch import V4Batch


class V4TorchAttention:
    def _select(
        self, L: dict, iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Lightning indexer: score sum_h w_h * relu(q_h . k) * scale per entry, keep the top-k
        visible entries of each query. iq [B, M, IH, d], iw [B, M, IH], ikeys [B, C, d],
        visible [B, M, C] (M queries of each of B requests)."""
        cfg = self.cfg
        B, M, IH, d = iq.shape
        C = ikeys.shape[1]
        score = torch.bmm(iq.reshape(B, M * IH, d).float(), ikeys.float().transpose(1, 2)).view(B, M, IH, C)
        score = (F.relu(score) * cfg.index_head_dim**-0.5 * iw.unsqueeze(-1)).sum(dim=-2)
        score = score.masked_fill(~visible, float("-inf"))
        top = score.topk(min(cfg.index_topk, C), dim=-1).indices
        return visible & torch.zeros_like(visible).scatter_(-1, top, True)

    def _softmax_attend(self, L: dict, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
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
        sink = L["sink"].to(logits.dtype).view(H, 1)
        top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)  # finite: padding rows see only the sink
        probs = logits.sub_(top).exp_()
        probs.div_(probs.sum(dim=-1, keepdim=True).add_((sink - top).exp_()))
        return torch.bmm(probs.view(B, M * H, K).to(keys.dtype), keys).view(B, M, H, hd)

    # Budget (elements) of the largest per-group score tensor of a prefill/mixed step: requests
    # are attended together in groups that stay under it (one group at serving sizes; a single
    # long prompt is one group of its own).
    GROUP_ELEMENTS = 1 << 25

    def _groups(self, spans: list[tuple[int, int, int]]) -> list[list[int]]:
        cfg = self.cfg
        heads = max(cfg.num_attention_heads, cfg.index_n_heads)
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

    def _attend_varlen(
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
        """Any mix of prefill chunks and decode tokens, padded to the longest chunk of a group."""
        out = q.new_empty(q.shape[0] + 1, *q.shape[1:])  # the last row takes the padding's writes
        for group in self._groups(spans):
            self._attend_group(i, L, q, kv, proj, fb, states, [spans[r] for r in group], group, out)
        return out[:-1]

    def _attend_group(
        self,
        i: int,
        L: dict,
        q: torch.Tensor,
        kv: torch.Tensor,
        proj: dict,
        fb: V4Batch,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int, int]],
        group: list[int],
        out: torch.Tensor,
    ) -> None:
        """Requests `group` at once. A request's keys are the window positions before its chunk
        (read from the ring, in position order) followed by the chunk itself, one row per request
        masked by position, then its visible compressed entries."""
        cfg = self.cfg
        W, kind, j = cfg.sliding_window, L["type"], self.type_index.get(i)
        dev = q.device
        B = len(group)
        row, n, start = self._span_tensors(spans, dev)
        Lmax = max(s[1] for s in spans)
        ar = torch.arange(Lmax, device=dev)
        b_ix = torch.arange(B, device=dev)[:, None]
        tok = (row[:, None] + ar).clamp(max=q.shape[0] - 1)  # [B, Lmax]; rows past a chunk are padding
        valid = ar[None] < n[:, None]
        qpos = start[:, None] + ar
        rows = self._index(("group", tuple(group)), lambda: group, dev)
        slots = fb.slot_ids[rows].long()
        pages = fb.block_table[rows]

        ring_store = states[self.SWA_KV]
        kbase = start - W  # the ring holds positions start - W .. start - 1
        ring = ring_store[slots[:, None], i, (kbase[:, None] + torch.arange(W, device=dev)) % W]
        # [B, W + Lmax, hd] in position order (fp8kv: the ring decoded)
        ext_kv = torch.cat([kv_quant.decode(ring, kv.dtype), self._take(kv, tok)], 1)
        self._save_snapshots(fb, group, spans, self.SWA_KV, i, ext_kv)
        # only the last R ring positions can be seen (R < W when every chunk of the group starts
        # early: a fresh prompt attends to none of the ring)
        R = min(W, max(s[2] for s in spans))
        # a window much narrower than the chunk: each query's own W keys in one native call,
        # where the padded tile would score (and mask) R + Lmax keys per query
        native = self.attend_in_one_call and ext_kv.dtype == torch.float32 and 4 * W <= R + Lmax
        if not native:
            kpos = kbase[:, None] + torch.arange(W - R, W + Lmax, device=dev)
            kp, qp = kpos[:, None, :], qpos[:, :, None]
            allowed = (kp <= qp) & (kp > qp - W) & (kp >= 0)  # [B, Lmax, R + Lmax]
            keys = ext_kv[:, W - R :]
        entries = visible = None
        if kind in (CSA, HCA):
            rate = cfg.compress_rates[kind]
            self._close_windows(L, proj, tok, spans, slots, pages, fb, states, j, rate, group)
            C = max((st + m) // rate for _, m, st in spans)  # entries closed so far, at most
            if C:
                w = torch.arange(C, device=dev)
                visible = w < ((qpos + 1) // rate)[:, :, None]  # [B, Lmax, C]: t sees w iff w < (t+1)//rate

                if kind == CSA:
                    ikeys = self._gather_entries(states[self.CSA_INDEX_K][:, j], pages, w, rate, fb.page_size)
                    visible = self._select(L, self._take(proj["iq"], tok), self._take(proj["iw"], tok), ikeys, visible)
                entries = self._gather_entries(
                    states[self.CSA_KV if kind == CSA else self.HCA_KV][:, j], pages, w, rate, fb.page_size
                )
                if not native:
                    keys = torch.cat([keys, entries.to(kv.dtype)], 1)
                    allowed = torch.cat([allowed, visible], 2)
        if native:
            self.ops.v4_attend_extend(q, ext_kv, row, n, start, W, L["sink"], cfg.head_dim**-0.5, out, entries, visible)
        else:
            o = self._softmax_attend(L, q[tok], keys, allowed)  # [B, Lmax, H, hd]
            out[torch.where(valid, tok, out.shape[0] - 1)] = o  # padding lands on the scratch row
        # the ring keeps the last W positions (written after the reads above): position p of the
        # new ring is ext_kv's p - kbase; positions before the chunk rewrite what they held
        end = start + n
        keep = torch.arange(W, device=dev)
        ring_store[slots[:, None], i, (end[:, None] - W + keep) % W] = kv_quant.encode(  # fp8kv
            ext_kv[b_ix, n[:, None] + keep], ring_store
        )

    def _attend_decode(
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
        """One new token per request: every request at once, window closing included."""
        cfg = self.cfg
        W, kind, j = cfg.sliding_window, L["type"], self.type_index.get(i)
        t = fb.positions  # [B]
        slots = fb.slot_ids.long()
        ring_store = states[self.SWA_KV]

        def window() -> torch.Tensor:
            ring_pos = (t[:, None] - 1) - torch.remainder(t[:, None] - 1 - torch.arange(W, device=t.device), W)
            kpos = torch.cat([ring_pos, t[:, None]], 1)
            return (kpos <= t[:, None]) & (kpos > t[:, None] - W) & (kpos >= 0)

        entry_store = {CSA: self.CSA_KV, HCA: self.HCA_KV}.get(kind)
        native = (
            self.attend_in_one_call
            and ring_store.dtype == q.dtype == torch.float32
            and (entry_store is None or states[entry_store].dtype == torch.float32)
        )
        if not native:
            allowed = self._memo(("decode_window",), window)  # [B, W+1], the same in every layer
            keys = torch.cat([kv_quant.decode(ring_store[slots, i], kv.dtype), kv[:, None]], 1)  # [B, W+1, hd]
        entries_at = None  # the native call's (store, visible)
        if kind in (CSA, HCA):
            rate = cfg.compress_rates[kind]
            self._stage_decode(L, proj, fb, states, j, rate, spans)
            C = max((st + 1) // rate for _, _, st in spans)
            if C:

                def entry_indices(epp: int):
                    w = torch.arange(C, device=t.device)
                    page, off = self._locate(w, rate, fb.page_size, epp)
                    at = (fb.block_table[:, page].long(), off[None].expand(fb.block_table.shape[0], -1))
                    return w[None] < ((t + 1) // rate)[:, None], at  # visible [B, C], gather index

                def gather(store: torch.Tensor) -> torch.Tensor:  # [B, C, dim] of a layer's paged store
                    at = self._memo(("decode_entries", rate, store.shape[1]), lambda: entry_indices(store.shape[1]))[1]
                    return kv_quant.decode(store[at], kv.dtype)  # fp8kv: FP8 entries read as kv's dtype

                store = states[entry_store][:, j]
                visible = self._memo(("decode_entries", rate, store.shape[1]), lambda: entry_indices(store.shape[1]))[0]
                if kind == CSA:
                    ikeys = gather(states[self.CSA_INDEX_K][:, j])  # [B, C, ihd]
                    visible = self._select(
                        L, proj["iq"].unsqueeze(1), proj["iw"].unsqueeze(1), ikeys, visible.unsqueeze(1)
                    ).squeeze(1)
                if native:
                    entries_at = (store, visible, rate)
                else:
                    keys = torch.cat([keys, gather(store).to(kv.dtype)], 1)
                    allowed = torch.cat([allowed, visible], 1)
        if native:
            store, visible, rate = entries_at or (None, None, 0)
            out = self.ops.v4_attend_decode(
                q,
                kv,
                ring_store[:, i],
                slots,
                t,
                L["sink"],
                cfg.head_dim**-0.5,
                store,
                fb.block_table,
                visible,
                rate,
                fb.page_size,
            )
        else:
            out = self._softmax_attend(L, q.unsqueeze(1), keys, allowed.unsqueeze(1)).squeeze(1)
        kv_quant.store_(ring_store, (slots, i, t % W), kv)  # fp8kv
        return out
