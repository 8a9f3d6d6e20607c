"""Pair each quantized weight with its scales, and decide what stays quantized in memory.

A checkpoint names the scales of `<module>.weight` as `<module>.weight_scale_inv` (DeepSeek-V3,
transformers) or `<module>.scale` (DeepSeek-V4's release); transformers' fused expert tensors
(`...experts.gate_up_proj`) carry `..._scale_inv`. Placement: on CUDA weights stay quantized
(`QuantWeight`, used through F.linear by the block-scaled kernels); elsewhere they are
dequantized once, at load, to the engine's dtype: CPU has no fp8 matmul, and dequantizing per
use would add a pass over every weight to every step; the price is memory (4 B per value in
fp32, 2 in bf16, instead of 1 or 0.5).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from dsv4_engine.quant.codec import cdiv, float_to_e8m0_bytes, scale_as_float
from dsv4_engine.quant.scheme import FP4_GROUP, QuantScheme, UnsupportedQuantization, scale_key
from dsv4_engine.quant.tensors import FP4, FP8, QuantWeight

log = logging.getLogger("dsv4.engine")

_FP8_DTYPES = {torch.float8_e4m3fn}
_OTHER_FP8 = {getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}
_PACKED_FP4 = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else set())
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass
class LoadReport:
    """What a checkpoint held, by format (tensor counts and bytes as stored)."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, fmt: str, nbytes: int) -> None:
        self.counts[fmt] = self.counts.get(fmt, 0) + 1
        self.bytes[fmt] = self.bytes.get(fmt, 0) + nbytes

    def describe(self) -> str:
        return ", ".join(f"{self.counts[k]} {k} tensors ({mib(self.bytes[k])})" for k in sorted(self.counts))


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fp8(name: str, q: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> QuantWeight:
    bn, bk = scheme.block
    N, K = q.shape[-2:]
    want = (*q.shape[:-2], cdiv(N, bn), cdiv(K, bk))
    if tuple(s.shape) != want:
        raise UnsupportedQuantization(
            f"{name}: fp8 weight {tuple(q.shape)} needs scales {want} for {bn}x{bk} blocks, found {tuple(s.shape)}"
        )
    return QuantWeight(FP8, q, scale_as_float(s).contiguous(), K)  # block scales kept as stored


def _fp4(name: str, q: torch.Tensor, s: torch.Tensor) -> QuantWeight:
    K = 2 * q.shape[-1]
    want = (*q.shape[:-1], cdiv(K, FP4_GROUP))
    if tuple(s.shape) != want:
        raise UnsupportedQuantization(
            f"{name}: fp4 weight {tuple(q.shape)} (packed) needs one scale per {FP4_GROUP} "
            f"values {want}, found {tuple(s.shape)}"
        )
    if s.dtype == torch.uint8:
        exps = s
    elif _E8M0 is not None and s.dtype == _E8M0:
        exps = s.view(torch.uint8)
    else:
        f = s.float()
        exps = float_to_e8m0_bytes(f)
        if not torch.equal(torch.exp2(exps.float() - 127), f):
            raise UnsupportedQuantization(f"{name}: fp4 scales must be powers of two (e8m0)")
    return QuantWeight(FP4, q.contiguous().view(torch.uint8), exps.contiguous(), K)


def pair_quantized(raw: dict[str, torch.Tensor], scheme: Optional[QuantScheme]) -> tuple[dict[str, Any], LoadReport]:
    """name -> tensor, or QuantWeight for a quantized weight (its scale entry consumed)."""
    out: dict[str, Any] = {}
    report = LoadReport()
    keys = set(raw)
    scale_of = {}
    for name, t in raw.items():
        if t.dtype in _OTHER_FP8:
            raise UnsupportedQuantization(f"{name} is {t.dtype}: this engine loads e4m3 fp8 weights only")
        sk = scale_key(name, keys)
        if t.dtype in _FP8_DTYPES or (sk is not None and t.dtype in _PACKED_FP4):
            scale_of[name] = sk
        elif sk is not None and t.is_floating_point():
            raise UnsupportedQuantization(
                f"{name} is {t.dtype} (not quantized) but the checkpoint also holds "
                f"scales for it ({sk}): refusing to guess whether they apply"
            )
    scales = {sk for sk in scale_of.values() if sk is not None}
    for name, t in raw.items():
        if name in scales:
            continue
        if name not in scale_of:
            out[name] = t
            report.add(str(t.dtype).removeprefix("torch."), t.nbytes)
            continue
        if scheme is None:
            raise UnsupportedQuantization(
                f"{name} is quantized ({t.dtype}) but config.json has no "
                f"quantization_config: refusing to guess its scales"
            )
        sk = scale_of[name]
        if sk is None:
            raise UnsupportedQuantization(
                f"{name} is {t.dtype} but the checkpoint has no scales for it "
                f"(expected {name.removesuffix('.weight')}.weight_scale_inv or .scale)"
            )
        s = raw[sk]
        if t.dtype in _FP8_DTYPES:
            out[name] = _fp8(name, t, s, scheme)
            report.add("fp8", t.nbytes + s.nbytes)
        else:
            if scheme.expert_dtype != "fp4":
                raise UnsupportedQuantization(
                    f"{name} is packed fp4 but quantization_config says expert_dtype {scheme.expert_dtype!r}"
                )
            out[name] = _fp4(name, t, s)
            report.add("fp4", t.nbytes + s.nbytes)
    return out, report


def keep_quantized(device: torch.device) -> bool:
    """CUDA keeps fp8/fp4 weights resident and runs the block-scaled kernels; CPU dequantizes once."""
    return torch.device(device).type == "cuda"


def place(t: Any, device: torch.device, dtype: Optional[torch.dtype], kernels: Any = None) -> Any:
    """A checkpoint tensor on its device: QuantWeights stay quantized on CUDA (run by the kernel
    backend `kernels`), become dense elsewhere."""
    if isinstance(t, QuantWeight):
        if keep_quantized(device):
            q = t.to(device).contiguous()
            q.kernels = kernels
            return q
        return t.dequantize(dtype or torch.float32).to(device).contiguous()
    if t.dtype in _FP8_DTYPES | _OTHER_FP8 or t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        # a quantized tensor that reached a model without its scales (not through load_weights):
        # casting it would silently misread it
        raise UnsupportedQuantization(
            f"a {t.dtype} weight reached the model without its scales; "
            f"load checkpoints with dsv4_engine.weights.load_weights"
        )
    t = t.to(device=device)
    return (t.to(dtype) if dtype is not None else t).contiguous()


# Fields of a layer that hold no weights: the backend, the rank's comm, the config, and the rope's
# tables (made from the config, not read from the checkpoint).
NOT_WEIGHTS = frozenset({"ops", "kops", "tp", "cfg", "cos", "sin", "rope", "experts", "reduce", "kernels"})


def _leaves(obj: Any) -> Iterable[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    elif isinstance(obj, (torch.Tensor, QuantWeight)):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a layer (dsv4_engine.layers)
        for f in dataclasses.fields(obj):
            if f.name not in NOT_WEIGHTS:
                yield from _leaves(getattr(obj, f.name))


def resident_bytes(*objs: Any) -> dict[str, int]:
    """Bytes of every distinct storage reachable from objs, by resident format (fp8, fp4, dense);
    views into one storage (a fused projection's per-name rows) count once."""
    seen: set[int] = set()
    out = {"fp8": 0, "fp4": 0, "dense": 0}
    for obj in objs:
        for leaf in _leaves(obj):
            tensors = (leaf.data, leaf.scale) if isinstance(leaf, QuantWeight) else (leaf,)
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                out[leaf.kind if isinstance(leaf, QuantWeight) else "dense"] += storage.nbytes()
    return out


def log_resident(model: str, device: torch.device, *objs: Any) -> dict[str, int]:
    """One startup line: what the weights occupy where, by format."""
    b = resident_bytes(*objs)
    total = sum(b.values())
    how = "kept quantized" if keep_quantized(device) else "quantized weights dequantized once at load"
    log.info(
        "%s weights resident on %s: %s (fp8 %s, fp4 %s, dense %s; %s)",
        model,
        torch.device(device).type,
        mib(total),
        mib(b["fp8"]),
        mib(b["fp4"]),
        mib(b["dense"]),
        how,
    )
    return b
