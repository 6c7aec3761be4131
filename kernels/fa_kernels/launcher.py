"""One launch of a plan step through Triton's own launch path: fa_torch's on the GPU,
and both front ends' in Triton's interpreter (fa_jax launches on the GPU through
jax_triton instead, the same kernel compiled to the same PTX: fa_kernels.helpers.kernel).

``kernel[grid](...)`` (Triton's JIT entry) binds and specialises every argument on each
call: ~30 us of host time per launch on the H200's host, where the compiled kernel's
own launcher takes ~10 (benchmarks/NOTES.md). A plan's launch fixes every scalar and
constexpr, so the only things that can change the specialisation between two calls of
the same launch are the arrays' dtypes and their 16-byte alignment: with those in the
key, the first call goes through the JIT (compiling if needed) and later calls go
straight to the kernel it returned.

Arrays are anything with ``data_ptr()`` and ``dtype`` (torch tensors; in the
interpreter, ``interpreter.HostArray``). Triton imports here; torch and jax do not: a
kernel that builds tensor descriptors on the device needs scratch memory, which the
caller's ``allocate`` gives. Descriptors the plan has made on the host
(``plan.Blocks``) are Triton's ``TensorDescriptor`` over the input array (Gluon's, with
the shared-memory layout, for a Gluon kernel), built for each call (their address is
the array's). A launch that sets ``maxnreg`` (a Gluon kernel whose partitions share
out the registers) passes it to the compiler.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from . import registry
from .plan import block_arguments

_COMPILED: dict = {}
# Triton's interpreter patches triton.language globally while a kernel runs: one at a time.
_INTERPRETER_LOCK = threading.Lock()
_MAX_ENTRIES = 8192  # plans are cached up to 4096 each way; past this, start over


def _key(launch, arrays, device) -> tuple:
    return (id(launch), device,  # a descriptor's array is among the inputs
            *[(str(a.dtype), a.data_ptr() % 16 == 0) for a in arrays
              if hasattr(a, "data_ptr")])


_WITHOUT_TMA: dict = {}


def without_tma(launch):
    """The same launch reading through plain pointers (same arithmetic, same bits)."""
    entry = _WITHOUT_TMA.get(id(launch))
    if entry is None:
        if len(_WITHOUT_TMA) >= _MAX_ENTRIES:
            _WITHOUT_TMA.clear()
        constexprs = dict(launch.constexprs, USE_TMA=False, HOST_TMA=False)
        if "HOLD_TMA" in constexprs:
            constexprs["HOLD_TMA"] = False
        plain = dataclasses.replace(launch, constexprs=constexprs,
                                    blocks=tuple(b.plain() for b in launch.blocks))
        entry = _WITHOUT_TMA[id(launch)] = (launch, plain)
    return entry[1]


_DESCRIPTOR_INPUTS = ("q", "k", "v", "dout")  # what the kernels may read through descriptors


def starts_aligned(*arrays) -> bool:
    """Whether tensor descriptors can stand over these arrays: each starts on 16 bytes.
    The plan checks strides, but only the arrays know their addresses (a view can start
    anywhere)."""
    return all(a.data_ptr() % 16 == 0 for a in arrays)


def fit_to_arrays(launch, inputs: list):
    """``launch``, or its plain-pointer twin when it reads blocks through tensor
    descriptors and one of q, k, v, dout does not start on 16 bytes (``starts_aligned``).
    A kernel that reads only through descriptors (the warp-specialised ones) has no
    twin: the front end tells the plan (``host_descriptors``) before it chooses one."""
    if launch.constexprs.get("USE_TMA") and not starts_aligned(
            *(a for name, a in zip(launch.inputs, inputs) if name in _DESCRIPTOR_INPUTS)):
        return without_tma(launch)
    return launch


def _host_descriptor(array, shape, strides, block_shape) -> TensorDescriptor:
    return TensorDescriptor(array, list(shape), list(strides), list(block_shape))


def _gluon_descriptor(array, shape, strides, block_shape):
    """A Gluon kernel's host descriptor: Triton's, with the shared-memory layout the
    kernel's buffers take (gluon_forward.shared_layout)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .gluon_forward import shared_layout

    layout = shared_layout(tuple(block_shape), str(array.dtype).removeprefix("torch."))
    return GluonDescriptor(array, list(shape), list(strides), list(block_shape), layout)


def launch(launch, inputs: list, outputs: list, device: int | None, allocate=None) -> None:
    """Launch ``launch`` on ``device`` (the current CUDA device, on its current stream; None:
    Triton's interpreter, on host memory): ``inputs`` in ``launch.inputs`` order,
    ``outputs`` in ``launch.outputs``. ``allocate(size, alignment, stream)`` returns
    device scratch memory (anything with ``data_ptr()``) for kernels that build tensor
    descriptors."""
    launch = fit_to_arrays(launch, inputs)
    gluon = launch.kernel in registry.GLUON_KERNELS
    descriptor = _gluon_descriptor if gluon else _host_descriptor
    inputs = [*inputs, *block_arguments(launch, inputs, descriptor)]
    if device is None:  # Triton's interpreter (its kernels are never cached)
        scalars = registry.scalar_arguments(launch)
        with _INTERPRETER_LOCK:
            registry.KERNELS[launch.kernel][launch.grid](
                *inputs, *scalars, *outputs, num_warps=launch.num_warps,
                num_stages=launch.num_stages, **launch.constexprs)
        return
    device_descriptors = launch.constexprs.get("USE_TMA") and not launch.constexprs.get("HOST_TMA")
    if not (device_descriptors and allocate is not None):
        return _launch(launch, inputs, outputs, device)
    # Triton asks its (context-local) allocator for the scratch: set it for this launch only.
    token = _allocation._allocator.set(allocate)
    try:
        _launch(launch, inputs, outputs, device)
    finally:
        _allocation._allocator.reset(token)


def _launch(launch, inputs: list, outputs: list, device: int) -> None:
    key = _key(launch, (*inputs, *outputs), device)
    entry = _COMPILED.get(key)
    if entry is None:
        kernel = registry.KERNELS[launch.kernel]
        scalars = registry.scalar_arguments(launch)
        options = {} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}
        compiled = kernel[launch.grid](*inputs, *scalars, *outputs, num_warps=launch.num_warps,
                                       num_stages=launch.num_stages, **options,
                                       **launch.constexprs)
        # The launch is kept in the entry: its id() stays its own while cached.
        tail = [launch.constexprs[name]
                for name in kernel.arg_names[len(inputs) + len(scalars) + len(outputs):]]
        if len(_COMPILED) >= _MAX_ENTRIES:
            _COMPILED.clear()
        _COMPILED[key] = (launch, compiled, scalars, tail)
        return
    _, compiled, scalars, tail = entry
    # The compiled kernel's launcher calls Triton's launch hooks (its profiler) as the JIT does.
    compiled[launch.grid](*inputs, *scalars, *outputs, *tail)
