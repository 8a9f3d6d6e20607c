"""Quantized checkpoints: FP8 block-scaled weights (DeepSeek-V3's release format) and FP4 routed
experts (DeepSeek-V4's), read with their scales, kept quantized on CUDA, dequantized once on CPU.

scheme: what config.json declares and whether it is loadable; codec: the encodings (also used
to write checkpoints); tensors: QuantWeight, the resident form F.linear dispatches on; load:
pairing weights with scales, placement, the startup report."""

from dsv4_engine.quant.load import LoadReport, keep_quantized, log_resident, pair_quantized, place, resident_bytes
from dsv4_engine.quant.scheme import QuantScheme, UnsupportedQuantization, checkpoint_scheme, scheme_from_config
from dsv4_engine.quant.tensors import QuantWeight, dense, is_quantized, moe_experts_for, one_format

__all__ = [
    "LoadReport",
    "QuantScheme",
    "QuantWeight",
    "UnsupportedQuantization",
    "checkpoint_scheme",
    "dense",
    "is_quantized",
    "keep_quantized",
    "log_resident",
    "moe_experts_for",
    "one_format",
    "pair_quantized",
    "place",
    "resident_bytes",
    "scheme_from_config",
]
