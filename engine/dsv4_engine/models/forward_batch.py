"""One step's batch as the model reads it: `ForwardBatch`, what the engine builds for every model
(V3 and V4), and `V4Batch`, the smaller one V4's tests build by hand; `request_spans` reads
where each request's tokens sit in either."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ForwardBatch:
    """One step's tokens, flattened over requests in order."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset where its KV is written
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in cache after this step
    extend_lens: torch.Tensor  # [B] int32, new tokens of each request in this step
    logits_indices: torch.Tensor  # [B] int64, the row of each request's last new token
    all_decode: bool  # every request has exactly one new token
    # For models with slot states (DeepSeek-V4); V3 reads neither.
    slot_ids: Optional[torch.Tensor] = None  # [B] int64, each request's row in the slot states
    page_size: Optional[int] = None  # tokens per page
    # Prefix-cache snapshots to write inside this step's chunks: (request, position, snapshot
    # row) into snapshot_states (models with slot states that support it: V4's torch path).
    snapshots: Optional[list[tuple[int, int, int]]] = None
    snapshot_states: Optional[dict[str, torch.Tensor]] = None
    # The same lengths as host ints, known when the batch was built: ops that size launches or
    # loop over requests read these instead of reading the device (a host sync).
    seq_lens_host: Optional[list[int]] = None
    extend_lens_host: Optional[list[int]] = None

    @classmethod
    def of_tensors(
        cls,
        t: dict[str, Optional[torch.Tensor]],
        page_size: int,
        all_decode: bool,
        slots: bool = True,
        seq_lens_host: Optional[list[int]] = None,
        extend_lens_host: Optional[list[int]] = None,
    ) -> "ForwardBatch":
        """The batch over a step's device tensors by name: what `BatchBuffers.upload` returns,
        or a decode graph's static inputs. `slots`: pass the slot rows on (models with slot
        states; a graph's inputs carry the tensor either way)."""
        return cls(
            input_ids=t["input_ids"],
            positions=t["positions"],
            slot_mapping=t["slot_mapping"],
            block_table=t["block_table"],
            seq_lens=t["seq_lens"],
            extend_lens=t["extend_lens"],
            logits_indices=t["logits_indices"],
            all_decode=all_decode,
            slot_ids=t.get("slot_ids") if slots else None,
            page_size=page_size,
            seq_lens_host=seq_lens_host,
            extend_lens_host=extend_lens_host,
        )


@dataclass
class V4Batch:
    """One step's tokens, flattened over requests in order (varlen): the fields of ForwardBatch
    that DeepSeek-V4 reads, with `slot_ids` and `page_size` required (V4 reads nothing else, so
    the engine's ForwardBatch, which has them all, serves it as is)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64; a request's new tokens are consecutive positions
    extend_lens: torch.Tensor  # [B] new tokens of each request
    logits_indices: torch.Tensor  # [B] row of each request's last new token
    block_table: torch.Tensor  # [B, max_pages] page ids of the paged states
    slot_ids: torch.Tensor  # [B] row of each request in the slot states
    page_size: int  # tokens per page
    # The same lengths as host ints (the engine's batch has them): without them the step reads
    # the device once to learn them, which on a GPU is a host sync.
    seq_lens_host: Optional[list[int]] = None
    extend_lens_host: Optional[list[int]] = None
    # As in ForwardBatch: a step of decode tokens only; prefix-cache snapshots inside its chunks.
    all_decode: bool = False
    snapshots: Optional[list[tuple[int, int, int]]] = None
    snapshot_states: Optional[dict[str, torch.Tensor]] = None


def request_spans(fb: V4Batch | ForwardBatch) -> list[tuple[int, int, int]]:
    """(first row, new tokens, first position) of each request, from the batch's host lengths
    when it has them (a request's new tokens start where its cache ends)."""
    lens, seq_lens = fb.extend_lens_host, fb.seq_lens_host
    if lens is not None and seq_lens is not None:
        starts = [int(s) - int(n) for s, n in zip(seq_lens, lens)]
    else:  # a batch built by hand (tests): read the device once
        lens, pos = [int(n) for n in fb.extend_lens.tolist()], fb.positions.tolist()
        rows = [0, *itertools.accumulate(lens)][:-1]
        starts = [int(pos[r]) if n else 0 for r, n in zip(rows, lens)]
    spans, row = [], 0
    for n, start in zip(lens, starts):
        spans.append((row, int(n), start if n else 0))
        row += int(n)
    return spans
