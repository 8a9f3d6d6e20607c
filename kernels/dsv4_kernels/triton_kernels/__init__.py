"""@triton.jit kernels, one module per operation: the kernel(s), its launcher, the launch
configuration, and the variants that scripts/compile_kernels.py compiles ahead of time."""
