"""One attention problem through fa_torch, fa_jax and the float64 reference.

Prints the error of each front end against float64 (next to plain torch in the same
dtype, the yardstick), the largest difference between the two front ends, and the
time of each. On a GPU at a real size; on the CPU (Triton's interpreter) a small one.

    make demo            # or: python examples/parity_demo.py [--causal] [--dtype float16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_kernels  # noqa: E402,F401  (interpreter on, if there is no GPU, before triton loads)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fa_jax  # noqa: E402
import fa_torch  # noqa: E402
from fa_kernels import runtime  # noqa: E402
from tests.common import from_numpy, to_numpy  # noqa: E402
from tests.reference import attention_reference  # noqa: E402


def timed(fn, repeats):
    fn()  # warm-up: compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    on_gpu = not runtime.interpreting()
    device = torch.device("cuda" if on_gpu else "cpu")
    shape = (4, 2048, 16, 2, 128) if on_gpu else (1, 128, 4, 2, 64)  # B, S, Hq, Hk, D
    batch, seqlen, heads_q, heads_k, head_dim = shape
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen, heads_q, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(batch, seqlen, heads_k, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(batch, seqlen, heads_k, head_dim, generator=gen).to(dtype).to(device)

    truth, _ = attention_reference(q, k, v, causal=args.causal)
    plain, _ = attention_reference(q, k, v, causal=args.causal, compute_dtype=dtype)

    def run_torch():
        out = fa_torch.attention(q, k, v, causal=args.causal)
        if on_gpu:
            torch.cuda.synchronize()
        return out

    jq, jk, jv = (jnp.asarray(to_numpy(x)) for x in (q, k, v))
    jax_fn = jax.jit(lambda q, k, v: fa_jax.attention(q, k, v, causal=args.causal))

    def run_jax():
        return jax_fn(jq, jk, jv).block_until_ready()

    repeats = 20 if on_gpu else 2
    t_torch = timed(run_torch, repeats)
    t_jax = timed(run_jax, repeats)
    out_torch = run_torch().cpu()
    out_jax = from_numpy(run_jax())

    def err(x):
        return (x.double() - truth.double().cpu()).abs().max().item()

    where = f"GPU ({torch.cuda.get_device_name()})" if on_gpu else "CPU (Triton interpreter)"
    print(f"attention forward, {args.dtype}, causal={args.causal}, on {where}")
    print(f"q ({batch}, {seqlen}, {heads_q}, {head_dim}), k and v ({batch}, {seqlen}, {heads_k}, {head_dim})")
    print()
    print(f"| {'implementation':<26} | {'max |err| vs float64':>20} | {'time (ms)':>10} |")
    print(f"|{'-' * 28}|{'-' * 22}|{'-' * 12}|")
    print(f"| {'fa_torch.attention':<26} | {err(out_torch):>20.3e} | {t_torch * 1e3:>10.3f} |")
    print(f"| {'fa_jax.attention (jit)':<26} | {err(out_jax):>20.3e} | {t_jax * 1e3:>10.3f} |")
    print(f"| {'plain torch, ' + args.dtype:<26} | {err(plain.cpu()):>20.3e} | {'':>10} |")
    diff = (out_torch.double() - out_jax.double()).abs().max().item()
    print()
    print(f"max |fa_torch - fa_jax| = {diff:.3e}  (bitwise equal: {torch.equal(out_torch, out_jax)})")
    if diff != 0.0:
        sys.exit("fa_torch and fa_jax disagree")


if __name__ == "__main__":
    main()
