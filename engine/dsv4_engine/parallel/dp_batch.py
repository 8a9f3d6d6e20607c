"""One step's batch under data-parallel attention, cut into each rank's share. Pure functions.

Rank 0 schedules every request; a request's pages all live on one rank (`dp_pages`), so the
rank of request i is the rank of its first page. Rank r's share holds its requests' tokens in
batch order, their page ids, KV slots and slot rows made local to its own pool, and each request's logits
row renumbered inside the share. `merge_logits` puts the ranks' logits back in batch order.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_engine.models.forward_batch import ForwardBatch


def request_ranks(fb: ForwardBatch, pages_per_rank: int) -> list[int]:
    """The rank of each request of the batch (the rank its pages live on)."""
    return (fb.block_table[:, 0].to(torch.int64).cpu() // pages_per_rank).tolist()


def split_batch(
    fb: ForwardBatch, ranks: list[int], dp_size: int, pages_per_rank: int, page_size: int, slots_per_rank: int = 0
) -> list[Optional[ForwardBatch]]:
    """Each rank's share of the batch (None: the rank has no request this step), on the CPU.
    `slots_per_rank`: slot rows of each rank's pool (V4), whose global ids the shares make local."""
    ext = fb.extend_lens.to(torch.int64).cpu().tolist()
    starts = [0]
    for n in ext[:-1]:
        starts.append(starts[-1] + n)
    ids, pos, slots = fb.input_ids.cpu(), fb.positions.cpu(), fb.slot_mapping.cpu()
    table, seq_lens, logits_at = fb.block_table.cpu(), fb.seq_lens.cpu(), fb.logits_indices.cpu()
    slot_ids = None if fb.slot_ids is None else fb.slot_ids.cpu()  # V4's slot rows: rank r's from r * slots_per_rank
    out: list[Optional[ForwardBatch]] = []
    for r in range(dp_size):
        reqs = [i for i, ri in enumerate(ranks) if ri == r]
        if not reqs:
            out.append(None)
            continue
        rows = torch.cat([torch.arange(starts[i], starts[i] + ext[i]) for i in reqs])
        base = r * pages_per_rank
        local_table = table[reqs].to(torch.int64) - base
        local_table[(local_table < 0) | (local_table >= pages_per_rank)] = 0  # padding past a request's pages
        first = 0
        local_logits = []
        for i in reqs:
            local_logits.append(first + int(logits_at[i]) - starts[i])
            first += ext[i]
        sub_ext = [ext[i] for i in reqs]
        sub_lens = seq_lens[reqs]
        out.append(
            ForwardBatch(
                input_ids=ids[rows],
                positions=pos[rows],
                slot_mapping=slots[rows] - base * page_size,
                block_table=local_table.to(torch.int32),
                seq_lens=sub_lens,
                extend_lens=torch.tensor(sub_ext, dtype=torch.int32),
                logits_indices=torch.tensor(local_logits, dtype=torch.int64),
                all_decode=all(n == 1 for n in sub_ext),
                page_size=fb.page_size,
                seq_lens_host=sub_lens.tolist(),
                extend_lens_host=sub_ext,
                slot_ids=None if slot_ids is None else slot_ids[reqs] - r * slots_per_rank,
            )
        )
    return out


def merge_logits(parts: list[Optional[torch.Tensor]], ranks: list[int]) -> torch.Tensor:
    """[B, vocab] in batch order from each rank's logits of its own requests (in order)."""
    taken = [0] * len(parts)
    rows = []
    for r in ranks:
        rows.append(parts[r][taken[r]])
        taken[r] += 1
    return torch.stack(rows)
