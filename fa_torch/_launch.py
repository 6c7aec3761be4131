"""Run a plan's launches on torch tensors (CUDA, or CPU through the interpreter).

The JAX CPU path uses this too: it wraps its numpy buffers as torch tensors and
launches here, so the two front ends run the same kernel the same way.
"""
from __future__ import annotations

import threading

import torch

import fa_kernels
from fa_kernels import runtime

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# The interpreter patches triton.language globally while a kernel runs.
_INTERPRETER_LOCK = threading.Lock()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def capability(device: torch.device):
    """What the plan keys its configs on: (major, minor), or None for the interpreter."""
    if runtime.interpreting():
        return None
    return torch.cuda.get_device_capability(device)


def run(launch, arrays: dict, device: torch.device) -> dict:
    """Allocate the launch's outputs, launch it, return them by name (adds to ``arrays``)."""
    outputs = {o.name: torch.empty(o.shape, dtype=TORCH_DTYPES[o.dtype], device=device)
               for o in launch.outputs}
    if not launch.empty:
        args = [arrays[name] for name in launch.inputs] + list(launch.scalars) + list(outputs.values())
        kernel = fa_kernels.kernel(launch.kernel)[launch.grid]
        if runtime.interpreting():
            with _INTERPRETER_LOCK:
                kernel(*args, num_warps=launch.num_warps, num_stages=launch.num_stages,
                       **launch.constexprs)
        else:
            kernel(*args, num_warps=launch.num_warps, num_stages=launch.num_stages,
                   **launch.constexprs)
    arrays.update(outputs)
    return outputs
