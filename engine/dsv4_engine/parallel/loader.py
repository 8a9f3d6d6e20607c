"""Read only this rank's part of a checkpoint: tensors it does not own (other ranks' experts) are
never read; a split tensor is read through safetensors' slice and only the slice is kept (at
most one whole split tensor is in memory at a time, never the checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

from dsv4_engine.parallel.plan import Slicer
from dsv4_engine.quant import checkpoint_scheme, pair_quantized
from dsv4_engine.weights import _MTP


def checkpoint_files(d: Path) -> list[str]:
    """The safetensors files of a checkpoint folder (the index's shards, or every file)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    return files


def load_shard(model_dir: str | Path, slicer: Slicer, keep: Optional[Callable[[str], bool]] = None) -> dict:
    """This rank's tensors of the checkpoint; `keep` picks which checkpoint names are read at all
    (default: every tensor but the MTP layers', which speculation reads on its own)."""
    d = Path(model_dir)
    if keep is None:

        def keep(key: str) -> bool:
            return not _MTP.search(key)

    weights: dict[str, torch.Tensor] = {}
    local_name: dict[str, str] = {}  # checkpoint name -> this rank's name (experts renumbered)
    for name in checkpoint_files(d):
        with safe_open(str(d / name), framework="pt") as f:
            for key in f.keys():
                if not keep(key):
                    continue
                part = f.get_slice(key)
                got = slicer(key, tuple(part.get_shape()))
                if got is None:
                    continue
                local, index = got
                # A slice may be a view of the whole tensor's buffer: copy it out so that only
                # this rank's part stays resident.
                weights[key] = part[index].contiguous().clone() if index else f.get_tensor(key)
                local_name[key] = local
    # Quantized weights pair with their scales as at tp 1 (a split weight's scales were split with
    # it), under the checkpoint's names so that a refusal names the tensor as the files do.
    paired, _ = pair_quantized(weights, checkpoint_scheme(d))
    return {local_name[k]: v for k, v in paired.items()}
