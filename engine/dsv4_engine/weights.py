"""Read a checkpoint's safetensors (one file or an index of shards) into a name -> tensor dict.

Multi-token-prediction layers stored under `mtp.` (DeepSeek-V4's release) are not read: the
engine does not run them, and they are gigabytes. Quantized weights (config.json's
quantization_config: fp8 block-scaled, fp4 experts) come back as `QuantWeight`s, each paired
with its scales; an unsupported or undeclared quantization raises UnsupportedQuantization.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dsv4_engine.quant import checkpoint_scheme, pair_quantized
from dsv4_engine.quant.scheme import MTP as _MTP

log = logging.getLogger("dsv4.engine")


def load_weights(model_dir: str | Path) -> dict[str, Any]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    scheme = checkpoint_scheme(d)
    weights = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            for key in f.keys():
                if not _MTP.search(key):
                    weights[key] = f.get_tensor(key)
    paired, report = pair_quantized(weights, scheme)
    log.info("checkpoint %s: %s; %s", d.name, scheme.describe() if scheme else "not quantized", report.describe())
    return paired
