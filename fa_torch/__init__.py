"""FlashAttention-2 for PyTorch, on the shared Triton kernels of ``fa_kernels``.

Importing this on a machine without a CUDA GPU turns on Triton's interpreter
(before triton is imported), so CPU tensors run the very same kernels.
"""
import fa_kernels  # noqa: F401  (decides interpreter vs compiled before triton loads)

from .ops import attention

__all__ = ["attention"]
