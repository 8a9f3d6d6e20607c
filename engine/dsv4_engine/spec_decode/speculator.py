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

V4's prefix cache also keeps snapshots of a request's slot row at boundaries (its rings, the MTP
block's ring included). None is taken where a draft could still be rejected: drafts never cross
a boundary (`_drafts_wanted`), so a request stands on each one after acceptance and the row is
copied there; snapshots inside a chunk (prefill) get the block's ring from the catch-up
(`_snapshots_in_catch_up`). A request resumed from one starts with the block's state at the
boundary, as if it had computed the prefix (docs/prefix-caching.md).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch

from dsv4_engine.batch_buffers import BatchBuffers, HostBatch, host_batch
from dsv4_engine.models.forward_batch import ForwardBatch
from dsv4_engine.sampling import NoTokenAllowed, SamplingError, logprob_entry
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
        # The forwards this process computes with: at --tp-size > 1 rank 0 wraps self.target and
        # self.mtp to reach the other ranks first (parallel.spec), a captured step runs these.
        self.local_target, self.local_mtp = self.target, self.mtp
        self.k = num_steps
        self.explode = runner.model_type == "deepseek_v3"  # see _batch
        self.drafts: "weakref.WeakKeyDictionary[object, Draft]" = weakref.WeakKeyDictionary()
        self.target_buffers = BatchBuffers(runner.device)
        self.draft_buffers = BatchBuffers(runner.device)
        self.max_model_len: int = runner.cfg.max_position_embeddings  # the engine sets its own limit
        self.eos_ids: set[int] = set(runner.cfg.eos_token_ids)
        self.state_specs: list = []  # set by build_speculator
        self.graphs = None  # captured verify/draft steps (spec_decode.graphs.SpecGraphs), when on
        # Saves and puts back V4's ring entries around drafts; at --tp-size N, a version that
        # does the same on every rank (dsv4_engine.parallel.spec).
        self.rollback = RingRollback
        self._mask_filler = None  # structured outputs' masks (`_masks`)
        # The prefix cache's snapshot boundary (models with slot states; set by the engine): see
        # _drafts_wanted. None: no snapshots.
        self.cache_boundary: Optional[int] = None

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
        return ForwardBatch.of_tensors(
            buffers.upload(hb),
            page_size,
            all(n == 1 for n in news),
            seq_lens_host=hb.seq_lens.tolist(),
            extend_lens_host=news,
        )

    def _batch(
        self,
        starts: list[int],
        news: list[int],
        pages: list[list[int]],
        toks: list[list[int]],
        slots: list,
        page_size: int,
    ) -> tuple[HostBatch, bool]:
        """The step's batch, and whether its every row is one token (a decode-shaped step, which
        a captured graph can run: dsv4_engine.spec_decode.graphs). On V3, when every request
        computes at most k+1 tokens (verify rows, short chunks), each token becomes a one-token
        row of its own (its request's pages, the context up to itself): the whole step runs the
        batched decode attention instead of a per-request extend. The same math (the step
        writes every token's KV before attending), one attention call where the extend path
        loops over requests. V4's rings are read before a step's writes, so its rows stay whole."""
        if self.explode and news and max(news) <= self.k + 1 and max(news) > 1:
            xs = [s + j for s, n in zip(starts, news) for j in range(n)]
            xp = [pg for pg, n in zip(pages, news) for _ in range(n)]
            xt = [[t] for tk in toks for t in tk]
            xsl = [sl for sl, n in zip(slots, news) for _ in range(n)]
            return host_batch(xs, [1] * len(xs), xp, xt, xsl, page_size), True
        return host_batch(starts, news, pages, toks, slots, page_size), all(n == 1 for n in news)

    def _fb_with(self, buffers: BatchBuffers, hb: HostBatch, pool, snapshots: Optional[tuple]) -> ForwardBatch:
        fb = self._fb(buffers, hb, pool.page_size)
        if snapshots is not None:  # (where in the chunks, the snapshot rows' tensors)
            fb.snapshots, fb.snapshot_states = snapshots
        return fb

    def _hidden(self, hb: HostBatch, one_token_rows: bool, pool, snapshots: Optional[tuple] = None) -> torch.Tensor:
        """The target's hidden states at every row of hb: the captured verify graph when there
        is one for this step's shape, else the eager forward (which also writes the prefix
        cache's snapshots inside chunks)."""
        g = self.graphs
        rows_fit = one_token_rows or (g is not None and g.verifies_extends)  # V4: k + 1 tokens a request
        if g is not None and rows_fit and snapshots is None and g.fits(hb, verify=True):
            return g.hidden(hb, pool)
        return self.target.hidden(self._fb_with(self.target_buffers, hb, pool, snapshots), pool.all_states)

    def _mtp_forward(self, hb: HostBatch, one_token_rows: bool, pool, prev: torch.Tensor, rows=None, snapshots=None):
        """The MTP block over hb (prev: the hidden states its tokens follow): (logits, output
        hidden states) at `rows` (default: each request's last), captured when it can be."""
        g = self.graphs
        if g is not None and one_token_rows and snapshots is None and g.fits(hb):
            out = g.draft_hidden(hb, prev, pool)  # every row (one token each: each its request's last)
            out = out if rows is None else out[rows]
            return self.mtp.logits(out), out
        if g is not None and snapshots is None and g.takes_catch_up(hb):  # V4: 1..k+1 positions a request
            out = g.catch_up_hidden(hb, prev, pool)
            out = out[torch.as_tensor(hb.logits_indices, device=out.device) if rows is None else rows]
            return self.mtp.logits(out), out
        fb = self._fb_with(self.draft_buffers, hb, pool, snapshots)
        return self.mtp.forward(fb, pool.all_states, prev, rows)

    def step(self, batch: list[ScheduledSeq], pool) -> list[Union[SpecResult, Exception, None]]:
        """Results in batch order: a SpecResult (None for a prefill chunk that ends before the
        request's last token: it only computed), or the exception one request's row raised.
        A failed forward raises (it fails the batch)."""
        ps = pool.page_size
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
        hb, one_token_rows = self._batch(starts, news, [b.seq.pages for b in batch], toks, slots, ps)
        snaps = pool.snapshots
        in_chunk = None  # the prefix cache's snapshots inside this step's chunks, and where they go
        if snaps is not None and any(b.snapshots for b in batch):
            in_chunk = ([(i, pos, sid) for i, b in enumerate(batch) for pos, sid in b.snapshots], snaps.states)
        # V4's rings: what the drafts' positions will overwrite, to put back where they are rejected.
        spec_rows = [i for i in range(len(batch)) if ndraft[i]]
        rings = {n: t for n, t in pool.slot_states.items() if n != self.mtp_ring}
        ring_undo = (
            self.rollback(
                rings,
                [slots[i] for i in spec_rows for _ in range(ndraft[i])],
                [starts[i] + real[i] + j for i in spec_rows for j in range(ndraft[i])],
            )
            if rings and spec_rows
            else None
        )
        hidden = self._hidden(hb, one_token_rows, pool, in_chunk)  # [T, hidden] (V4: [T, hc, hidden] streams)
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
        hb2, one_token_rows2 = self._batch(
            cu_starts,
            cu_news,
            [batch[i].seq.pages for i in cu],
            cu_toks,
            [slots[i] for i in cu],
            ps,
        )
        cu_snaps = self._snapshots_in_catch_up(batch, cu, cu_starts, cu_news, snaps) if in_chunk else None
        last = torch.tensor(list(itertools.accumulate(cu_news)), device=dev) - 1  # each request's last row
        dlogits, dhidden = self._mtp_forward(
            hb2, one_token_rows2, pool, hidden[torch.tensor(cu_rows, device=dev)], last, cu_snaps
        )

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
            self._draft(batch, chain, dlogits, dhidden, pool, [results[i].tokens for i, _, _, _ in chain])
        return results

    def _masks(self):
        """The grammar masks' host buffer (structured outputs), made on first use."""
        if self._mask_filler is None:
            from dsv4_engine.structured.bitmask import MaskFiller

            self._mask_filler = MaskFiller(self.runner.cfg.vocab_size, self.runner.device, self.runner.eos_ids)
        return self._mask_filler

    def _processed(self, logits: torch.Tensor, items: list[tuple]) -> tuple:
        """What each row samples from, as the plain sampler makes it: `items[n]` = (seq, tokens,
        skip) for rows n .. n + len(tokens) - skip of `logits` (row j past the first: the state
        after tokens[:skip + j], tokens not yet in the request's output). The grammar's mask of
        that state first, then penalties, logit_bias and min_tokens counting those tokens as
        output. Returns (masked fp32 logits (the logprobs' distribution), processed logits,
        per item: tokens the grammar accepts, rows that have a state, {item: grammar error})."""
        from dsv4_engine.sampling import apply_token_mask, process_logits

        raw = logits.float()
        rows, row = [], 0
        for seq, toks, skip in items:
            rows.append((seq, toks, skip, row))
            row += len(toks) - skip + 1
        mask, accepted, filled = (
            self._masks().fill_chains(rows)
            if any(s.grammar is not None for s, _, _ in items)
            else (None, [len(t) for _, t, _ in items], [len(t) - k + 1 for _, t, k in items])
        )
        masked = apply_token_mask(raw, mask.rows, mask.bits) if mask is not None else raw
        errors = {n: mask.errors[r[3]] for n, r in enumerate(rows) if mask is not None and r[3] in mask.errors}
        if not any(s.params.processes_logits for s, _, _ in items):
            return masked, masked, accepted, filled, errors
        params, hist, pend = [], [], []
        for seq, toks, skip in items:
            for j in range(skip, len(toks) + 1):
                params.append(seq.params), hist.append(seq), pend.append(toks[:j])
        may_end = frozenset(mask.may_end) if mask is not None else frozenset()
        return (
            masked,
            process_logits(masked, params, hist, self.runner.eos_ids, may_end, pend),
            accepted,
            filled,
            errors,
        )

    def _snapshots_in_catch_up(self, batch, cu, cu_starts, cu_news, snaps) -> Optional[tuple]:
        """The prefix cache's snapshots inside this step's chunks (V4's torch path): the target
        wrote its part of each (the main model's rings as of that boundary); keep those whose
        positions all became valid, strictly inside the catch-up's span, and have the catch-up
        write the MTP block's ring into them (from its ring and the span, as the target did).
        The others go back: past a rejected draft, or on the span's end (after the step the row
        stands there, and `PrefixCache.snapshot_due` copies it whole). The drafts never cross a
        boundary (`_drafts_wanted`), so in practice only prefill chunks carry any."""
        for j, i in enumerate(cu):
            keep = []
            for pos, sid in batch[i].snapshots:
                if cu_starts[j] < pos < cu_starts[j] + cu_news[j]:
                    keep.append((pos, sid))
                else:
                    snaps.release(sid)
            batch[i].snapshots = keep
        kept = [(j, pos, sid) for j, i in enumerate(cu) for pos, sid in batch[i].snapshots]
        if not kept or not self.mtp_ring:
            return None
        from dsv4_engine.models.deepseek_v4 import DeepseekV4

        return kept, {DeepseekV4.SWA_KV: snaps.states[self.mtp_ring]}

    def _verify(self, batch, ends, ndraft, logits, results) -> None:
        """Greedy and sampled rows of the verifying requests, all argmaxes read back at once.
        Each position's logits are processed as plain decoding would have at that point: the
        grammar's mask after the drafts before it, penalties counting them (`_processed`)."""
        counts = [ndraft[i] + 1 for i in ends]
        offs = [sum(counts[:n]) for n in range(len(ends))]
        drafts = [self.drafts.get(batch[i].seq) for i in ends]
        drafted = [d.tokens[: ndraft[i]] if ndraft[i] else [] for d, i in zip(drafts, ends)]
        nan = torch.isnan(logits).any(dim=-1)  # before a mask's -inf hides a NaN
        masked, x, accepted, _, errors = self._processed(
            logits, [(batch[i].seq, drafted[n], 0) for n, i in enumerate(ends)]
        )
        nothing = torch.isneginf(x).all(dim=-1)
        host = torch.cat([x.argmax(dim=-1), nan.long(), nothing.long()]).tolist()
        R = x.shape[0]
        host_argmax, host_nan, host_nothing = host[:R], host[R : 2 * R], host[2 * R :]
        for n, i in enumerate(ends):
            seq = batch[i].seq
            # Drafts past the first the grammar refuses are never kept: verify those before it.
            # (Drafts are drawn under the very masks verified here, so only drafts replaced
            # from outside are ever refused; a sampled row never has one.)
            a = accepted[n]
            lo, hi = offs[n], offs[n] + a + 1
            try:
                if n in errors:
                    raise SamplingError(f"structured output: {errors[n]}")
                if any(host_nan[lo:hi]):
                    raise SamplingError("the model produced NaN logits for this request")
                p = seq.params
                if p.greedy:
                    toks = accept_greedy(drafted[n][:a], host_argmax[lo:hi])
                else:
                    probs = sampling_probs(
                        x[lo:hi], [p.temperature] * (a + 1), [p.top_k] * (a + 1), [p.top_p] * (a + 1)
                    )
                    if not torch.isfinite(probs).all() or (probs.sum(dim=-1) <= 0).any():
                        raise SamplingError("the sampling distribution is not finite (check temperature/top_p/top_k)")
                    q = drafts[n].probs[:a] if a else probs[:0]
                    toks = rejection_sample(probs, q, drafted[n][:a], seq.generator)
                if any(host_nothing[lo : lo + len(toks)]):
                    raise NoTokenAllowed()
                lps = None
                if p.logprobs is not None:
                    ls = torch.log_softmax(masked[lo : lo + len(toks)], dim=-1)
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
        if self.cache_boundary:
            # The prefix cache keeps a decode snapshot where the request stands exactly on a
            # boundary: a step's chunk (next_pos, its drafts) ends at the next one at the latest,
            # so every boundary is reached after acceptance and copied from the row there.
            want = min(want, (next_pos // self.cache_boundary + 1) * self.cache_boundary - next_pos - 1)
        if want <= 0:
            return 0
        # The chain's k-1 decode steps write positions next_pos .. next_pos + want - 2.
        need = -(-(next_pos + want - 1) // pool.page_size) - len(seq.pages)
        if need > 0:
            pages = pool.allocator.allocate_beside(seq.pages, need)  # --dp-size N: on its rank
            if pages is None:
                have = len(seq.pages) * pool.page_size - next_pos + 1
                return max(0, min(want, have))
            seq.pages.extend(pages)
        return want

    def _pick(
        self, logits: torch.Tensor, seqs, pending: list[list[int]]
    ) -> tuple[list[Optional[int]], list[Optional[torch.Tensor]]]:
        """A draft token per row, drawn from the drafter's logits processed as the target's will
        be at that position (`pending[n]`: the request's tokens after its output so far: the
        grammar's mask after them, penalties counting them): the argmax for greedy requests, a
        draw from that distribution (kept, for verification) for sampled ones. None where the
        row cannot draft (its grammar is complete or refuses what came before, or nothing is allowed)."""
        _, x, _, filled, errors = self._processed(logits, [(s, t, len(t)) for s, t in zip(seqs, pending)])
        host = torch.cat([x.argmax(dim=-1), torch.isneginf(x).all(dim=-1).long()]).tolist()
        B = len(seqs)
        toks: list[Optional[int]] = [
            t if filled[n] and not host[B + n] and n not in errors else None for n, t in enumerate(host[:B])
        ]
        probs: list[Optional[torch.Tensor]] = [None] * B
        sampled = [n for n, s in enumerate(seqs) if not s.params.greedy and toks[n] is not None]
        if sampled:
            ps = [seqs[n].params for n in sampled]
            q = sampling_probs(x[sampled], [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps])
            q = torch.nan_to_num(q, nan=0.0)
            for j, n in enumerate(sampled):
                row = q[j]
                if not (row.sum() > 0):  # e.g. NaN drafter logits: uniform over what is allowed
                    allowed = ~torch.isneginf(x[n])
                    row = allowed.float() / allowed.sum()
                    q[j] = row
                toks[n] = int(torch.multinomial(row.double(), 1, generator=seqs[n].generator))
                probs[n] = q[j]
        return toks, probs

    def _draft(self, batch, chain, dlogits, dhidden, pool, news: list[list[int]]) -> None:
        """`news[n]`: the tokens chain entry n's request emits this step (not in its output yet).
        A request stops drafting where `_pick` has no token for it (its grammar ends)."""
        dev = self.runner.device
        seqs = [batch[i].seq for i, _, _, _ in chain]
        rows = torch.tensor([j for _, j, _, _ in chain], device=dev)
        toks, probs = self._pick(dlogits[rows], seqs, [list(t) for t in news])
        drafts = [Draft([] if t is None else [t], None if pr is None else [pr]) for t, pr in zip(toks, probs)]
        hid = dhidden[rows]
        live = list(range(len(chain)))  # chain entries still drafting
        # The chain writes the block's ring past the request's valid positions; V4's ring wraps,
        # so what those writes overwrite is put back once the drafts are made.
        ring = {self.mtp_ring: pool.slot_states[self.mtp_ring]} if self.mtp_ring else {}
        undo = (
            self.rollback(
                ring,
                [seqs[n].slot for n in live for s in range(1, chain[n][2])],
                [chain[n][3] + s - 1 for n in live for s in range(1, chain[n][2])],
            )
            if ring
            else None
        )
        step = 1
        while True:
            live = [n for n in live if chain[n][2] > step and len(drafts[n].tokens) == step]
            if not live:
                break
            pos = [chain[n][3] + step - 1 for n in live]
            hb = host_batch(
                pos,
                [1] * len(live),
                [seqs[n].pages for n in live],
                [[drafts[n].tokens[-1]] for n in live],
                [seqs[n].slot for n in live],
                pool.page_size,
            )
            sel = torch.tensor(live, device=dev)
            lg, h = self._mtp_forward(hb, True, pool, hid[sel])
            t, pr = self._pick(lg, [seqs[n] for n in live], [news[n] + drafts[n].tokens for n in live])
            new_hid = hid.clone()
            new_hid[sel] = h
            hid = new_hid
            for m, n in enumerate(live):
                if t[m] is None:
                    continue
                drafts[n].tokens.append(t[m])
                if pr[m] is not None:
                    drafts[n].probs.append(pr[m])
            step += 1
        if undo is not None:
            undo.restore()
        for n, s in enumerate(seqs):
            d = drafts[n]
            self.drafts[s] = Draft(d.tokens, torch.stack(d.probs) if d.probs else None)
