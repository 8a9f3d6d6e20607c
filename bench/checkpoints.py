"""The checkpoint a benchmark runs on: the one given, or one made from a preset (once, cached
under bench/results/models), and the sizes that memory accounting needs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parent / "results"


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


def model_facts(model: Path, kv_pages: int, page_size: int = 16, dtype: str = "float32") -> dict:
    cfg = json.loads((model / "config.json").read_text())
    kv_dim = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    page_bytes = cfg["num_hidden_layers"] * page_size * kv_dim * (2 if dtype == "bfloat16" else 4)
    return {
        "dir": str(model), "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"], "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"], "n_routed_experts": cfg.get("n_routed_experts"),
        # the checkpoint is fp32; a bf16 engine holds half of it
        "weights_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")) // (2 if dtype == "bfloat16" else 1),
        "kv_page_bytes": page_bytes, "kv_pool_bytes": page_bytes * kv_pages,
    }
