"""Read a checkpoint's safetensors (one file or an index of shards) into a name -> tensor dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


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
        weights.update(load_file(str(d / name)))
    return weights
