"""Which quantization a checkpoint declares, and whether this engine can load it.

Read from config.json before any weight is touched, so a bad checkpoint fails at startup with one
line. Accepted: `quantization_config.quant_method: fp8` with `weight_block_size: [128, 128]`,
`fmt: e4m3`, dynamic activations, scales stored as fp32 ("float", DeepSeek-V3) or as powers of two
("ue8m0", DeepSeek-V4), and routed experts in fp8 or fp4 (`expert_dtype`, which V4 may also
carry at the top level of its config, as transformers folds it in).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BLOCK = (128, 128)
FP4_GROUP = 32  # fp4 experts: one power-of-two scale per 32 values of a row


class UnsupportedQuantization(ValueError):
    """A checkpoint whose quantization this engine cannot load correctly (one-line message)."""


@dataclass(frozen=True)
class QuantScheme:
    method: str = "fp8"
    block: tuple[int, int] = BLOCK
    scale_fmt: str = "float"  # "float" (fp32 scales) or "ue8m0" (power-of-two scales)
    expert_dtype: str = "fp8"  # "fp8" or "fp4" (routed experts only)

    def describe(self) -> str:
        s = f"fp8 e4m3 block {list(self.block)} ({self.scale_fmt} scales)"
        return s + (", fp4 e2m1 routed experts" if self.expert_dtype == "fp4" else "")


def scheme_from_config(config: dict) -> Optional[QuantScheme]:
    """The scheme a config.json dict declares (None: not quantized); raises UnsupportedQuantization."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise UnsupportedQuantization(f"quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantization(
            f"unsupported quantization_config.quant_method {method!r}: this engine loads only 'fp8' "
            f"(block-scaled e4m3, weight_block_size [128, 128], optionally with fp4 routed experts)"
        )
    block = q.get("weight_block_size")
    if block is None or list(block) != list(BLOCK):
        raise UnsupportedQuantization(
            f"unsupported fp8 weight_block_size {block!r}: this engine loads [128, 128] blocks (per-tensor or "
            f"per-channel fp8 is not supported)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"unsupported fp8 fmt {fmt!r}: this engine loads e4m3 weights")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise UnsupportedQuantization(f"unsupported fp8 activation_scheme {act!r}: this engine quantizes activations dynamically")
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise UnsupportedQuantization(f"unsupported fp8 scale_fmt {scale_fmt!r}: expected 'float' or 'ue8m0'")
    expert_dtype = q.get("expert_dtype") or config.get("expert_dtype") or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise UnsupportedQuantization(f"unsupported expert_dtype {expert_dtype!r}: expected 'fp8' or 'fp4'")
    return QuantScheme("fp8", BLOCK, scale_fmt, expert_dtype)


# safetensors dtype codes that only a quantized checkpoint has
_QUANTIZED_CODES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}


def _header_dtypes(path: Path) -> dict[str, str]:
    """name -> safetensors dtype code, from a file's JSON header (no tensor data is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def checkpoint_scheme(model_dir: str | Path) -> Optional[QuantScheme]:
    """The checkpoint's scheme, checked against what its files hold: FP8 tensors in a checkpoint
    without a quantization_config are refused (their scales would be guessed)."""
    d = Path(model_dir)
    path = d / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}  # a bare tensor folder: no declaration
    scheme = scheme_from_config(config)
    if scheme is None:
        for path in _safetensors_files(d):
            for name, code in _header_dtypes(path).items():
                if code in _QUANTIZED_CODES or name.endswith(("_scale_inv", ".weight_scale")):
                    raise UnsupportedQuantization(
                        f"{path.name} holds quantized tensor {name} ({code}) but config.json has no "
                        f"quantization_config: refusing to guess its scales"
                    )
    return scheme
