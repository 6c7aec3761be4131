"""FlashAttention-2 for PyTorch, on the shared Triton kernels of ``fa_kernels``.

Importing this on a machine without a CUDA GPU turns on Triton's interpreter
(before triton is imported), so CPU tensors run the very same kernels.
"""
import fa_kernels  # noqa: F401  (decides interpreter vs compiled before triton loads)

from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from . import nn, ring
from .ops import attention, attention_varlen, dropout_mask

__all__ = ["nn", "ring", "attention", "attention_varlen", "dropout_mask", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache"]
