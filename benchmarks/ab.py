"""A/B of kernel variants in one process: the plan's launch of one kernel, timed as is and
with constexprs overridden, on the bench shapes (GPU), with the outputs compared.

    python benchmarks/ab.py --kernel forward --variant USE_TMA=0 [--variant FOLD_SCALE=0 ...]
                            [--shape 4,4096,16,16,128,0 ...] [--dtype bfloat16]

Each ``--variant`` is NAME=VALUE[,NAME=VALUE...] (ints; 0/1 for flags; not what the grid
is cut by: BLOCK_M of the forward and dQ, BLOCK_N and DKDV_PARTS of dK/dV; HOST_TMA=0
makes the plan's host descriptors on the device). The first row of each shape is the
plan's own launch; the others print their time and the largest
difference of their outputs from it (the same arithmetic in another order gives ~1 ulp).
Inputs, launches and the outputs compared are tune.py's. Without a GPU it runs the
interpreter on a small shape (a check of the script, no times).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from bench import parse_shape  # noqa: E402
from tune import CHECKED, KERNELS, inputs_for, launch_of  # noqa: E402

from fa_kernels import plan, runtime  # noqa: E402
from fa_torch import _launch  # noqa: E402


def parse_variant(text: str) -> dict:
    out = {}
    for item in text.split(","):
        name, value = item.split("=")
        out[name.strip()] = int(value)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", choices=KERNELS, default="forward")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--shape", action="append", default=[],
                        help="B,S,Hq,Hk,D,causal or B,Sq,Sk,Hq,Hk,D,causal")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    gpu = not runtime.interpreting()
    device = "cuda" if gpu else "cpu"
    capability = _launch.capability(torch.device(device))
    shapes = args.shape or (["4,4096,16,16,128,0", "4,4096,16,16,128,1", "4,4096,32,32,64,0",
                             "4,4096,32,32,64,1"] if gpu else ["1,200,2,2,64,1"])
    variants = [{}] + [parse_variant(v) for v in args.variant]
    rows = []
    for spec in shapes:
        batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal = parse_shape(spec)
        q_shape = (batch, seqlen_q, heads_q, head_dim)
        kv_shape = (batch, seqlen_k, heads_k, head_dim)
        p = plan.check_problem(q_shape, kv_shape, kv_shape, args.dtype, args.dtype, args.dtype,
                               causal=causal)
        arrays = inputs_for(p, capability, device=device)
        launch = launch_of(args.kernel, p, capability)
        first = None
        for variant in variants:
            constexprs = {**launch.constexprs, **variant}
            # HOST_TMA=0: the descriptors the plan made on the host are made on the device.
            blocks = (launch.blocks if constexprs.get("HOST_TMA")
                      else tuple(b.plain() for b in launch.blocks))
            trial = dataclasses.replace(launch, constexprs=constexprs, blocks=blocks)
            outputs = _launch.run(trial, dict(arrays), torch.device(device))
            values = [outputs[name].float() for name in CHECKED[args.kernel]]
            first = first or values
            diff = max(float((a - b).abs().nan_to_num(0.0).max()) for a, b in zip(values, first))
            ms = float("nan")
            if gpu:
                import triton.testing

                ms = triton.testing.do_bench(
                    lambda: _launch.run(trial, dict(arrays), torch.device(device)),
                    warmup=50, rep=300, return_mode="median")
            label = ",".join(f"{k}={v}" for k, v in variant.items()) or "plan"
            rows.append((spec, label, ms, diff))
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"| shape | {args.kernel} variant | ms | max diff from the plan's |")
    print("|---|---|---|---|")
    for spec, label, ms, diff in rows:
        print(f"| {spec} | {label} | {ms:.3f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
