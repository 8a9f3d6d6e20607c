"""The kernel API backed by Triton: the same names and signatures as dsv4_kernels.reference.

On CUDA tensors the kernels compile for the device; on CPU tensors they run under
TRITON_INTERPRET=1 (which must be set before this module is imported), for tests.
"""

from dsv4_kernels.triton_kernels.mla_decode import mla_decode
from dsv4_kernels.triton_kernels.mla_extend import mla_extend
from dsv4_kernels.triton_kernels.moe_experts import moe_experts
from dsv4_kernels.triton_kernels.moe_route import moe_route
from dsv4_kernels.triton_kernels.rmsnorm import rmsnorm
from dsv4_kernels.triton_kernels.rope import rope_interleaved_

__all__ = ["mla_decode", "mla_extend", "moe_route", "moe_experts", "rmsnorm", "rope_interleaved_"]

# DeepSeek-V4 (same names and signatures as dsv4_kernels.reference_v4)
from dsv4_kernels.triton_kernels.moe_experts import moe_experts as _moe_experts  # noqa: E402
from dsv4_kernels.triton_kernels.v4_attention import v4_attention_decode, v4_attention_extend  # noqa: E402
from dsv4_kernels.triton_kernels.v4_compress import v4_compress_pool  # noqa: E402
from dsv4_kernels.triton_kernels.v4_indexer import v4_indexer_topk  # noqa: E402
from dsv4_kernels.triton_kernels.v4_mhc import v4_hc_post, v4_hc_pre  # noqa: E402
from dsv4_kernels.triton_kernels.v4_moe_route import v4_moe_route  # noqa: E402


def v4_moe_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit):
    """Routed experts with V4's clamped SwiGLU (the moe_experts kernel with its clamp on)."""
    return _moe_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit=swiglu_limit)


__all__ += [
    "v4_attention_decode",
    "v4_attention_extend",
    "v4_indexer_topk",
    "v4_compress_pool",
    "v4_hc_pre",
    "v4_hc_post",
    "v4_moe_route",
    "v4_moe_experts",
]
