"""The PTX of Triton's JIT (fa_torch) against jax_triton's (fa_jax), built on the GPU.

Runs one forward+backward through fa_jax (jitted; jax_triton writes each kernel's PTX
under JAX_TRITON_DUMP_DIR) and the same plan's launches through fa_torch's launcher
(Triton's JIT), both with fa_jax's plan options (tensor descriptors made on the host with
jax-triton 0.4, none with 0.3.1; never built on the device, whose scratch no jax-triton
release gives inside a jitted program), then prints for the forward and
the backward's dK/dV and dQ passes the instruction counts of each PTX (``fa_kernels.offline.ptx_counts``), the spills the same ptxas reports for
each, whether the code is the same, and whether the outputs are bitwise equal.

    python benchmarks/ptx_compare.py [--shape 4,4096,16,16,128] [--causal]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
DUMP = tempfile.mkdtemp(prefix="jax_triton_ptx_")
os.environ["JAX_TRITON_DUMP_DIR"] = DUMP  # read when jax_triton is imported
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import fa_kernels  # noqa: E402,F401
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import fa_jax  # noqa: E402
from fa_jax import _launch as jax_launch  # noqa: E402
from fa_kernels import launcher, offline  # noqa: E402
from fa_kernels import plan as fa_plan  # noqa: E402
from fa_torch import _launch as torch_launch  # noqa: E402

KERNELS = ("attention_forward", "attention_backward (dK dV)", "attention_backward (dQ)")


def kernel_pass(launch) -> str:
    """A row's name: the kernel and, for the backward, which of its two passes."""
    if launch.kernel != "attention_backward":
        return launch.kernel
    return f"{launch.kernel} ({'dQ' if launch.constexprs['DQ_PASS'] else 'dK dV'})"


def spills(ptx: str, arch: str) -> str:
    """'stack / spill stores / spill loads' bytes, as Triton's bundled ptxas reports them."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        report = subprocess.run([tool, "-v", f"--gpu-name={arch}", source.name, "-o", os.devnull],
                                capture_output=True, text=True).stderr
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      report)
    return "/".join(found.groups()) if found else "?"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,4096,16,16,128", help="B,S,Hq,Hk,D")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    batch, seqlen, heads_q, heads_k, head_dim = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((batch, seqlen, h, head_dim), dtype=np.float32)
                     for h in (heads_q, heads_k, heads_k, heads_q))

    # fa_jax: jax_triton compiles (and dumps) each kernel at lowering.
    jq, jk, jv, jdout = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, dout))
    out, vjp = jax.vjp(lambda q, k, v: fa_jax.attention(q, k, v, causal=args.causal), jq, jk, jv)
    jax_results = [out, *vjp(jdout)]

    # fa_torch's launcher: the same plans (fa_jax's options) through Triton's JIT.
    problem = fa_plan.check_problem(q.shape, k.shape, v.shape, "bfloat16", "bfloat16",
                                    "bfloat16", causal=args.causal)
    device = torch.device("cuda")
    capability = torch_launch.capability(device)
    options = jax_launch.plan_options()
    fwd = fa_plan.forward_plan(problem, capability=capability,
                               num_sms=torch_launch.num_sms(device), **options)
    bwd = fa_plan.backward_plan(problem, capability=capability, **options)
    arrays = {name: torch.from_numpy(x).to(device, torch.bfloat16)
              for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    arrays["dlse"] = torch.zeros(problem.lse_shape, dtype=torch.float32, device=device)
    for launch in (*fwd.launches, *bwd.launches):
        torch_launch.run(launch, arrays, device)
    torch_results = [arrays[name] for name in ("out", "dq", "dk", "dv")]
    bitwise = {name: np.array_equal(np.asarray(j.astype(jnp.float32)),
                                    t.float().cpu().numpy())
               for name, j, t in zip(("out", "dq", "dk", "dv"), jax_results, torch_results)}

    jit_ptx = {kernel_pass(launch): compiled.asm["ptx"]
               for launch, compiled, *_ in launcher._COMPILED.values()}
    # jax_triton names a dump by its kernel; the backward's two passes were compiled in
    # launch order (dK dV, then dQ), so their files' times tell them apart.
    jax_ptx, seen = {}, {}
    for path in sorted(glob.glob(os.path.join(DUMP, "*", "*.ptx")), key=os.path.getmtime):
        kernel = os.path.basename(path)[:-4]
        names = [k for k in KERNELS if k.split(" ")[0] == kernel] or [kernel]
        index = seen.get(kernel, 0)
        seen[kernel] = index + 1
        jax_ptx[names[min(index, len(names) - 1)]] = open(path).read()
    arch = f"sm_{capability[0]}{capability[1]}{'a' if capability[0] >= 9 else ''}"
    print(f"\nB,S,Hq,Hk,D = {args.shape}, bf16, causal={args.causal}, {arch}; PTX counts "
          f"{' / '.join(offline.ptx_counts(''))}; ptxas stack / spill stores / spill loads (B)")
    print("| kernel | Triton JIT (fa_torch) | jax_triton (fa_jax) | same PTX |")
    print("|---|---|---|---|")
    for kernel in KERNELS:
        row = []
        for ptx in (jit_ptx.get(kernel), jax_ptx.get(kernel)):
            if ptx is None:
                row.append("(not built)")
                continue
            counts = " / ".join(str(n) for n in offline.ptx_counts(ptx).values())
            row.append(f"{counts}; {spills(ptx, arch)}")
        same = (kernel in jit_ptx and kernel in jax_ptx
                and offline.ptx_body(jit_ptx[kernel]) == offline.ptx_body(jax_ptx[kernel]))
        print(f"| {kernel} | {row[0]} | {row[1]} | {'yes' if same else 'NO'} |")
    print("outputs bitwise equal: " + ", ".join(f"{n} {'yes' if b else 'NO'}"
                                                 for n, b in bitwise.items()))


if __name__ == "__main__":
    main()
