"""Where the kernels run: compiled on a CUDA GPU, or in Triton's interpreter on the CPU.

No triton, torch or jax import here: this module must decide before triton is first
imported, because ``triton.jit`` picks interpreted or compiled at decoration time
(and Triton's own ``tl.*`` helpers are decorated when triton is imported).
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

INTERPRET_ENV = "TRITON_INTERPRET"


@functools.lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library (ctypes), or None on a machine without one."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """CUDA devices the driver sees (0 with no driver), asked of libcuda directly."""
    cuda = libcuda()
    if cuda is None or cuda.cuInit(0) != 0:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


@functools.lru_cache(maxsize=None)
def multiprocessors(ordinal: int = 0) -> int | None:
    """The SM count of CUDA device ``ordinal`` (what split-KV sizes its grid by), asked
    of libcuda so that both front ends read the same number; None without a GPU."""
    if cuda_device_count() <= ordinal:
        return None
    cuda = libcuda()
    device, count = ctypes.c_int(0), ctypes.c_int(0)
    multiprocessor_count = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    if (cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(count), multiprocessor_count, device) != 0):
        return None
    return count.value


@functools.lru_cache(maxsize=None)
def driver_cuda_version() -> str | None:
    """The CUDA release the driver supports, as ptxas prints one ("13.0"); None without one."""
    cuda = libcuda()
    version = ctypes.c_int(0)
    if cuda is None or cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


_decided: bool | None = None  # set once configure() has run: the answer cannot change after


def _interpret_env() -> bool:
    return os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "yes", "on")


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return _decided if _decided is not None else _interpret_env()


def configure() -> None:
    """Turn on the interpreter on a machine without a GPU, before triton is imported.

    An explicit TRITON_INTERPRET in the environment always wins. With no GPU and triton
    already imported in compiled mode, nothing can fix it from here: say what to do.
    Afterwards ``interpreting()`` answers from memory (it is asked on every launch).
    """
    global _decided
    _choose_mode()
    _decided = _interpret_env()


def _choose_mode() -> None:
    if INTERPRET_ENV in os.environ:
        return
    if cuda_device_count() > 0:
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "No CUDA GPU found, so the kernels must run in Triton's interpreter, but "
            "triton was imported before fa_kernels/fa_torch/fa_jax and is in compiled "
            "mode. Set TRITON_INTERPRET=1 in the environment before anything imports "
            "triton (or import fa_torch / fa_jax first)."
        )
    os.environ[INTERPRET_ENV] = "1"
