"""One engine step with MTP speculation: verify, accept, catch up the drafter, draft again.

Per scheduled request, the target runs one extend over its new tokens: a prefill chunk, or (a
decoding request) its last token followed by the k tokens drafted for it last step. The target's
hidden states at every position come back; the rows that end at or past the request's last known
token are verified (`verify`), which emits 1..k+1 tokens. The MTP block then runs over the same
positions that are now valid, each with the token after it and the target's hidden state there
("catch-up": it overwrites whatever its draft chain wrote at those positions last step), which
gives the first draft for the next step; k-1 more come from the block chained on its own hidden
states, one position at a time.

Rollback: a rejected position's KV (target and MTP) sits past the request's `num_computed`, so
nothing reads it (attention reads only up to each request's length) and the next step writes
those positions again before reading them; the prefix cache takes only pages whose every token is
computed. The pages stay with the request for its next step (drafting needs them again) and go
back with the rest when it ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch

from dsv4_engine.batch_buffers import BatchBuffers, host_batch
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.sampling import SamplingError, logprob_entry
from dsv4_engine.scheduler import ScheduledSeq
from dsv4_engine.spec_decode.mtp_layer import MTPLayer, V3Target
from dsv4_engine.spec_decode.mtp_v4 import RingRollback
from dsv4_engine.spec_decode.verify import accept_greedy, rejection_sample, sampling_probs


@dataclass
class Draft:
    tokens: list[int]
    probs: Optional[torch.Tensor] = None  # [k, V] the distributions they were drawn from (sampled requests)


@dataclass
class SpecResult:
    """What one step gives a request: tokens to emit in order, and how many tokens' KV became
    valid (its num_computed grows by that much)."""

    tokens: list[int]
    computed: int
    num_drafts: int = 0  # drafts this step verified
    logprobs: Optional[list[dict]] = None


def _tokens(seq, start: int, n: int) -> list[int]:
    p = len(seq.prompt_ids)
    if start >= p:
        return seq.output_ids[start - p : start - p + n]
    return seq.prompt_ids[start : start + n] + seq.output_ids[: max(0, start + n - p)]


class MTPSpeculator:
    def __init__(self, runner, model_dir: str, num_steps: int):
        self.runner = runner
        self.model = runner.model
        if runner.model_type == "deepseek_v4":
            from dsv4_engine.spec_decode.mtp_v4 import STATE, V4MTPLayer, V4Target

            self.target, self.mtp, self.mtp_ring = V4Target(self.model), V4MTPLayer(self.model, model_dir), STATE
        else:
            self.target, self.mtp, self.mtp_ring = V3Target(self.model), MTPLayer(self.model, model_dir), None
        self.k = num_steps
        self.explode = runner.model_type == "deepseek_v3"  # see _batch
        self.drafts: "weakref.WeakKeyDictionary[object, Draft]" = weakref.WeakKeyDictionary()
        self.target_buffers = BatchBuffers(runner.device)
        self.draft_buffers = BatchBuffers(runner.device)
        self.max_model_len: int = runner.cfg.max_position_embeddings  # the engine sets its own limit
        self.eos_ids: set[int] = set(runner.cfg.eos_token_ids)
        self.state_specs: list = []  # set by build_speculator

    # ---- metrics -------------------------------------------------------------------------------

    def observe(self, metrics, r: SpecResult) -> None:
        """One verify step of one request: drafts proposed, accepted, tokens it emitted."""
        accepted = len(r.tokens) - 1
        metrics.inc("spec_decode_num_draft_tokens", r.num_drafts)
        metrics.inc("spec_decode_num_accepted_tokens", accepted)
        metrics.inc("spec_decode_num_verify_steps")
        metrics.observe("spec_decode_accept_length", accepted + 1)

    def loads(self, metrics) -> dict:
        t = metrics.totals
        steps = t.get("spec_decode_num_verify_steps", 0)
        drafts = t.get("spec_decode_num_draft_tokens", 0)
        accepted = t.get("spec_decode_num_accepted_tokens", 0)
        return {
            "algorithm": "mtp",
            "num_steps": self.k,
            # Tokens a verify step emits on average (accepted drafts + the target's own).
            "mean_acceptance_length": round(1 + accepted / steps, 4) if steps else None,
            "draft_acceptance_rate": round(accepted / drafts, 4) if drafts else None,
        }

    # ---- the scheduler's question ------------------------------------------------------------

    def lookahead(self, seq) -> int:
        """Drafted tokens a decoding request computes this step besides its last token."""
        d = self.drafts.get(seq)
        return len(d.tokens) if d is not None else 0

    # ---- one step ------------------------------------------------------------------------------

    def _fb(self, buffers: BatchBuffers, hb, page_size: int) -> ForwardBatch:
        news = hb.extend_lens.tolist()
        t = buffers.upload(hb)
        return ForwardBatch(
            input_ids=t["input_ids"],
            positions=t["positions"],
            slot_mapping=t["slot_mapping"],
            block_table=t["block_table"],
            seq_lens=t["seq_lens"],
            extend_lens=t["extend_lens"],
            logits_indices=t["logits_indices"],
            all_decode=all(n == 1 for n in news),
            slot_ids=t.get("slot_ids"),
            page_size=page_size,
            seq_lens_host=hb.seq_lens.tolist(),
            extend_lens_host=news,
        )

    def _batch(
        self,
        buffers: BatchBuffers,
        starts: list[int],
        news: list[int],
        pages: list[list[int]],
        toks: list[list[int]],
        slots: list,
        page_size: int,
    ) -> ForwardBatch:
        """The step's batch. On V3, when every request computes at most k+1 tokens (verify rows,
        short chunks), each token becomes a one-token row of its own (its request's pages, the
        context up to itself): the whole step runs the batched decode attention instead of a
        per-request extend. The same math (the step writes every token's KV before attending),
        one attention call where the extend path loops over requests. V4's rings are read
        before a step's writes, so its rows stay whole."""
        if self.explode and news and max(news) <= self.k + 1 and max(news) > 1:
            xs = [s + j for s, n in zip(starts, news) for j in range(n)]
            xp = [pg for pg, n in zip(pages, news) for _ in range(n)]
            xt = [[t] for tk in toks for t in tk]
            xsl = [sl for sl, n in zip(slots, news) for _ in range(n)]
            return self._fb(buffers, host_batch(xs, [1] * len(xs), xp, xt, xsl, page_size), page_size)
        return self._fb(buffers, host_batch(starts, news, pages, toks, slots, page_size), page_size)

    def step(self, batch: list[ScheduledSeq], pool) -> list[Union[SpecResult, Exception, None]]:
        """Results in batch order: a SpecResult (None for a prefill chunk that ends before the
        request's last token: it only computed), or the exception one request's row raised.
        A failed forward raises (it fails the batch)."""
        ps, states = pool.page_size, pool.all_states
        dev = self.runner.device
        starts, news, toks, real, ndraft = [], [], [], [], []
        for b in batch:
            seq, start = b.seq, b.seq.num_computed
            r = min(b.num_new, seq.num_tokens - start)
            d = b.num_new - r
            draft = self.drafts.get(seq)
            drafted = draft.tokens[:d] if d else []
            assert len(drafted) == d, "scheduled more drafts than were made"
            starts.append(start), news.append(b.num_new), real.append(r), ndraft.append(d)
            toks.append(_tokens(seq, start, r) + drafted)
        slots = [b.seq.slot for b in batch]
        fb = self._batch(self.target_buffers, starts, news, [b.seq.pages for b in batch], toks, slots, ps)
        # V4's rings: what the drafts' positions will overwrite, to put back where they are rejected.
        spec_rows = [i for i in range(len(batch)) if ndraft[i]]
        rings = {n: t for n, t in pool.slot_states.items() if n != self.mtp_ring}
        ring_undo = (
            RingRollback(
                rings,
                [slots[i] for i in spec_rows for _ in range(ndraft[i])],
                [starts[i] + real[i] + j for i in spec_rows for j in range(ndraft[i])],
            )
            if rings and spec_rows
            else None
        )
        hidden = self.target.hidden(fb, states)  # [T, hidden] (V4: [T, hc, hidden] streams)
        row0 = [0, *itertools.accumulate(news)][:-1]  # first token row of each request

        # Target logits at every position that verifies: the last real token and each draft.
        ends = [i for i, b in enumerate(batch) if starts[i] + real[i] == b.seq.num_tokens]
        idx = [row0[i] + real[i] - 1 + j for i in ends for j in range(ndraft[i] + 1)]
        results: list[Union[SpecResult, Exception, None]] = [None] * len(batch)
        if idx:
            logits = self.target.logits(hidden[torch.tensor(idx, device=dev)])
            self._verify(batch, ends, ndraft, logits, results)
        if ring_undo is not None:  # a failed row's request ends: its row's content no longer matters
            first_rejected = [
                starts[i] + (real[i] + len(results[i].tokens) - 1 if isinstance(results[i], SpecResult) else 0)
                for i in spec_rows
                for _ in range(ndraft[i])
            ]
            ring_undo.restore(first_rejected)

        # Catch-up: the MTP block over every position now valid, with the token after each.
        cu = [i for i in range(len(batch)) if not isinstance(results[i], Exception)]
        cu_starts, cu_news, cu_toks, cu_rows = [], [], [], []
        for i in cu:
            seq, r = batch[i].seq, results[i]
            m = real[i] + len(r.tokens) - 1 if r is not None else news[i]
            after = _tokens(seq, starts[i] + 1, m if r is None else real[i] - 1)
            if r is not None:
                after = after + r.tokens
                r.computed = m
            cu_starts.append(starts[i]), cu_news.append(m), cu_toks.append(after)
            cu_rows.extend(range(row0[i], row0[i] + m))
        if not cu:
            return results
        every_row = len(cu_rows) == hidden.shape[0]  # cu_rows are increasing: then they are all rows
        if self.explode and fb.all_decode:
            # The verify batch has one row per token, at the positions, pages and slots the
            # catch-up computes: its rows (those still valid) with the next tokens as input.
            fb2 = self._rows(fb, None if every_row else cu_rows, list(itertools.chain.from_iterable(cu_toks)))
        else:
            fb2 = self._batch(
                self.draft_buffers,
                cu_starts,
                cu_news,
                [batch[i].seq.pages for i in cu],
                cu_toks,
                [slots[i] for i in cu],
                ps,
            )
        last = torch.tensor(list(itertools.accumulate(cu_news)), device=dev) - 1  # each request's last row
        prev = hidden if every_row else hidden[torch.tensor(cu_rows, device=dev)]
        dlogits, dhidden = self.mtp.forward(fb2, states, prev, last)

        # Drafts for the next step, for requests that go on.
        chain = []  # (batch index, row in dlogits, drafts wanted, next position)
        for j, i in enumerate(cu):
            r = results[i]
            if r is None:
                self.drafts.pop(batch[i].seq, None)
                continue
            want = self._drafts_wanted(batch[i].seq, r.tokens, cu_starts[j] + cu_news[j], pool)
            if want:
                chain.append((i, j, want, cu_starts[j] + cu_news[j]))
            else:
                self.drafts[batch[i].seq] = Draft([])
        if chain:
            self._draft(batch, chain, dlogits, dhidden, pool)
        return results

    def _verify(self, batch, ends, ndraft, logits, results) -> None:
        """Greedy and sampled rows of the verifying requests, all argmaxes read back at once."""
        counts = [ndraft[i] + 1 for i in ends]
        offs = [sum(counts[:n]) for n in range(len(ends))]
        # One read back for both (a device sync each on a GPU).
        host_argmax, host_nan = torch.stack([logits.argmax(dim=-1), torch.isnan(logits).any(dim=-1)]).tolist()
        for n, i in enumerate(ends):
            seq = batch[i].seq
            lo, hi = offs[n], offs[n] + counts[n]
            try:
                if any(host_nan[lo:hi]):
                    raise SamplingError("the model produced NaN logits for this request")
                draft = self.drafts.get(seq)
                drafted = draft.tokens[: ndraft[i]] if ndraft[i] else []
                p = seq.params
                if p.greedy:
                    toks = accept_greedy(drafted, host_argmax[lo:hi])
                else:
                    probs = sampling_probs(
                        logits[lo:hi], [p.temperature] * counts[n], [p.top_k] * counts[n], [p.top_p] * counts[n]
                    )
                    if not torch.isfinite(probs).all() or (probs.sum(dim=-1) <= 0).any():
                        raise SamplingError("the sampling distribution is not finite (check temperature/top_p/top_k)")
                    q = draft.probs[: ndraft[i]] if ndraft[i] else probs[:0]
                    toks = rejection_sample(probs, q, drafted, seq.generator)
                lps = None
                if p.logprobs is not None:
                    ls = torch.log_softmax(logits[lo : lo + len(toks)], dim=-1)
                    lps = [logprob_entry(ls[j], t, p.logprobs) for j, t in enumerate(toks)]
                results[i] = SpecResult(toks, 0, ndraft[i], lps)
            except Exception as e:  # noqa: BLE001 — one request's row fails that request alone
                results[i] = e

    def _drafts_wanted(self, seq, new: list[int], next_pos: int, pool) -> int:
        """How many tokens to draft for a request's next step: up to k, never more than its
        max_tokens or the context allow after this step's tokens minus the one the target adds,
        none when this step's tokens end it with EOS or a stop id, and no more than its pages
        can hold without preempting anyone (the chain writes the MTP KV at next_pos onwards)."""
        if seq.prefill_only:  # PD prefill: its first token ends it here; decode drafts from the MTP state it gets
            return 0
        p = seq.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        if any(t in stops for t in new):
            return 0
        out_len, total = len(seq.output_ids) + len(new), seq.num_tokens + len(new)
        want = min(self.k, p.max_tokens - out_len - 1, self.max_model_len - total - 1)
        if want <= 0:
            return 0
        # The chain's k-1 decode steps write positions next_pos .. next_pos + want - 2.
        need = -(-(next_pos + want - 1) // pool.page_size) - len(seq.pages)
        if need > 0:
            pages = pool.allocator.allocate(need)
            if pages is None:
                have = len(seq.pages) * pool.page_size - next_pos + 1
                return max(0, min(want, have))
            seq.pages.extend(pages)
        return want

    def _pick(self, logits: torch.Tensor, seqs) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """A draft token per row: the argmax for greedy requests, a draw from the drafter's own
        distribution (kept, for verification) for sampled ones."""
        toks = logits.argmax(dim=-1).tolist()
        probs: list[Optional[torch.Tensor]] = [None] * len(seqs)
        sampled = [n for n, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            ps = [seqs[n].params for n in sampled]
            q = sampling_probs(
                logits[sampled], [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps]
            )
            q = torch.nan_to_num(q, nan=0.0)
            for j, n in enumerate(sampled):
                row = q[j]
                if not (row.sum() > 0):
                    row = torch.full_like(row, 1.0 / row.numel())
                    q[j] = row
                toks[n] = int(torch.multinomial(row.double(), 1, generator=seqs[n].generator))
                probs[n] = q[j]
        return toks, probs

    def _rows(self, fb: ForwardBatch, rows: Optional[list[int]], tokens: list[int]) -> ForwardBatch:
        """Some rows (None: all) of a one-token-per-row batch, with other input tokens."""
        dev = fb.input_ids.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        if rows is None:
            return dataclasses.replace(fb, input_ids=ids)
        sel = torch.tensor(rows, device=dev)
        return ForwardBatch(
            input_ids=ids,
            positions=fb.positions[sel],
            slot_mapping=fb.slot_mapping[sel],
            block_table=fb.block_table[sel],
            seq_lens=fb.seq_lens[sel],
            extend_lens=fb.extend_lens[sel],
            logits_indices=torch.arange(len(rows), device=dev),
            all_decode=True,
            slot_ids=None if fb.slot_ids is None else fb.slot_ids[sel],
            page_size=fb.page_size,
            seq_lens_host=[fb.seq_lens_host[r] for r in rows],
            extend_lens_host=[1] * len(rows),
        )

    def _advance(self, fb: ForwardBatch, tokens: list[int], page_size: int) -> ForwardBatch:
        """A one-token-per-row batch moved one position on, with new input tokens: positions
        and lengths + 1, each row's KV slot looked up in its block table (on the device)."""
        pos = fb.positions + 1
        rows = torch.arange(pos.shape[0], device=pos.device)
        slot = fb.block_table[rows, pos // page_size].long() * page_size + pos % page_size
        return ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=pos.device),
            positions=pos,
            slot_mapping=slot,
            block_table=fb.block_table,
            seq_lens=fb.seq_lens + 1,
            extend_lens=fb.extend_lens,
            logits_indices=fb.logits_indices,
            all_decode=True,
            slot_ids=fb.slot_ids,
            page_size=page_size,
            seq_lens_host=[n + 1 for n in fb.seq_lens_host],
            extend_lens_host=fb.extend_lens_host,
        )

    def _draft(self, batch, chain, dlogits, dhidden, pool) -> None:
        dev = self.runner.device
        seqs = [batch[i].seq for i, _, _, _ in chain]
        js = [j for _, j, _, _ in chain]
        if js == list(range(dlogits.shape[0])):  # every catch-up row drafts: no gather
            rows = None
        else:
            rows = torch.tensor(js, device=dev)
            dlogits, dhidden = dlogits[rows], dhidden[rows]
        toks, probs = self._pick(dlogits, seqs)
        drafts = [Draft([t], None if pr is None else [pr]) for t, pr in zip(toks, probs)]
        hid = dhidden
        live = list(range(len(chain)))  # chain entries still drafting
        # The chain writes the block's ring past the request's valid positions; V4's ring wraps,
        # so what those writes overwrite is put back once the drafts are made.
        ring = {self.mtp_ring: pool.slot_states[self.mtp_ring]} if self.mtp_ring else {}
        undo = (
            RingRollback(
                ring,
                [seqs[n].slot for n in live for s in range(1, chain[n][2])],
                [chain[n][3] + s - 1 for n in live for s in range(1, chain[n][2])],
            )
            if ring
            else None
        )
        step, fb, prev_live = 1, None, None
        while True:
            live = [n for n in live if chain[n][2] > step]
            if not live:
                break
            if fb is not None and live == prev_live:
                # The same rows one position further: advance the last batch on the device
                # instead of building and uploading a new one (the pages are already there).
                fb = self._advance(fb, [drafts[n].tokens[-1] for n in live], pool.page_size)
            else:
                pos = [chain[n][3] + step - 1 for n in live]
                hb = host_batch(
                    pos,
                    [1] * len(live),
                    [seqs[n].pages for n in live],
                    [[drafts[n].tokens[-1]] for n in live],
                    [seqs[n].slot for n in live],
                    pool.page_size,
                )
                fb = self._fb(self.draft_buffers, hb, pool.page_size)
            if len(live) == len(chain):  # every row drafts on: no gather, no scatter
                lg, hid = self.mtp.forward(fb, pool.all_states, hid)
            else:
                sel = torch.tensor(live, device=dev)
                lg, h = self.mtp.forward(fb, pool.all_states, hid[sel])
                new_hid = hid.clone()
                new_hid[sel] = h
                hid = new_hid
            prev_live = live
            t, pr = self._pick(lg, [seqs[n] for n in live])
            for m, n in enumerate(live):
                drafts[n].tokens.append(t[m])
                if pr[m] is not None:
                    drafts[n].probs.append(pr[m])
            step += 1
        if undo is not None:
            undo.restore()
        for n, s in enumerate(seqs):
            d = drafts[n]
            self.drafts[s] = Draft(d.tokens, torch.stack(d.probs) if d.probs is not None else None)
