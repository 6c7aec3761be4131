"""Run a plan's launches on torch tensors (CUDA, or CPU through the interpreter)."""
from __future__ import annotations

import torch

from fa_kernels import runtime

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "int8": torch.int8, "int32": torch.int32}

_PLACEHOLDERS: dict = {}


_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def capability(device: torch.device):
    """What the plan keys its configs on: (major, minor), or None for the interpreter."""
    if runtime.interpreting():
        return None
    return torch.cuda.get_device_capability(device)


def num_sms(device: torch.device):
    """The GPU's multiprocessor count (split-KV sizes its grid by it); None for the
    interpreter, which never splits."""
    if runtime.interpreting():
        return None
    return runtime.multiprocessors(device.index if device.index is not None
                                   else torch.cuda.current_device())


def placeholder(device: torch.device) -> torch.Tensor:
    """What stands in for an input the problem does not use (its flag is off)."""
    key = str(device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[key]


def run(launch, arrays: dict, device: torch.device) -> dict:
    """Allocate the launch's outputs, launch it, return them by name (adds to ``arrays``)."""
    outputs = {o.name: (torch.zeros if o.zeroed else torch.empty)(
        o.shape, dtype=TORCH_DTYPES[o.dtype], device=device) for o in launch.outputs}
    launch_into(launch, arrays, outputs, device)
    arrays.update(outputs)
    return outputs


def launch_into(launch, arrays: dict, outputs: dict, device: torch.device) -> None:
    """Launch into given output tensors (zeroed ones already zero). Inputs by name;
    an input that is absent or None gets the placeholder."""
    if launch.empty:
        return
    inputs = [arrays[name] if arrays.get(name) is not None else placeholder(device)
              for name in launch.inputs]
    results = [outputs[o.name] for o in launch.outputs]
    from fa_kernels import launcher

    if runtime.interpreting():
        launcher.launch(launch, inputs, results, None)
        return
    current = torch.cuda.current_device()
    if device.index is None or device.index == current:  # the usual case: no device switch
        launcher.launch(launch, inputs, results, current, scratch)
    else:
        with torch.cuda.device(device):
            launcher.launch(launch, inputs, results, device.index, scratch)


def scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Device scratch for kernels that build tensor descriptors (128 bytes each a program),
    from torch's caching allocator on the current device and stream."""
    return torch.empty(size, dtype=torch.int8, device="cuda")
