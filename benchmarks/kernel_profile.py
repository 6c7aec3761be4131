"""The workload ``scripts/gpu_session.sh profile`` hands to Nsight Compute (ncu): a few
fwd+bwd calls of fa_torch at one shape, so that ncu can read the hardware counters of
each kernel (pipe use, stall reasons, occupancy) at the table's config.

    python benchmarks/kernel_profile.py [--shape 4,4096,16,16,128] [--causal] [--calls 3]

Alone it only runs the calls; the counters come from ncu around it (see gpu_session.sh).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import fa_torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,4096,16,16,128", help="B,S,Hq,Hk,D")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    batch, seqlen, heads_q, heads_k, head_dim = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=dtype,
                           generator=gen, requires_grad=name == "q") for name in ("q", "dout"))
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", dtype=dtype,
                        generator=gen, requires_grad=True) for _ in range(2))
    for _ in range(args.calls):
        fa_torch.attention(q, k, v, causal=args.causal).backward(dout)
    torch.cuda.synchronize()
    print(f"ran {args.calls} fwd+bwd calls at {args.shape} causal={args.causal}")


if __name__ == "__main__":
    main()
