"""Model registry: `config.json`'s `model_type` -> (config class, model class).

A model class takes (cfg, weights, ops, dtype, device), runs `forward(batch, states)` over the
pool's state tensors, and declares its per-request state with `state_specs(cfg)`. Model code is
imported only when a checkpoint of that type is loaded.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelEntry:
    model_type: str
    config: str  # "module:Class"
    model: str

    @staticmethod
    def _load(ref: str) -> Any:
        mod, _, name = ref.partition(":")
        return getattr(importlib.import_module(mod), name)

    def config_class(self) -> Any:
        return self._load(self.config)

    def model_class(self) -> Any:
        return self._load(self.model)


_V3 = ("dsv4_engine.config:ModelConfig", "dsv4_engine.models.deepseek_v3:DeepseekV3")
REGISTRY: dict[str, ModelEntry] = {
    "deepseek_v3": ModelEntry("deepseek_v3", *_V3),
    "deepseek_v2": ModelEntry("deepseek_v2", *_V3),  # same architecture family, same code path
    "deepseek_v4": ModelEntry(
        "deepseek_v4",
        "dsv4_engine.models.deepseek_v4_config:DeepseekV4Config",
        "dsv4_engine.models.deepseek_v4:DeepseekV4",
    ),
}


class UnsupportedModel(ValueError):
    pass


def model_type_of(model_dir: str | Path) -> str:
    path = Path(model_dir) / "config.json"
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModel(f"cannot read {path}: {e}") from None
    if not isinstance(d, dict):
        raise UnsupportedModel(f"{path} is not a JSON object")
    return str(d.get("model_type") or "")


def lookup(model_type: str) -> ModelEntry:
    entry = REGISTRY.get(model_type)
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise UnsupportedModel(f"unsupported model_type {model_type!r}; this engine serves: {known}")
    return entry


def entry_for_dir(model_dir: str | Path) -> ModelEntry:
    return lookup(model_type_of(model_dir))
