"""Run a plan's launches on jax arrays.

* GPU: ``jax_triton.triton_call``. jax_triton compiles the kernel with Triton's own
  compiler at lowering time and jaxlib launches it from the custom call
  ``triton_kernel_call`` (0.4: ``triton_kernel_call_ffi``) on XLA's stream. jax_triton
  marks no scalar argument divisible by 16 where Triton's JIT (fa_torch) does; the
  kernels carry that knowledge themselves (``fa_kernels.helpers.kernel`` and
  ``aligned``), so both front ends compile the same PTX and get the same bits. What
  differs between jax-triton releases is in ``jax_triton_release`` alone. Tensor
  descriptors (TMA) come from the host, as ``jax_triton.TensorDescriptor`` (0.4); no
  release can run kernels that build them on the device inside a jitted program
  (``plan_options``), so those launches (varlen) and every launch under 0.3.1 read the
  same tiles through plain pointers. jax-triton hands XLA PTX, which XLA assembles with its own ptxas, often
  older than the one Triton carries: the PTX is written for the older of the two
  (``xla_ptx_version``).
* CPU: the same kernel in Triton's interpreter, as an XLA FFI call (``fa_jax_interpret``)
  whose handler is a Python function reached through ctypes: it wraps XLA's buffers as
  ``fa_kernels.interpreter.HostArray`` (no torch) and launches. An error in the launch
  returns to XLA as an FFI error, which jax raises to the caller.

Both lower to custom calls found by name, so the op survives ``custom_partitioning``
(jax drops host callbacks lowered inside a partitioner), which is how sharded inputs run
per shard without gathers (``_sharding.py``).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import threading
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_kernels import runtime

CPU_TARGET = "fa_jax_interpret"


def on_gpu() -> bool:
    return not runtime.interpreting()


@functools.lru_cache(maxsize=None)
def capability():
    """What the plan keys its configs on: the GPU's (major, minor), or None on the CPU."""
    if not on_gpu():
        return None
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as error:  # a GPU host running jax on its CPU (JAX_PLATFORMS=cpu)
        raise RuntimeError(
            "fa_kernels found a CUDA GPU and compiles the kernels for it, but jax has no GPU "
            "backend here; to run fa_jax on CPU devices, set TRITON_INTERPRET=1 before "
            "anything imports triton (the kernels then run in Triton's interpreter)") from error
    major, minor = str(device.compute_capability).split(".")
    return int(major), int(minor)


def num_sms():
    """The GPU's multiprocessor count, as fa_torch reads it (libcuda, device 0: the plan is
    made at trace time, before a device is known); None on the CPU (no split-KV)."""
    return runtime.multiprocessors(0) if on_gpu() else None


def plan_options() -> dict:
    """What the launch path adds to a plan request: on the GPU, no tensor descriptors
    built on the device. They need global scratch. jax-triton 0.3.1 gives none; 0.4
    has jaxlib allocate it with cuMemAllocAsync inside each launch, from a handler it
    marks safe for XLA's command buffers (CUDA graphs), and a graph holding allocation
    nodes cannot be nested: a jitted training step fails with CUDA_ERROR_NOT_SUPPORTED
    ("Failed to create a child graph node"). Descriptors made on the host need none:
    0.4 takes them (``jax_triton.TensorDescriptor``), 0.3.1 does not. In the
    interpreter, the table's choice."""
    if not on_gpu():
        return {}
    if jax_triton_release().host_descriptors:
        return {"device_descriptors": False}
    return {"tma": False}


# The Gluon forward is a warp-specialised kernel: its load warp comes on top of the
# compute partition's num_warps (12 warps launched for num_warps 8). jax-triton 0.4.1 can
# launch neither it nor any warp-specialised kernel as Triton compiles it (NOTES 41): it
# launches the num_warps it was given, not the compiled total (``.reqntid 384``), and it
# compiles Gluon source through the plain language's passes instead of Triton's Gluon
# stage (other PTX than fa_torch's: more wgmma waits, 32 KB more shared memory). fa_jax
# plans the Triton forward until a jax-triton compiles and launches Gluon as Triton does.
LAUNCHES_GLUON = False


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
        results = _triton_call(launch, shapes, inputs)
    else:
        results = _interpret_call(launch, shapes, inputs)
    outputs = {o.name: r for o, r in zip(launch.outputs, results)}
    arrays.update(outputs)
    return outputs


def export_checks() -> list:
    """What ``jax.export.export(..., disabled_checks=...)`` needs for a function that calls
    fa_jax: its custom call is not one of jax's stable targets. A module exported on the
    GPU holds the kernels as PTX for that GPU's capability; one exported on the CPU needs
    ``import fa_jax`` in the process that runs it (the target is registered on import)."""
    target = jax_triton_release().target if on_gpu() else CPU_TARGET
    return [jax.export.DisabledSafetyCheck.custom_call(target)]


# ------------------------------------------------------------------------- the GPU


class JaxTritonRelease(NamedTuple):
    """What fa_jax uses that changed between jax-triton releases."""
    module: object
    version: tuple
    out_keyword: str      # 0.4 renamed out_shape= to out_type=
    backend_options: bool  # 0.4 passes compiler options (ptx_version) through to Triton
    target: str           # the custom call jaxlib's CUDA plugin registers (0.4: an FFI one)
    host_descriptors: bool  # 0.4 takes jax_triton.TensorDescriptor arguments


@functools.lru_cache(maxsize=None)
def jax_triton_release() -> JaxTritonRelease:
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError as error:
        raise ImportError("fa_jax on a GPU launches through jax-triton: pip install "
                          "'flash-attention-jax-torch[jax]' (or jax-triton)") from error
    # jax_triton clears TRITON_CACHE_DIR on import (0.3.1 sets it to "", 0.4 deletes it),
    # after which Triton's JIT (fa_torch's) no longer finds the user's cache: put it back.
    if cache_dir is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    version = tuple(int(part) for part in jax_triton.__version__.split(".")[:2])
    new = version >= (0, 4)
    return JaxTritonRelease(jax_triton, version,
                            out_keyword="out_type" if new else "out_shape", backend_options=new,
                            target=getattr(jax_triton.triton_lib, "CUSTOM_CALL_TARGET_NAME",
                                           "triton_kernel_call"),
                            host_descriptors=hasattr(jax_triton, "TensorDescriptor"))


def ptxas_releases() -> list:
    """The CUDA releases ("13.0") of the ptxas binaries XLA may assemble PTX with: the
    ``--xla_gpu_cuda_data_dir`` flag, the NVIDIA wheels beside jaxlib, $PATH, $CUDA_HOME
    and /usr/local/cuda. Triton's own ptxas (inside the triton package) is not one."""
    flag = re.search(r"--xla_gpu_cuda_data_dir=(\S+)", os.environ.get("XLA_FLAGS", ""))
    roots = [flag.group(1)] if flag else []
    wheels = importlib.util.find_spec("nvidia")
    for folder in (wheels.submodule_search_locations if wheels else []):
        roots += sorted(glob.glob(os.path.join(folder, "*")))
    on_path = shutil.which("ptxas")
    roots += [os.path.dirname(os.path.dirname(on_path))] if on_path else []
    roots += [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    releases = []
    for path in dict.fromkeys(os.path.join(root, "bin", "ptxas") for root in roots if root):
        try:  # a file that cannot run (another machine's binary) is not a ptxas XLA uses
            printed = subprocess.run([path, "--version"], capture_output=True, text=True,
                                     timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        found = re.search(r"release (\d+\.\d+)", printed)
        releases += [found.group(1)] if found else []
    return releases


@functools.lru_cache(maxsize=None)
def xla_ptx_version(arch: int) -> int:
    """The PTX ISA version to write for sm_``arch``: Triton's choice (from the ptxas it
    carries), lowered to what the oldest ptxas XLA may use accepts (one older than CUDA
    12 is not: XLA refuses it), or the driver when there is none (XLA then has the
    driver assemble PTX). Triton 3.9 writes PTX 9.4, which CUDA 13.0's ptxas refuses."""
    from triton.backends.nvidia import compiler

    ours = compiler.ptx_get_version(compiler.get_ptxas(arch).version)
    releases = [r for r in ptxas_releases() if int(r.split(".")[0]) >= 12]
    if not releases and runtime.driver_cuda_version():
        releases = [runtime.driver_cuda_version()]
    return min([ours] + [compiler.ptx_get_version(r) for r in releases])


def _triton_call(launch, shapes, inputs):
    from fa_kernels import plan as fa_plan
    from fa_kernels import registry

    release = jax_triton_release()
    host = launch.constexprs.get("HOST_TMA")
    if launch.constexprs.get("USE_TMA") and not host:
        raise ValueError(f"{launch.kernel}: this launch builds tensor descriptors on the device, "
                         "whose global scratch jax-triton "
                         f"{'.'.join(map(str, release.version))} cannot give inside a jitted "
                         "program; plan it with fa_jax._launch.plan_options()")
    if host and not release.host_descriptors:
        raise ValueError(f"{launch.kernel}: this launch reads through tensor descriptors made "
                         f"on the host, which jax-triton {'.'.join(map(str, release.version))} "
                         "cannot pass; plan it with fa_jax._launch.plan_options()")

    # jax_triton passes a Python float as fp64: the kernels take fp32.
    scalars = [np.float32(s) if isinstance(s, float) else s
               for s in registry.scalar_arguments(launch)]
    # (0.3.1 has no TensorDescriptor; its launches never ask for one: checked above.)
    blocks = fa_plan.block_arguments(launch, inputs,
                                     getattr(release.module, "TensorDescriptor", None))
    # 0.3.1 takes no compiler options; its Triton (3.6) writes PTX that CUDA 12.8 accepts.
    major, minor = capability()
    options = ({"backend_options": {"ptx_version": xla_ptx_version(major * 10 + minor)}}
               if release.backend_options else {})
    with warnings.catch_warnings():
        # 0.4 deprecates zeroed_outputs in favour of Refs but still zeroes: one call
        # serves both releases, and outputs stay plain results.
        warnings.filterwarnings("ignore", "zeroed_outputs is deprecated", DeprecationWarning)
        return release.module.triton_call(
            *inputs, *blocks, *scalars, kernel=registry.KERNELS[launch.kernel],
            grid=launch.grid, num_warps=launch.num_warps, num_stages=launch.num_stages,
            zeroed_outputs=tuple(i for i, o in enumerate(launch.outputs) if o.zeroed),
            name=launch.kernel, **{release.out_keyword: shapes}, **options, **launch.constexprs)


# ------------------------------------------------------------------------- the CPU


def _interpret_call(launch, shapes, inputs):
    # Outputs that must start as zeros alias a zero-filled operand.
    zeros = [jnp.zeros(s.shape, s.dtype) for s, o in zip(shapes, launch.outputs) if o.zeroed]
    operands = inputs + zeros
    aliases = {len(inputs) + j: i for j, i in
               enumerate(i for i, o in enumerate(launch.outputs) if o.zeroed)}
    description = json.dumps({"launch": launch.to_json(),
                              "operands": [[list(x.shape), jnp.dtype(x.dtype).name]
                                           for x in operands]})
    call = jax.ffi.ffi_call(_register_cpu_target(), shapes, input_output_aliases=aliases)
    return call(*operands, launch=description)


# The XLA FFI C API (xla/ffi/api/c_api.h), the parts a handler touches. Its ABI is
# versioned and stable: structs only grow at the end.
class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _ApiVersion), ("internal_api", ctypes.c_void_p),
                ("error_create", ctypes.CFUNCTYPE(ctypes.c_void_p,
                                                  ctypes.POINTER(_ErrorCreateArgs)))]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("items", ctypes.POINTER(ctypes.POINTER(_Buffer)))]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("attrs", ctypes.POINTER(ctypes.c_void_p))]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.POINTER(_ExtensionBase)),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _List), ("rets", _List), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ATTR_STRING = 4
_ERROR_INTERNAL = 13
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))

_REGISTERED: list = []  # the ctypes handler, alive for the life of the process
_REGISTER_LOCK = threading.Lock()


def _register_cpu_target() -> str:
    """Register the interpreter's FFI target once in this process; return its name."""
    with _REGISTER_LOCK:
        if not _REGISTERED:
            # Everything the handler needs is imported now: it may run late (XLA runs
            # asynchronously), even at interpreter exit, when imports can fail.
            from fa_kernels import interpreter, launcher, plan, registry  # noqa: F401

            handler = _HANDLER(_interpret)
            jax.ffi.register_ffi_target(CPU_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
            _REGISTERED.append(handler)
            atexit.register(_drain)
    return CPU_TARGET


def _drain() -> None:
    """At exit, wait for computations still in flight: their calls need the GIL, which
    the interpreter's finalisation would hold while it waits for them."""
    try:
        jax.block_until_ready(jax.live_arrays())
    except Exception:  # noqa: BLE001  (an array already deleted, a backend gone)
        pass


@functools.lru_cache(maxsize=4096)
def _decode(description: bytes):
    from fa_kernels import plan

    desc = json.loads(description)
    return plan.Launch.from_json(desc["launch"]), [(tuple(s), d) for s, d in desc["operands"]]


def _string_attribute(frame: _CallFrame) -> bytes:
    attrs = frame.attrs
    if attrs.size != 1 or attrs.types[0] != _ATTR_STRING:
        raise RuntimeError("fa_jax_interpret takes one string attribute, the launch")
    span = ctypes.cast(attrs.attrs[0], ctypes.POINTER(_ByteSpan)).contents
    return ctypes.string_at(span.ptr, span.len)


def _interpret(frame_pointer):
    """The FFI handler: XLA_FFI_Error* (XLA_FFI_CallFrame*). NULL is success."""
    frame = frame_pointer.contents
    try:
        extension = frame.extension_start
        if extension and extension.contents.type == _EXTENSION_METADATA:
            # XLA asks which API version the handler was written for: the one it runs.
            metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension)).contents
            version = frame.api.contents.api_version
            metadata.metadata.contents.api_version.major_version = version.major_version
            metadata.metadata.contents.api_version.minor_version = version.minor_version
            metadata.metadata.contents.traits = 0
            return None
        if frame.stage != _STAGE_EXECUTE:
            return None
        from fa_kernels import launcher
        from fa_kernels.interpreter import HostArray

        launch, operands = _decode(_string_attribute(frame))
        inputs = [HostArray(frame.args.items[i].contents.data, shape, dtype)
                  for i, (shape, dtype) in enumerate(operands[:len(launch.inputs)])]
        outputs = [HostArray(frame.rets.items[j].contents.data, o.shape, o.dtype)
                   for j, o in enumerate(launch.outputs)]
        launcher.launch(launch, inputs, outputs, None)
        return None
    except BaseException as error:  # noqa: BLE001  (nothing may unwind into XLA)
        return _error(frame, error)


def _error(frame: _CallFrame, error: BaseException):
    """An XLA_FFI_Error for ``error``: XLA fails the computation, jax raises it."""
    message = f"fa_jax: a kernel launch failed in Triton's interpreter: " \
              f"{type(error).__name__}: {error}"
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None,
                            message.encode("utf-8", "replace"), _ERROR_INTERNAL)
    return frame.api.contents.error_create(ctypes.byref(args))


if not on_gpu():
    _register_cpu_target()  # before any call: a deserialised export may need it first
