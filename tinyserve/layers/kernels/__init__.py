"""Our compiled kernels: the C++ CPU kernels (csrc/, built per machine on first use by cpu_kernels.py) and the Triton paged-attention kernel for CUDA. Only layers/ops.py calls them."""
