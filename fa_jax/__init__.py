"""FlashAttention-2 for JAX, on the shared Triton kernels of ``fa_kernels``.

On a CUDA GPU the kernels launch through ``jax_triton.triton_call``; without one they
run in Triton's interpreter inside an XLA FFI call (importing this turns the interpreter
on before triton is imported). No PyTorch either way.
"""
import fa_kernels  # noqa: F401  (decides interpreter vs compiled before triton loads)

from ._launch import export_checks
from .jax_nn import dot_product_attention
from .kvcache import attention_with_kvcache
from .ops import attention, attention_backward, attention_varlen, dropout_mask

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_with_kvcache",
           "dot_product_attention", "dropout_mask", "export_checks", "ring"]


def __getattr__(name):
    # ``fa_jax.flax`` without importing Flax for users who do not use it.
    if name in ("flax", "ring"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fa_jax' has no attribute {name!r}")
