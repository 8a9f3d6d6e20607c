"""Whether a checkpoint can fit the device at all, judged before any weight is read or rank
spawned (`dsv4_engine.kv_sizing.weights_refusal` on the engine's arguments): the checkpoint's
config (state sizes, vocabulary) and file sizes, rank 0's device memory now."""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_engine import kv_sizing
from dsv4_engine.cuda_graphs import resolve_graph_max_bs
from dsv4_engine.kv_cache import default_page_size
from dsv4_engine.model_runner import DTYPES, default_device, default_dtype
from dsv4_engine.kv_quant import with_kv_cache_dtype
from dsv4_engine.models import entry_for_dir
from dsv4_engine.parallel.group import rank_device


def memory_refusal(args) -> Optional[str]:
    """`weights_refusal` for engine arguments, before any weight is read or rank spawned: the
    checkpoint's config (state sizes, vocabulary) and file sizes, rank 0's device memory now."""
    device = torch.device(rank_device(args.device, 0) if args.tp_size > 1 else (args.device or default_device()))
    memory = kv_sizing.device_memory(device)
    if memory is None or args.kv_pages:
        return None
    entry = entry_for_dir(args.model)
    cfg = entry.config_class().from_dir(args.model)
    specs = with_kv_cache_dtype(entry.model_class().state_specs(cfg), args.kv_cache_dtype)
    dtype = DTYPES[args.dtype or default_dtype(device)]
    page_size = args.page_size or default_page_size(specs)
    min_kv = args.max_num_seqs * kv_sizing.slot_row_nbytes(specs, dtype) + kv_sizing.page_nbytes(
        specs, page_size, dtype
    )
    # Graphs are captured only with the Triton backend (the CUDA default): reserve for them then.
    graphs = resolve_graph_max_bs(args.cuda_graph_max_bs, args.max_num_seqs) if args.kernel_backend != "torch" else 0
    return kv_sizing.weights_refusal(
        kv_sizing.checkpoint_nbytes(args.model) // args.tp_size,
        memory,
        args.kv_memory_fraction,
        args.kv_memory_gb,
        min_kv,
        kv_sizing.graph_reserve_bytes(graphs, cfg.vocab_size, args.speculative_algorithm is not None)
        if args.kv_memory_gb is None
        else 0,
        args.tp_size,
    )
