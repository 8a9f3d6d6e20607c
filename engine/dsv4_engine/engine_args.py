"""What an engine is built from (`Engine(EngineArgs(...))`).

Plain data, no torch: `dsv4_serve.server.ServerArgs` extends it in the HTTP process of
`dsv4 serve`, which never builds an engine (`dsv4_engine.engine` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineArgs:
    model: str
    role: str = "mono"
    dtype: Optional[str] = None  # None: bfloat16 on CUDA, float32 on CPU (model_runner.default_dtype)
    served_model_name: str = "dsv4"
    kv_pages: Optional[int] = None
    kv_memory_gb: float = 1.0
    page_size: Optional[int] = None  # None: kv_cache.default_page_size (16, or a longer compression window)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: Optional[int] = None
    kernel_backend: Optional[str] = None
    device: Optional[str] = None
    seed: int = 0
    enable_prefix_cache: bool = True  # `--disable-prefix-cache` turns it off
    # Models with slot states (V4): slot-row snapshots the prefix cache keeps (None: 4 x max_num_seqs)
    prefix_cache_snapshots: Optional[int] = None
    # ... and tokens between snapshots written inside a prefill chunk (None: 8 boundaries; 0: none)
    prefix_cache_snapshot_interval: Optional[int] = None
    cuda_graph_max_bs: int = 0  # decode batches up to this many requests replay CUDA graphs (0: off)
    tp_size: int = 1  # ranks this engine spans (dsv4_engine.parallel); this process is rank 0
    # Speculative decoding (dsv4_engine.spec_decode): None = off; "mtp" (or an alias) drafts
    # speculative_num_steps tokens a step with the checkpoint's MTP layer.
    speculative_algorithm: Optional[str] = None
    speculative_num_steps: int = 1
