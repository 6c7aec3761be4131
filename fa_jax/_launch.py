"""Run a plan's launches on jax arrays, each as one XLA custom call.

The call's backend config is the launch itself (``Launch.to_json``) and the types of
its operands; its target is a Python function registered through ctypes under XLA's
custom-call ABI (api_version 0 registration):

* GPU (``fa_jax_launch``): ``void(CUstream, void** buffers, const char* opaque, size_t,
  XlaCustomCallStatus*)``. It launches Triton's own compiled kernel, the binary fa_torch
  launches (one compile cache, the same bits, the same speed), on XLA's stream.
* CPU (``fa_jax_interpret``): ``void(void* out, const void** in, const char* opaque,
  size_t, XlaCustomCallStatus*)``. It runs the same kernel in Triton's interpreter over
  the buffers (wrapped as torch tensors, bf16 through an int16 view) with fa_torch's
  launcher.

Why custom calls and not jax's callbacks (``pure_callback``, ``buffer_callback``): a
custom call target is found by name, so the op survives ``custom_partitioning`` (jax
drops host callbacks lowered inside a partitioner: the process crashes), which is how
sharded inputs run per shard without gathers (``_sharding.py``). jax_triton (0.3.1) also
lowers to a custom call, but has jaxlib assemble its own PTX, and its forward ran 3x
slower on the H200 (benchmarks/NOTES.md); ``FA_JAX_LAUNCHER=jax_triton`` keeps it for
comparison when it is installed.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import os
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import fa_kernels
from fa_kernels import plan as fa_plan
from fa_kernels import runtime

LAUNCHER_ENV = "FA_JAX_LAUNCHER"
GPU_LAUNCHERS = ("custom_call", "jax_triton")
CPU_TARGET = "fa_jax_interpret"
GPU_TARGET = "fa_jax_launch"


def on_gpu() -> bool:
    return not runtime.interpreting()


def gpu_launcher() -> str:
    """How kernels reach the GPU: "custom_call" (default) or "jax_triton"."""
    name = os.environ.get(LAUNCHER_ENV, "custom_call")
    if name not in GPU_LAUNCHERS:
        raise ValueError(f"{LAUNCHER_ENV} must be one of {GPU_LAUNCHERS}; got {name!r}")
    return name


@functools.lru_cache(maxsize=None)
def capability():
    """What the plan keys its configs on: the GPU's (major, minor), or None on the CPU."""
    if not on_gpu():
        return None
    device = jax.devices("gpu")[0]
    major, minor = str(device.compute_capability).split(".")
    return int(major), int(minor)


def num_sms():
    """The GPU's multiprocessor count, as fa_torch reads it (libcuda, device 0: the plan is
    made at trace time, before a device is known); None on the CPU (no split-KV)."""
    return runtime.multiprocessors(0) if on_gpu() else None


def placeholder():
    """What stands in for an input the problem does not use (its flag is off)."""
    return jnp.zeros((1,), jnp.float32)


def run(launch, arrays: dict) -> dict:
    """Launch one plan step on jax arrays; return its outputs by name (adds to ``arrays``)."""
    shapes = [jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs]
    inputs = [arrays[name] for name in launch.inputs]
    if launch.empty:
        results = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    elif on_gpu() and gpu_launcher() == "jax_triton":
        results = _run_jax_triton(launch, shapes, inputs)
    else:
        # Outputs that must start as zeros alias a zero-filled operand.
        zeros = [jnp.zeros(s.shape, s.dtype) for s, o in zip(shapes, launch.outputs) if o.zeroed]
        operands = inputs + zeros
        opaque = json.dumps({"launch": launch.to_json(),
                             "operands": [[list(x.shape), jnp.dtype(x.dtype).name]
                                          for x in operands]})
        aliases = {len(inputs) + j: i for j, i in
                   enumerate(i for i, o in enumerate(launch.outputs) if o.zeroed)}
        call = jax.ffi.ffi_call(_target(), shapes, custom_call_api_version=2 if on_gpu() else 3,
                                legacy_backend_config=opaque, input_output_aliases=aliases)
        results = call(*operands)
    outputs = {o.name: r for o, r in zip(launch.outputs, results)}
    arrays.update(outputs)
    return outputs


# ---------------------------------------------------------------- the call targets

_REGISTERED: dict = {}
_REGISTER_LOCK = threading.Lock()


def _target() -> str:
    """Register this process's call target once (GPU or CPU) and return its name."""
    name, platform, signature, handler = (
        (GPU_TARGET, "CUDA", _GPU_SIGNATURE, _launch_on_gpu) if on_gpu() else
        (CPU_TARGET, "cpu", _CPU_SIGNATURE, _interpret_on_cpu))
    with _REGISTER_LOCK:
        if name not in _REGISTERED:
            # Everything a handler needs is imported now: handlers may run late (XLA runs
            # asynchronously), even at interpreter exit, when imports can fail.
            import torch  # noqa: F401

            from fa_kernels import launcher, registry  # noqa: F401
            from fa_torch import _launch as torch_launch  # noqa: F401

            function = signature(handler)  # kept alive for the life of the process
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(function), platform=platform,
                                        api_version=0)
            _REGISTERED[name] = function
            atexit.register(_drain)
    return name


def _drain() -> None:
    """At exit, wait for computations still in flight: their custom calls need the GIL,
    which the interpreter's finalisation would hold while it waits for them."""
    try:
        jax.block_until_ready(jax.live_arrays())
    except Exception:  # noqa: BLE001  (an array already deleted, a backend gone)
        pass


@functools.lru_cache(maxsize=4096)
def _decode(opaque: bytes):
    desc = json.loads(opaque)
    launch = fa_plan.Launch.from_json(desc["launch"])
    return launch, [(tuple(shape), dtype) for shape, dtype in desc["operands"]]


def _report(launch, error: BaseException) -> None:
    # XLA's status setter is not reachable from Python: say what failed, and poison the
    # outputs (NaN) rather than return stale memory as a result.
    print(f"fa_jax: launching {launch.kernel if launch else '?'} failed:", flush=True)
    traceback.print_exception(error)


# GPU -----------------------------------------------------------------------------

_GPU_SIGNATURE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class _DevicePointer:
    """What Triton's launcher needs of an array: its address and its dtype."""
    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: str):
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def _device_of(address: int) -> int:
    """The CUDA ordinal owning a device address (each device runs its own calls)."""
    ordinal = ctypes.c_int(0)
    pointer_attribute_device_ordinal = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    status = runtime.libcuda().cuPointerGetAttribute(ctypes.byref(ordinal),
                                                     pointer_attribute_device_ordinal,
                                                     ctypes.c_uint64(address))
    if status != 0:
        raise RuntimeError(f"cuPointerGetAttribute failed ({status}) for address {address:#x}")
    return ordinal.value


@functools.lru_cache(maxsize=64)
def _external_stream(stream: int, device: int):
    import torch

    return torch.cuda.ExternalStream(stream, device=torch.device("cuda", device))


_SCRATCH: dict = {}  # (device, stream) -> torch int8 tensor


@functools.lru_cache(maxsize=64)
def _scratch_on(device: int, stream: int):
    """Scratch for the kernels that build tensor descriptors, launched on XLA's
    ``stream``: one buffer a stream, grown as launches need. Launches on one stream run
    one after another, so a launch may reuse the memory of the one before it, with no
    allocation a launch; a grown buffer comes from torch's allocator on that stream, so
    the memory it replaces is reused only after the launches queued there."""
    def allocate(size: int, alignment: int, _stream):
        buffer = _SCRATCH.get((device, stream))
        if buffer is None or buffer.numel() < size:
            import torch

            with torch.cuda.device(device), torch.cuda.stream(_external_stream(stream, device)):
                buffer = torch.empty(max(size, 2 * (0 if buffer is None else buffer.numel())),
                                     dtype=torch.int8, device=torch.device("cuda", device))
            _SCRATCH[(device, stream)] = buffer
        return buffer
    return allocate


def _launch_on_gpu(stream, buffers, opaque, opaque_len, status):
    launch = outputs = None
    try:
        launch, operands = _decode(ctypes.string_at(opaque, opaque_len))
        import torch

        from fa_kernels import launcher

        n_operands = len(operands)
        args = [_DevicePointer(buffers[i] or 0, dtype)
                for i, (_, dtype) in enumerate(operands[:len(launch.inputs)])]
        outputs = [_DevicePointer(buffers[n_operands + j] or 0, o.dtype)
                   for j, o in enumerate(launch.outputs)]
        device = _device_of(args[0].address)
        stream = stream or 0
        # The launch goes to XLA's stream directly (no current-stream switch); the device
        # must be current for the kernel's first load onto it.
        with (contextlib.nullcontext() if torch.cuda.current_device() == device
              else torch.cuda.device(device)):
            launcher.launch(launch, args, outputs, device, _scratch_on(device, stream), stream)
    except BaseException as error:  # noqa: BLE001  (nothing may unwind into XLA)
        _report(launch, error)
        for pointer, o in zip(outputs or [], launch.outputs if launch else []):
            nbytes = int(np.prod(o.shape)) * np.dtype(jnp.dtype(o.dtype)).itemsize
            runtime.libcuda().cuMemsetD8Async(ctypes.c_uint64(pointer.address),
                                              ctypes.c_ubyte(0xFF), ctypes.c_size_t(nbytes),
                                              ctypes.c_void_p(stream))


# CPU -----------------------------------------------------------------------------

_CPU_SIGNATURE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _host_view(address: int, shape, dtype: str) -> np.ndarray:
    """A numpy array over XLA's buffer (no copy)."""
    dtype = np.dtype(jnp.dtype(dtype))
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _as_torch(array: np.ndarray):
    import torch

    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _interpret_on_cpu(out, ins, opaque, opaque_len, status):
    launch = views = None
    try:
        launch, operands = _decode(ctypes.string_at(opaque, opaque_len))
        import torch

        from fa_torch import _launch as torch_launch

        if len(launch.outputs) == 1:
            addresses = [out]
        else:
            table = ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))
            addresses = [table[j] for j in range(len(launch.outputs))]
        views = [_host_view(a, o.shape, o.dtype) for a, o in zip(addresses, launch.outputs)]
        # Inputs are copied: the interpreter writes every argument back after a launch.
        arrays = {name: _as_torch(np.array(_host_view(ins[i], shape, dtype)))
                  for i, (name, (shape, dtype)) in enumerate(zip(launch.inputs, operands))}
        outputs = {o.name: _as_torch(v) for o, v in zip(launch.outputs, views)}
        torch_launch.launch_into(launch, arrays, outputs, torch.device("cpu"))
    except BaseException as error:  # noqa: BLE001  (nothing may unwind into XLA)
        _report(launch, error)
        for view in views or []:
            if view.dtype.kind == "f" or view.dtype == jnp.bfloat16:
                view[...] = np.nan
            else:
                view[...] = -1


# ------------------------------------------------------------ GPU: jax_triton 0.3.1


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


def _run_jax_triton(launch, shapes, inputs):
    # jax_triton 0.3.1 passes a Python float as fp64: the kernels take fp32.
    scalars = [np.float32(s) if isinstance(s, float) else s for s in launch.scalars]
    return _jax_triton().triton_call(
        *inputs, *scalars, kernel=fa_kernels.kernel(launch.kernel), out_shape=shapes,
        grid=launch.grid, num_warps=launch.num_warps, num_stages=launch.num_stages,
        zeroed_outputs=tuple(i for i, o in enumerate(launch.outputs) if o.zeroed),
        **launch.constexprs)
