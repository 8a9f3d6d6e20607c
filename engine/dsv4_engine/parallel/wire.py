"""One step's batch as two int64 tensors: a fixed-size header (what follows and how big) and one
flat payload with every index tensor of the ForwardBatch. Two broadcasts per step, no pickling.
Pure functions: rank 0 packs, every other rank unpacks into the same ForwardBatch."""

from __future__ import annotations

import torch

from dsv4_engine.models.forward_batch import ForwardBatch

HEADER_LEN = 8
# Header slots.
OP, TOKENS, REQS, MAX_PAGES, ALL_DECODE, HAS_SLOTS, PAGE_SIZE, PAYLOAD = range(HEADER_LEN)
# Operations. OP_CAPTURE: capture the decode graphs now (REQS: the largest bucket); OP_GRAPH: a
# decode step replayed from them, its host arrays as a batch payload (REQS rows, MAX_PAGES wide).
# OP_SNAPSHOT: a prefix-cache snapshot copy between a slot row and a snapshot row (V4).
# OP_PD_POOLS: PD decode, once at start-up: every rank registers its pool with its own KV transport
# and the ranks swap descriptors (an all-gather on the control group; `pd.rank_pools`).
OP_FORWARD, OP_STOP, OP_PD_POOLS, OP_CAPTURE, OP_GRAPH, OP_SNAPSHOT = 1, 2, 3, 4, 5, 6
SNAPSHOT_COPIES = ("save", "restore")  # payload [kind index, snapshot, slot row]
# Speculative decoding (dsv4_engine.parallel.spec): OP_SPEC_TARGET, the target's forward over a
# step's tokens (a batch payload); OP_SPEC_MTP, one forward of the MTP block (a batch payload, then
# its input hidden states: `hidden_meta` on the control group, the tensor on the compute group);
# OP_RING_SAVE / OP_RING_RESTORE, V4's ring rollback around them (`ring_message`).
OP_SPEC_TARGET, OP_SPEC_MTP, OP_RING_SAVE, OP_RING_RESTORE = 7, 8, 9, 10
# The speculator's captured steps (spec_decode.graphs.SpecGraphs), replayed by every rank: a step's
# host arrays (`pack_host`), then, for the draft and catch-up sets, the hidden states they read
# (as OP_SPEC_MTP sends them). Rank 0 sends OP_CAPTURE to a speculating group to capture these.
OP_SPEC_VERIFY_GRAPH, OP_SPEC_DRAFT_GRAPH, OP_SPEC_CATCH_UP_GRAPH = 11, 12, 13
# OP_EPLB: a rebalance of the routed experts between two steps (dsv4_engine.parallel.eplb_apply:
# placement_message): every rank hosts its slots of the new placement before the next forward.
OP_EPLB = 14
# OP_DP_FORWARD: a step under data-parallel attention, every rank's share of the batch in one
# payload (dsv4_engine.parallel.dp_attention.pack_shares).
OP_DP_FORWARD = 15
# Speculative decoding under data-parallel attention (dsv4_engine.parallel.dp_spec): the target's
# forward / one MTP forward, every rank's share in one payload as OP_DP_FORWARD's (the MTP's input
# hidden states follow, rank-major); each rank's output rows are gathered back to rank 0.
OP_DP_SPEC_TARGET, OP_DP_SPEC_MTP = 21, 22
# OP_DP_GRAPH: a captured decode step under data-parallel attention, the shares as OP_DP_FORWARD's
# (dsv4_engine.parallel.dp_graphs): every rank replays the bucket of the largest share.
OP_DP_GRAPH = 23
# OP_DP_SPEC_VERIFY_GRAPH / OP_DP_SPEC_DRAFT_GRAPH: the speculator's captured steps under
# data-parallel attention, shares as OP_DP_FORWARD's (the draft's input rows follow, rank-major:
# dsv4_engine.parallel.dp_spec_graphs).
OP_DP_SPEC_VERIFY_GRAPH, OP_DP_SPEC_DRAFT_GRAPH = 24, 25
HIDDEN_DTYPES = ("float32", "bfloat16", "float16")
HIDDEN_META_LEN = 6  # [dtype index, ndim, dims padded with 0]


def op_header(op: int) -> torch.Tensor:
    """The header of an operation that carries no payload."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[OP] = op
    return h


def snapshot_message(kind: str, snap: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) telling the other ranks to repeat rank 0's snapshot copy: "save" (slot
    row into snapshot) or "restore" (snapshot into slot row)."""
    payload = torch.tensor([SNAPSHOT_COPIES.index(kind), snap, row], dtype=torch.int64)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[OP], header[PAYLOAD] = OP_SNAPSHOT, payload.numel()
    return header, payload


def unpack_snapshot(payload: torch.Tensor) -> tuple[str, int, int]:
    kind, snap, row = payload.tolist()
    return SNAPSHOT_COPIES[kind], snap, row


def stop_header() -> torch.Tensor:
    return op_header(OP_STOP)


def ring_message(op: int, names: list[int], ints: "list[int] | None") -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a ring rollback: the rings (indices into the sorted slot-state names)
    and, for OP_RING_SAVE, rows then positions; for OP_RING_RESTORE, each saved entry's first
    rejected position, or None: put back every entry."""
    body = [] if ints is None else list(ints)
    payload = torch.tensor([len(names), *names, int(ints is not None), *body], dtype=torch.int64)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[OP], header[PAYLOAD] = op, payload.numel()
    return header, payload


def unpack_ring(payload: torch.Tensor) -> tuple[list[int], "list[int] | None"]:
    v = payload.tolist()
    n = v[0]
    names, has, body = v[1 : 1 + n], v[1 + n], v[2 + n :]
    return names, (body if has else None)


def hidden_meta(x: torch.Tensor) -> torch.Tensor:
    """What the other ranks allocate to receive x: its dtype and shape (at most 4 dims)."""
    if x.dim() > HIDDEN_META_LEN - 2:
        raise ValueError(f"hidden states of {x.dim()} dims do not fit the wire's {HIDDEN_META_LEN - 2}")
    dims = list(x.shape) + [0] * (HIDDEN_META_LEN - 2 - x.dim())
    return torch.tensor([HIDDEN_DTYPES.index(str(x.dtype).removeprefix("torch.")), x.dim(), *dims], dtype=torch.int64)


def empty_hidden(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    m = meta.tolist()
    return torch.empty(m[2 : 2 + m[1]], dtype=getattr(torch, HIDDEN_DTYPES[m[0]]), device=device)


def pack(fb: ForwardBatch, op: int = OP_FORWARD) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) on the CPU for a ForwardBatch."""
    T, B = fb.input_ids.numel(), fb.seq_lens.numel()
    P = fb.block_table.shape[1]
    parts = [
        fb.input_ids,
        fb.positions,
        fb.slot_mapping,
        fb.block_table.reshape(-1),
        fb.seq_lens,
        fb.extend_lens,
        fb.logits_indices,
    ]
    if fb.slot_ids is not None:
        parts.append(fb.slot_ids)
    # One concatenation where the batch lives, then one copy to the CPU (one sync on CUDA).
    payload = torch.cat([p.to(torch.int64) for p in parts]).cpu()
    header = torch.tensor(
        [
            op,
            T,
            B,
            P,
            int(fb.all_decode),
            int(fb.slot_ids is not None),
            -1 if fb.page_size is None else fb.page_size,
            payload.numel(),
        ],
        dtype=torch.int64,
    )
    return header, payload


def payload_len(header: torch.Tensor) -> int:
    return int(header[PAYLOAD])


def unpack(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    h = header.tolist()
    T, B, P = h[TOKENS], h[REQS], h[MAX_PAGES]
    sizes = [T, T, T, B * P, B, B, B] + ([B] if h[HAS_SLOTS] else [])
    if sum(sizes) != payload.numel():
        raise ValueError(f"payload of {payload.numel()} ints does not match its header {h}")
    host = torch.split(payload, sizes)
    p = [t.to(device) for t in host]
    i32 = torch.int32
    return ForwardBatch(
        seq_lens_host=host[4].tolist(),
        extend_lens_host=host[5].tolist(),
        input_ids=p[0],
        positions=p[1],
        slot_mapping=p[2],
        block_table=p[3].view(B, P).to(i32),
        seq_lens=p[4].to(i32),
        extend_lens=p[5].to(i32),
        logits_indices=p[6],
        all_decode=bool(h[ALL_DECODE]),
        slot_ids=p[7] if h[HAS_SLOTS] else None,
        page_size=None if h[PAGE_SIZE] < 0 else h[PAGE_SIZE],
    )


def capture_header(max_bs: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[OP], h[REQS] = OP_CAPTURE, max_bs
    return h


def pack_host(hb, op: int = OP_GRAPH) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a captured step from its host arrays (a HostBatch): the same layout
    as `pack`, built without touching the device (no per-step sync for the header). `op`: a
    plain decode step (OP_GRAPH) or one of the speculator's (OP_SPEC_*_GRAPH)."""
    import numpy as np

    B, P = hb.block_table.shape
    parts = [
        hb.input_ids,
        hb.positions,
        hb.slot_mapping,
        hb.block_table.reshape(-1),
        hb.seq_lens,
        hb.extend_lens,
        hb.logits_indices,
    ] + ([] if hb.slot_ids is None else [hb.slot_ids])
    payload = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    header = torch.tensor(
        [op, hb.input_ids.shape[0], B, P, 1, int(hb.slot_ids is not None), -1, payload.numel()], dtype=torch.int64
    )
    return header, payload


def unpack_host(header: torch.Tensor, payload: torch.Tensor):
    """The HostBatch that `pack_host` sent."""
    from dsv4_engine.batch_buffers import HostBatch

    h = header.tolist()
    T, B, P = h[TOKENS], h[REQS], h[MAX_PAGES]
    sizes = [T, T, T, B * P, B, B, B] + ([B] if h[HAS_SLOTS] else [])
    if sum(sizes) != payload.numel():
        raise ValueError(f"payload of {payload.numel()} ints does not match its header {h}")
    a = [t.numpy() for t in torch.split(payload, sizes)]
    return HostBatch(
        input_ids=a[0],
        positions=a[1],
        slot_mapping=a[2],
        block_table=a[3].reshape(B, P).astype("int32"),
        seq_lens=a[4].astype("int32"),
        extend_lens=a[5].astype("int32"),
        logits_indices=a[6],
        slot_ids=a[7] if h[HAS_SLOTS] else None,
    )
