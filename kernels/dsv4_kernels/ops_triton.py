"""The kernel API on Triton (`--kernel-backend triton`, the default on CUDA): every kernel op as
an @triton.jit kernel with the reference's name and signature. On CUDA tensors the kernels compile
for the device; on CPU tensors they run under TRITON_INTERPRET=1 (set before import), for tests.
The models' own torch-form steps (dense MLP, absorbed projections) stay TorchOps': cuBLAS runs
them."""

from __future__ import annotations

from dsv4_kernels import triton_ops
from dsv4_kernels.ops_torch import OP_GROUPS, TorchOps


class TritonOps(TorchOps):
    name = "triton"
    # every step on the kernels: no host reads of lengths (CUDA graphs capture a decode step)
    expanded_prefill = False
    v4_kernel_path = True
    # mla_decode reads packed FP8 KV rows itself (--kv-cache-dtype fp8_e4m3): no decoded copy
    mla_decode_reads_fp8 = True

    mla_decode = staticmethod(triton_ops.mla_decode)
    mla_extend = staticmethod(triton_ops.mla_extend)
    moe_route = staticmethod(triton_ops.moe_route)
    moe_experts = staticmethod(triton_ops.moe_experts)
    rmsnorm = staticmethod(triton_ops.rmsnorm)
    rope_interleaved_ = staticmethod(triton_ops.rope_interleaved_)
    v4_attention_decode = staticmethod(triton_ops.v4_attention_decode)
    v4_attention_extend = staticmethod(triton_ops.v4_attention_extend)
    v4_indexer_topk = staticmethod(triton_ops.v4_indexer_topk)
    v4_compress_pool = staticmethod(triton_ops.v4_compress_pool)
    v4_hc_pre = staticmethod(triton_ops.v4_hc_pre)
    v4_hc_post = staticmethod(triton_ops.v4_hc_post)
    v4_moe_route = staticmethod(triton_ops.v4_moe_route)
    v4_moe_experts = staticmethod(triton_ops.v4_moe_experts)

    @staticmethod
    def fp8_linear(x, data, scale):
        from dsv4_kernels.triton_kernels.fp8_gemm import fp8_linear

        return fp8_linear(x, data, scale)

    @staticmethod
    def fp4_linear(x, data, scale):
        from dsv4_kernels.triton_kernels.fp4_gemm import fp4_linear

        return fp4_linear(x, data, scale)

    @staticmethod
    def fp8_moe_experts(*args):
        from dsv4_kernels.triton_kernels.fp8_gemm import fp8_moe_experts

        return fp8_moe_experts(*args)

    @staticmethod
    def fp4_moe_experts(*args):
        from dsv4_kernels.triton_kernels.fp4_gemm import fp4_moe_experts

        return fp4_moe_experts(*args)

    def implementations(self) -> dict[str, str]:
        torch_forms = {"linear": "cublas", "mlp": "cublas", "mla_absorb": "cublas", "v4_rms_rope": "triton"}
        return {op: "triton" if op not in torch_forms else f"triton: {torch_forms[op]}" for op in OP_GROUPS}
