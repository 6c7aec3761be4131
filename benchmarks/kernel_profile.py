"""The workload ``scripts/gpu_session.sh profile`` hands to Nsight Compute (ncu): a few
fwd+bwd calls of fa_torch at one shape, so that ncu can read the hardware counters of
each kernel (pipe use, stall reasons, occupancy) at the table's config.

    python benchmarks/kernel_profile.py [--shape 4,4096,16,16,128] [--causal] [--calls 3]
                                        [--forward] [--gluon [--ping-pong]]

``--forward`` runs forward calls only; ``--gluon`` takes the Gluon forward wherever it
serves (sm_90; the tables of ``bench.py --gluon``): its kernel is
``attention_forward_gluon``, so the profile step needs
``PROFILE_KERNELS="attention_forward_gluon$"``; ``--ping-pong`` with its two compute
warpgroups taking the tensor cores in turns.

Alone it only runs the calls; the counters come from ncu around it (see gpu_session.sh).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import fa_torch  # noqa: E402
from bench import gluon_tables  # noqa: E402  (bench.py --gluon's tables)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,4096,16,16,128", help="B,S,Hq,Hk,D")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--forward", action="store_true", help="forward calls only")
    parser.add_argument("--gluon", action="store_true", help="the Gluon forward (sm_90)")
    parser.add_argument("--ping-pong", action="store_true",
                        help="with --gluon: its warpgroups in turns")
    args = parser.parse_args()
    batch, seqlen, heads_q, heads_k, head_dim = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=dtype,
                           generator=gen, requires_grad=name == "q") for name in ("q", "dout"))
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", dtype=dtype,
                        generator=gen, requires_grad=True) for _ in range(2))
    tables = gluon_tables(ping_pong=args.ping_pong) if args.gluon else contextlib.nullcontext()
    with tables:
        for _ in range(args.calls):
            out = fa_torch.attention(q, k, v, causal=args.causal)
            if not args.forward:
                out.backward(dout)
    torch.cuda.synchronize()
    mode = "fwd" if args.forward else "fwd+bwd"
    print(f"ran {args.calls} {mode} calls at {args.shape} causal={args.causal} gluon={args.gluon} "
          f"ping_pong={args.ping_pong}")


if __name__ == "__main__":
    main()
