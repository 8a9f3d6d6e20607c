"""Which quantization a checkpoint declares, and whether this engine can load it.

Read from config.json before any weight is touched, so a bad checkpoint fails at startup with one
line. Accepted: `quantization_config.quant_method: fp8` with `weight_block_size: [128, 128]`,
`fmt: e4m3`, dynamic activations, scales stored as fp32 ("float", DeepSeek-V3) or as powers of two
("ue8m0", DeepSeek-V4), and routed experts in fp8 or fp4 (`expert_dtype`, which V4 may also
carry at the top level of its config, as transformers folds it in).
"""

from __future__ import annotations

import json
import re
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
        raise UnsupportedQuantization(
            f"unsupported fp8 activation_scheme {act!r}: this engine quantizes activations dynamically"
        )
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise UnsupportedQuantization(f"unsupported fp8 scale_fmt {scale_fmt!r}: expected 'float' or 'ue8m0'")
    expert_dtype = q.get("expert_dtype") or config.get("expert_dtype") or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise UnsupportedQuantization(f"unsupported expert_dtype {expert_dtype!r}: expected 'fp8' or 'fp4'")
    return QuantScheme("fp8", BLOCK, scale_fmt, expert_dtype)


# Multi-token-prediction layers (`mtp.`, DeepSeek-V4's release): never read, so never checked.
MTP = re.compile(r"(^|\.)mtp\.")

# safetensors dtype codes that only a quantized checkpoint has
_QUANTIZED_CODES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
_PACKED_FP4_CODES = {"I8", "U8", "F4"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_key(name: str, keys) -> Optional[str]:
    """The name of weight `name`'s scales in a checkpoint, if it has some: `<module>.weight_scale_inv`
    (DeepSeek-V3, transformers), `<module>.scale` (DeepSeek-V4's release), `<fused>_scale_inv`."""
    base = name[: -len(".weight")] if name.endswith(".weight") else None
    candidates = [base + ".weight_scale_inv", base + ".scale"] if base is not None else [name + "_scale_inv"]
    for c in candidates:
        if c in keys:
            return c
    return None


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype code, shape), from a file's JSON header (no tensor data is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def tensor_refusal(
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    scheme: Optional[QuantScheme],
    files: Optional[dict[str, str]] = None,
) -> Optional[str]:
    """Why these tensors (name -> (dtype code, shape), every file of a checkpoint) cannot be read
    correctly under `scheme`, in one line, or None. From the headers alone, so that a bad tensor
    stops the engine before any weight is read (and, at --tp-size > 1, before any rank starts:
    a tensor only another rank reads must not fail that rank alone)."""
    for name, (code, shape) in tensors.items():
        sk = scale_key(name, tensors)
        if sk is not None and code in _FLOAT_CODES:
            # scales beside an unquantized weight: were the values dequantized already, or cast
            # without their scales? Either reading could be wrong.
            return (
                f"{name} is {code} (not quantized) but the checkpoint also holds scales for it ({sk}): "
                f"refusing to guess whether they apply"
            )
        if scheme is None:
            if (
                code in _QUANTIZED_CODES
                or name.endswith(("_scale_inv", ".weight_scale"))
                or (sk is not None and code in _PACKED_FP4_CODES)
            ):
                return (
                    f"{(files or {}).get(name, 'the checkpoint')} holds quantized tensor {name} ({code}) but "
                    f"config.json has no quantization_config: "
                    f"refusing to guess its scales"
                )
            continue
        if code in ("F8_E5M2",):
            return f"{name} is {code}: this engine loads e4m3 fp8 weights only"
        if code == "F8_E4M3":
            if sk is None:
                return (
                    f"{name} is fp8 ({code}) but the checkpoint has no scales for it (expected "
                    f"{name.removesuffix('.weight')}.weight_scale_inv or .scale)"
                )
            bn, bk = scheme.block
            want = (*shape[:-2], cdiv(shape[-2], bn), cdiv(shape[-1], bk)) if len(shape) >= 2 else None
            if tensors[sk][1] != want:
                return (
                    f"{name}: fp8 weight {shape} needs scales {want} for {bn}x{bk} blocks, found "
                    f"{tensors[sk][1]} in {sk}"
                )
        elif sk is not None and code in _PACKED_FP4_CODES:
            if scheme.expert_dtype != "fp4":
                return (
                    f"{name} is packed fp4 ({code}) but quantization_config says expert_dtype {scheme.expert_dtype!r}"
                )
            want = (*shape[:-1], cdiv(2 * shape[-1], FP4_GROUP)) if shape else None
            if tensors[sk][1] != want:
                return (
                    f"{name}: fp4 weight {shape} (packed) needs one scale per {FP4_GROUP} values {want}, "
                    f"found {tensors[sk][1]} in {sk}"
                )
    return None


def checkpoint_scheme(model_dir: str | Path) -> Optional[QuantScheme]:
    """The checkpoint's scheme, checked against what its files hold (headers only): FP8 tensors
    in a checkpoint without a quantization_config are refused (their scales would be guessed), and
    so is a quantized weight without scales of the right shape."""
    d = Path(model_dir)
    path = d / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}  # a bare tensor folder: no declaration
    scheme = scheme_from_config(config)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, str] = {}
    for f in _safetensors_files(d):
        for name, entry in _header(f).items():
            if MTP.search(name):
                continue
            tensors[name] = entry
            where[name] = f.name
    refusal = tensor_refusal(tensors, scheme, where)
    if refusal is not None:
        raise UnsupportedQuantization(refusal)
    return scheme
