"""The checkpoint a benchmark runs on: the one given, or one made from a preset (once, cached
under bench/results/models), and the sizes that memory accounting needs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from bench import RESULTS
from typing import Optional


def ensure_model(model: Optional[Path], preset: str, seed: int) -> Path:
    if model is not None:
        if not (model / "config.json").is_file():
            sys.exit(f"error: no checkpoint at {model} (expected {model / 'config.json'})")
        return model
    out = RESULTS / "models" / f"{preset}-seed{seed}"
    if not (out / "config.json").is_file():
        from dsv4_engine.checkpoint import init_checkpoint

        init_checkpoint(out, preset=preset, seed=seed)
    return out


def model_facts(
    model: Path, kv_pages: int, page_size: Optional[int] = None, dtype: str = "float32", max_num_seqs: int = 0
) -> dict:
    """Sizes from the states the model declares (DeepSeek-V3: one latent per token; V4: paged
    compressed states per token plus fixed slot rows per running request)."""
    import torch

    from dsv4_engine.kv_cache import default_page_size, page_nbytes, slot_row_nbytes
    from dsv4_engine.models import entry_for_dir

    cfg = json.loads((model / "config.json").read_text())
    entry = entry_for_dir(model)
    specs = entry.model_class().state_specs(entry.config_class().from_dir(model))
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    page_size = page_size or default_page_size(specs)  # as the engine picks it
    page_bytes = page_nbytes(specs, page_size, tdt)
    slot_bytes = slot_row_nbytes(specs, tdt)
    return {
        "dir": str(model),
        "model_type": entry.model_type,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "kv_lora_rank": cfg.get("kv_lora_rank"),
        "qk_rope_head_dim": cfg.get("qk_rope_head_dim"),
        "n_routed_experts": cfg.get("n_routed_experts"),
        # the checkpoint is fp32; a bf16 engine holds half of it
        "weights_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))
        // (2 if dtype == "bfloat16" else 1),
        "kv_page_size": page_size,
        "kv_page_bytes": page_bytes,
        "kv_slot_row_bytes": slot_bytes,
        "kv_pool_bytes": page_bytes * kv_pages + slot_bytes * max_num_seqs,
        # what the pool pays per token at this page size (a compressed state in pages shorter
        # than its window pays for more entries than it keeps)
        "state_bytes_per_token": {s.name: s.page_nbytes(page_size, tdt) / page_size for s in specs if s.paged},
        "state_bytes_per_request": {s.name: s.request_nbytes(tdt) for s in specs if not s.paged},
    }
