"""FlashAttention-2 Triton kernels and their framework-neutral launch plan.

Import name ``fa_kernels`` (folder ``kernels/fa_kernels/``: nothing named ``kernels`` is
importable from the repository's root, where it would shadow the ``kernels`` package that
transformers uses). Nothing here imports torch or jax.
Importing this package decides, before triton is imported, whether the kernels are
compiled (a CUDA GPU is present) or interpreted (no GPU): see ``runtime``.
"""
from . import runtime

runtime.configure()

from . import plan  # noqa: E402  (pure Python: no triton)

__all__ = ["plan", "runtime", "kernel"]


def kernel(name: str):
    """The Triton kernel a plan names (``Launch.kernel``), imported on first use."""
    from . import registry

    return registry.KERNELS[name]
