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
