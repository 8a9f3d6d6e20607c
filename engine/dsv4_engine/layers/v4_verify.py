"""DeepSeek-V4's speculative verify step at a fixed shape: what a CUDA graph captures.

A verify step gives each request up to n = k + 1 new tokens (its last token and up to k drafts;
a short prefill chunk fits too) at consecutive positions. The eager extend learns from the
batch's host lengths which windows close in the step, which ring slots it writes and how many
compressed entries a request has; a captured step cannot (its content changes between replays,
its launches may not). Here every request is n rows: its real tokens, then padding tokens at the
positions after them, and the real run's end is `fb.seq_lens` (`fb.extend_lens` is n for every
request). Everything that depends on content is computed on the device from positions and
lengths, with shapes that depend on n, the request count and the block table's width only:

- window closing: a run of n positions closes at most ceil(n / rate) windows of a rate. Each
  request runs that many candidates, windows start // rate + c, capped at the last window its
  real run closes (seq_len // rate - 1, or the last one closed before the run when it closes
  none; window 0 when there is none yet). A candidate whose window closes in the real run writes
  its pooled entry; the others write back what the store holds (so two candidates capped to the
  same window write the same bytes, and a page the prefix cache shares keeps its entries);
- the stage rings and the window ring take the real tokens' projections at their positions;
  a padding token writes back what its slot holds (n fits every ring: no slot is written twice);
- attention: the kernel path's indexer and extend attention read positions and lengths from the
  device already; the torch path attends over the ring, the run and every entry the block table
  can hold (the width's), masked by position, with the indexer's top-k over the same. Padding
  tokens sit after the real ones, so no real token sees them.

Rejected drafts are rolled back by the speculator as for the eager step (`RingRollback` puts back
the ring and stage entries; a compressed entry a rejected position closed is invisible until a
real token closes its window again and rewrites it): this step writes exactly what the eager one
writes. Padding requests of a graph bucket repeat request 0 whole, so they write what it writes.

The attention layer routes a step here when its `spans` is a `FixedRows` (`V4Attention.forward`);
spec_decode/graphs.py captures it; tests/unit/engine/test_spec_graphs_v4_verify.py checks it
against the eager extend and for capture safety.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_engine import kv_quant
from dsv4_engine.layers.v4_step import CSA_INDEX_K, SWA_KV, gather_entries, locate


@dataclass(frozen=True)
class FixedRows:
    """The step's shape in place of host spans: every request has `n` new tokens, rows in order."""

    n: int


def attend(attn, q: torch.Tensor, kv: torch.Tensor, proj: dict, fb, states: dict, n: int, step):
    """An attention layer's step for T = B * n queries q [T, H, hd] with their kv [T, hd]:
    windows close first (their entries are visible to the run's later tokens), then attention,
    then the window ring takes each request's last tokens. Returns [T, H, hd]."""
    cfg = attn.backend.cfg
    W = cfg.sliding_window
    T = q.shape[0]
    B = T // n
    if n > W:
        raise ValueError(f"a fixed verify step of {n} tokens a request does not fit the window ring ({W})")
    slots = fb.slot_ids.long()
    pos = fb.positions.view(B, n)
    start, end = pos[:, 0], fb.seq_lens.long()
    real = step.memo(("fixed_real", n), lambda: pos < end[:, None])  # [B, n]: not a padding token
    if attn.rate:
        close_windows(attn, proj, fb, states, n, start, end, slots, real, step)
    if attn.backend.kops is not None:
        out = _attend_kernels(attn, q, kv, proj, fb, states)
    else:
        out = _attend_torch(attn, q, kv, proj, fb, states, n, start, slots, pos)
    write_masked(states[SWA_KV], slots, attn.layer, pos % W, kv.view(B, n, -1), real)  # after the reads above
    return out


def write_masked(ring: torch.Tensor, slots, layer: int, at: torch.Tensor, values: torch.Tensor, real) -> None:
    """ring[slots[b], layer, at[b, c]] = values[b, c] where real[b, c]; elsewhere what it held."""
    rows = slots[:, None].expand(at.shape)
    ring[rows, layer, at] = torch.where(real[..., None], kv_quant.encode(values, ring), ring[rows, layer, at])


def closing_windows(
    start: torch.Tensor, end: torch.Tensor, n: int, rate: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For runs of positions start .. end - 1 [B] (at most n each): (window ids [B * c], whether
    each closes in its run [B * c], its request [B * c]), c = ceil(n / rate) candidates a request
    (see the module docstring). A window w closes at position (w + 1) * rate - 1."""
    B, c = start.shape[0], -(-n // rate)
    last = end // rate - 1
    w = torch.minimum(start[:, None] // rate + torch.arange(c, device=start.device), last[:, None]).clamp(min=0)
    closes = ((w + 1) * rate - 1 >= start[:, None]) & ((w + 1) * rate <= end[:, None])
    req = torch.arange(B, device=start.device).repeat_interleave(c)
    return w.reshape(-1), closes.reshape(-1), req


def close_windows(attn, proj, fb, states, n: int, start, end, slots, real, step) -> None:
    """Feed the step's runs to the layer's compressor(s), as the eager `close_chunks` does, with
    every request's candidates pooled and written masked. A window may have started in an
    earlier step: its first tokens are read back from the stage ring (the S positions before the
    run), as is CSA's previous window."""
    B, j, rate = start.shape[0], attn.j, attn.rate
    dev = start.device
    w, closes, req = step.memo(("fixed_close", rate, n), lambda: closing_windows(start, end, n, rate))
    for comp in attn.compressors:
        st = states[comp.stage]  # [rows, layers, S, 2 * width]: [kv | gate] projections
        S, width = st.shape[2], st.shape[3] // 2
        if n > S:
            raise ValueError(f"a fixed verify step of {n} tokens a request does not fit a stage ring ({S})")
        chunk = torch.cat(proj[comp.key], dim=-1).view(B, n, -1)
        ebase = start - S
        keep = torch.arange(S, device=dev)
        held = st[slots[:, None], j, (ebase[:, None] + keep) % S]
        ext = torch.cat([held.to(chunk.dtype), chunk], 1)  # positions start - S .. start + n - 1
        # rows of ext of each candidate's window (and its predecessor's); a candidate that does
        # not close may point outside: clamped, its entry is dropped below
        offs = (w * rate - ebase[req])[:, None] + torch.arange(rate, device=dev)
        win = ext[req[:, None], offs.clamp(0, S + n - 1)]
        prev = ext[req[:, None], (offs - rate).clamp(0, S + n - 1)] if comp.overlap else None  # window 0's masked
        entries = comp.pool_split(
            win[..., :width],
            win[..., width:],
            None if prev is None else prev[..., :width],
            None if prev is None else prev[..., width:],
            w,
        )
        store = states[comp.store][:, j]
        page, off = locate(w, rate, fb.page_size, store.shape[1])
        at = (fb.block_table[req, page].long(), off)
        store[at] = torch.where(closes[:, None], kv_quant.encode(entries, store), store[at])  # fp8kv
        # the real tokens' projections at their positions (the ring then holds the S before end)
        write_masked(st, slots, j, (start[:, None] + torch.arange(n, device=dev)) % S, chunk, real)


def _attend_kernels(attn, q, kv, proj, fb, states):
    """The kernel path's extend attention: its launches are sized by the row count, and it reads
    positions and lengths (fb.extend_lens, n for every request) from the device."""
    cfg, j, rate = attn.backend.cfg, attn.j, attn.rate
    comp_kv = comp_idx = None
    if rate:
        comp_kv = states[attn.entry_store][:, j]
        if attn.indexer is not None:
            comp_idx = attn.indexer.topk_kernels(proj, states, j, fb, rate)
    return attn.backend.kops.v4_attention_extend(
        q,
        kv,
        states[SWA_KV][:, attn.layer],
        fb.slot_ids,
        fb.positions,
        fb.extend_lens,
        fb.block_table,
        comp_kv,
        comp_idx,
        attn.sink,
        cfg.head_dim**-0.5,
        rate,
        fb.page_size,
    )


def _attend_torch(attn, q, kv, proj, fb, states, n, start, slots, pos):
    """Each request's queries over [its ring's W positions before the run | the run | every
    compressed entry its block table can hold], masked by position (as `attend_group`)."""
    W, dev, j, rate = attn.backend.cfg.sliding_window, q.device, attn.j, attn.rate
    T, H, hd = q.shape
    B = T // n
    kbase = start - W
    ring = states[SWA_KV][slots[:, None], attn.layer, (kbase[:, None] + torch.arange(W, device=dev)) % W]
    keys = torch.cat([kv_quant.decode(ring, kv.dtype), kv.view(B, n, -1)], 1)  # [B, W + n, hd] in position order
    kp = (kbase[:, None] + torch.arange(W + n, device=dev))[:, None, :]
    qp = pos[:, :, None]
    allowed = (kp <= qp) & (kp > qp - W) & (kp >= 0)  # [B, n, W + n]
    if rate:
        C = fb.block_table.shape[1] * fb.page_size // rate
        w = torch.arange(C, device=dev)
        visible = w < ((pos + 1) // rate)[:, :, None]  # [B, n, C]: t sees w iff w < (t + 1) // rate
        if attn.indexer is not None:
            ikeys = gather_entries(states[CSA_INDEX_K][:, j], fb.block_table, w, rate, fb.page_size, attn.backend.dtype)
            iq = proj["iq"].reshape(B, n, *proj["iq"].shape[1:])
            visible = attn.indexer.select(iq, proj["iw"].reshape(B, n, -1), ikeys, visible)
        entries = gather_entries(
            states[attn.entry_store][:, j], fb.block_table, w, rate, fb.page_size, attn.backend.dtype
        )
        keys = torch.cat([keys, entries.to(kv.dtype)], 1)
        allowed = torch.cat([allowed, visible], 2)
    return attn.softmax_attend(q.view(B, n, H, hd), keys, allowed).reshape(T, H, hd)
