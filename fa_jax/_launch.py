"""Run a plan's launches on jax arrays.

* GPU: ``jax_triton.triton_call`` (0.3.1 argument names; kept in this one place).
* CPU: jax_triton lowers only for cuda and rocm, so the same kernel runs in Triton's
  interpreter inside ``jax.pure_callback``: the numpy buffers are wrapped as torch
  tensors (bf16 through an int16 view) and launched by fa_torch's launcher.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from fa_kernels import runtime


def on_gpu() -> bool:
    return not runtime.interpreting()


@functools.lru_cache(maxsize=None)
def _jax_triton():
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    # jax_triton 0.3.1 sets TRITON_CACHE_DIR="" on import, after which every later
    # torch-Triton compile in this process fails: put it back.
    if cache_dir is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    return jax_triton


@functools.lru_cache(maxsize=None)
def capability():
    """What the plan keys its configs on: the GPU's (major, minor), or None on the CPU."""
    if not on_gpu():
        return None
    device = jax.devices("gpu")[0]
    major, minor = str(device.compute_capability).split(".")
    return int(major), int(minor)


def _scalar(value):
    # jax_triton 0.3.1 passes a Python float as fp64: the kernels take fp32.
    if isinstance(value, float):
        return np.float32(value)
    return value


def placeholder():
    """What stands in for an input the problem does not use (its flag is off)."""
    return jnp.zeros((1,), jnp.float32)


def run(launch, arrays: dict) -> dict:
    """Launch one plan step on jax arrays; return its outputs by name (adds to ``arrays``)."""
    shapes = [jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs]
    inputs = [arrays[name] for name in launch.inputs]
    if launch.empty:
        results = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    elif on_gpu():
        import fa_kernels

        results = _jax_triton().triton_call(
            *inputs, *(_scalar(s) for s in launch.scalars),
            kernel=fa_kernels.kernel(launch.kernel), out_shape=shapes, grid=launch.grid,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
            zeroed_outputs=tuple(i for i, o in enumerate(launch.outputs) if o.zeroed),
            **launch.constexprs)
    else:
        results = jax.pure_callback(functools.partial(_run_on_host, launch), shapes, *inputs)
    outputs = {o.name: r for o, r in zip(launch.outputs, results)}
    arrays.update(outputs)
    return outputs


def _to_torch(array: np.ndarray):
    import torch

    array = np.array(array, copy=True)  # writable, contiguous
    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_numpy(tensor, dtype: str) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy().astype(np.dtype(dtype), copy=False)


def _run_on_host(launch, *inputs):
    import torch

    from fa_torch import _launch as torch_launch

    arrays = {name: _to_torch(a) for name, a in zip(launch.inputs, inputs)}
    outputs = torch_launch.run(launch, arrays, torch.device("cpu"))
    return tuple(_to_numpy(outputs[o.name], o.dtype) for o in launch.outputs)
