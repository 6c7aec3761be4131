"""The kernels compile for Hopper (sm_90) and Ampere (sm_80) on any machine.

The interpreter runs the kernels' arithmetic, not Triton's compiler: this compiles a grid
of plan variants (every kernel, features, packed GQA and split-KV, tensor-descriptor
loads) with Triton's compiler and bundled ptxas, in a subprocess with the interpreter off,
and checks each kernel's shared memory against the device's limit.
"""
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("capability", ["9.0", "8.0"])
def test_every_variant_compiles(capability):
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, "-m", "fa_kernels.offline", "--quick",
                             "--capability", capability],
                            env=env, capture_output=True, text=True, timeout=900)
    lines = result.stdout.splitlines()
    failed = [line for line in lines if "FAIL" in line]
    assert result.returncode == 0 and not failed, "\n".join(failed) or result.stderr[-3000:]
    assert lines[-1] == "0 failed"
    # every variant's launches compiled (sm_80 takes D = 128 only: no descriptors there)
    assert sum(" ok" in line for line in lines) >= (40 if capability == "9.0" else 30)
    # the Gluon forward among them where the plan can take it (sm_90), in its
    # warp-specialised form (offline.check fails one that is not)
    gluon = [line for line in lines if "attention_forward_gluon" in line]
    if capability == "9.0":
        assert len(gluon) >= 4
    else:
        assert not gluon


def test_jax_triton_compiles_the_jit_ptx():
    # fa_jax's launches (jax_triton: no scalar marked divisible) and fa_torch's (Triton's
    # JIT) compile to the same PTX for sm_90, split-KV's partial results and combine
    # included: the same speed and the same bits.
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, "-m", "fa_kernels.offline", "--compare-launchers",
                             "--quick"], env=env, capture_output=True, text=True, timeout=900)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[-1].endswith("; 0 differ"), \
        result.stdout[-3000:] + result.stderr[-3000:]
    # forward, preprocess, dK/dV, dQ: plain, causal GQA, and split-KV (+ its combine)
    assert sum("same PTX" in line for line in lines) == 13


def test_ptx_comparison_ignores_where_the_source_lies():
    # Triton's cache key holds no path: a kernel cached from another checkout carries other
    # .file/.loc lines and must still compare equal; a changed instruction must not.
    from fa_kernels.offline import ptx_body

    def ptx(root, line, op):
        return (f".version 8.7\n.visible .entry attention_forward(\n\t.param .u64 "
                f"attention_forward_param_0\n)\n{{\n\t.loc\t1 {line} 4\n$L__tmp0:\n\t{op} "
                f"%r1, %r2, %r3;\n\tret;\n}}\n\t.file\t1 \"{root}/kernels/fa_kernels/forward.py\"\n"
                f"\t.section\t.debug_info\n\t{{\n.b8 {len(root)}\n\t}}\n")

    here = ptx("/work/main", 58, "add.s32")
    assert ptx_body(here) == ptx_body(ptx("/check/work/main", 61, "add.s32"))
    assert ptx_body(here) != ptx_body(ptx("/work/main", 58, "sub.s32"))
    assert "attention_forward_param_0" not in ptx_body(here) and "param_0" in ptx_body(here)
