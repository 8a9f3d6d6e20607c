"""Read a checkpoint's safetensors (one file or an index of shards) into a name -> tensor dict.

Multi-token-prediction layers stored under `mtp.` (DeepSeek-V4's release) are not read: the
engine does not run them, and they are gigabytes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

_MTP = re.compile(r"(^|\.)mtp\.")


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            for key in f.keys():
                if not _MTP.search(key):
                    weights[key] = f.get_tensor(key)
    return weights
