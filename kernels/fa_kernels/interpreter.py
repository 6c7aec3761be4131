"""Five fixes to Triton's interpreter (3.6 to 3.9) so the CPU path computes (and fails) as
the GPU does.

Applied once, only when the kernels run interpreted (``TRITON_INTERPRET=1``). The
interpreter keeps bf16 tensors as raw uint16 bit patterns:

* ``tl.dot`` on bf16 operands multiplied those bit patterns as integers
  (triton#11584). We widen bf16 operands to fp32 first: exact, and what the tensor
  cores do (bf16 products are exact in fp32, accumulation in fp32).
* fp32 -> bf16 casts truncated, where the GPU rounds to nearest even. We round.

* A load through a tensor descriptor with a dimension of size 0 read nothing and
  returned the padding, where the H200's copy engine stops the kernel with an illegal
  instruction (an empty varlen sequence did it). We raise.

* A runtime scalar used as a loop bound (``range(lo, hi, BLOCK_N)``, every kernel's key
  or query loop) converts through ``int()`` of the interpreter's 1-element array, which
  numpy >= 2.4 refuses (triton#9171). We convert through ``.item()``, which every numpy
  takes.

* Triton 3.9: ``constexpr * tensor`` (``LOG2E * x``) gave a constexpr wrapping the
  tensor, which ``tl`` functions refuse; we return the tensor. The load through a
  descriptor also lost its ``eviction_policy`` argument there; the check above takes
  either signature.

Elementwise bf16 arithmetic and reductions are also wrong in the interpreter, which
is why the kernels do all elementwise math in fp32 (as they should anyway).
"""
from __future__ import annotations

import numpy as np

_applied = False


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16, NaN kept NaN, as cvt.rn.bf16.f32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    rounded = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if np.any(nan):
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def apply() -> None:
    global _applied
    if _applied:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    original_dot = builder_cls.create_dot
    original_cast = builder_cls.cast_impl
    original_fp_to_fp = builder_cls.create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = _bf16_bits_to_fp32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data
            b_data = _bf16_bits_to_fp32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data
            out = np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == tl.bfloat16 and dst_ty == tl.float32:
            return interp.TensorHandle(_bf16_bits_to_fp32(src.data), dst_ty)
        if src_ty == tl.float32 and dst_ty == tl.bfloat16:
            return interp.TensorHandle(_fp32_to_bf16_bits(src.data), dst_ty)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(_fp32_to_bf16_bits(src.data), dst_type.scalar)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    original_descriptor_load = builder_cls.create_descriptor_load

    def create_descriptor_load(self, desc, indices, *cache_options):
        sizes = [int(np.asarray(dim.data).item()) for dim in desc.shape]
        if 0 in sizes:
            raise RuntimeError(f"load through a tensor descriptor of shape {sizes}: TMA "
                               "faults on a zero-size dimension")
        return original_descriptor_load(self, desc, indices, *cache_options)

    original_patch_tensor = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interp._patch_lang_tensor = patch_lang_tensor
    _unwrap_constexpr_arithmetic(tl)
    builder_cls.create_dot = create_dot
    builder_cls.create_descriptor_load = create_descriptor_load
    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_fp_to_fp = create_fp_to_fp
    _applied = True


def _unwrap_constexpr_arithmetic(tl) -> None:
    """``constexpr op tensor`` gives the tensor, as the compiler's code generator does.

    Triton 3.9's interpreter keeps a module-level ``tl.constexpr`` (``LOG2E``) a constexpr
    inside the kernel, and its operators wrap whatever they compute, so ``LOG2E * x``
    became a constexpr holding a tensor, which every ``tl`` function then refused."""
    for name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                 "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
                 "__rmod__", "__pow__", "__rpow__"):
        original = getattr(tl.constexpr, name, None)
        if original is None:
            continue

        def operator(self, other, original=original):
            result = original(self, other)
            return result.value if isinstance(result.value, tl.tensor) else result

        setattr(tl.constexpr, name, operator)


class HostDtype(str):
    """A plan dtype name ("bfloat16") that also answers what Triton's ``TensorDescriptor``
    asks of its array's dtype."""

    @property
    def itemsize(self) -> int:
        return np.dtype(self).itemsize if self != "bfloat16" else 2

    @property
    def is_floating_point(self) -> bool:
        return self.startswith(("float", "bfloat"))


class HostArray:
    """Host memory at an address, as Triton's interpreter takes a launch argument.

    The interpreter reads an argument's address (``data_ptr``) and dtype, and first
    copies it to the host through the few ``torch.Tensor`` methods below, then copies
    it back. The memory here is on the host already, so both copies are the identity:
    the kernel reads and writes it in place, and no framework is needed (fa_jax's CPU
    path runs without torch). ``dtype`` is the plan's name ("bfloat16", "int32", ...).
    """
    __slots__ = ("address", "shape", "dtype")

    def __init__(self, address: int, shape, dtype: str):
        self.address, self.shape, self.dtype = int(address or 0), tuple(shape), HostDtype(dtype)

    def data_ptr(self) -> int:
        return self.address

    def untyped_storage(self) -> "HostArray":
        return self

    def cpu(self) -> "HostArray":
        return self

    def new_empty(self, *_, **__) -> "HostArray":
        return HostArray(self.address, self.shape, self.dtype)

    def set_(self, *_) -> "HostArray":
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple:
        return self.shape

    def stride(self) -> tuple:
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        return tuple(reversed(strides))

    def copy_(self, other) -> "HostArray":
        if other.data_ptr() != self.address:
            raise RuntimeError("HostArray is written in place only")
        return self
