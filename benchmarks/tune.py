"""Pick block sizes, warps and stages for ``kernels/configs.py`` on the GPU.

For each (kernel, head dim, dtype) it times candidate configs on a representative
problem (fa_torch's launcher, `triton.testing.do_bench`, median), checks each candidate
against the float64 reference (a config that is fast and wrong is dropped), and prints
the winners as table entries to paste into ``configs.py``.

    python benchmarks/tune.py [--head-dims 64,128,256] [--dtypes bfloat16,float32]
    python benchmarks/tune.py --smoke     # tiny problem, one candidate: checks the script
                                          # (the interpreter ignores the GPU table)
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_kernels  # noqa: E402,F401
import torch  # noqa: E402

import fa_torch  # noqa: E402
from fa_kernels import configs, runtime  # noqa: E402
from tests.reference import attention_reference  # noqa: E402

KERNELS = ("forward", "dkdv", "dq")


def candidates(kernel: str, head_dim: int, dtype: str, smoke: bool):
    if smoke:
        return [configs.TileConfig(32, 32, 4, 1)]
    blocks_m = (64, 128) if kernel != "dkdv" else (16, 32, 64)
    blocks_n = (32, 64, 128) if kernel != "dq" else (16, 32, 64)
    out = []
    for bm, bn, warps, stages in itertools.product(blocks_m, blocks_n, (4, 8), (1, 2, 3, 4)):
        tile_bytes = (bm + 2 * bn) * head_dim * (4 if dtype == "float32" else 2)
        if tile_bytes * max(stages, 1) > 200 * 1024:  # would not fit in shared memory
            continue
        out.append(configs.TileConfig(bm, bn, warps, stages))
    return out


def table_for(dtype: str) -> dict:
    return configs._GPU_32BIT if dtype == "float32" else configs._GPU_16BIT


def measure(kernel, head_dim, dtype, cfg, shape, device):
    """(ms, ok) for one config of one kernel, on the problem ``shape``."""
    import triton.testing

    batch, seqlen, heads = shape
    table = table_for(dtype)
    saved = table[(kernel, head_dim)]
    table[(kernel, head_dim)] = cfg
    try:
        gen = torch.Generator().manual_seed(0)
        tdtype = getattr(torch, dtype)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, generator=gen).to(tdtype).to(device)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn(q.shape, generator=gen).to(tdtype).to(device)
        out = fa_torch.attention(q, k, v, causal=True)
        out.backward(dout)
        ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), causal=True)
        ok = (out.double() - ref).abs().max().item() < (0.05 if dtype != "float32" else 1e-4)
        if kernel == "forward":
            step = lambda: fa_torch.attention(q, k, v, causal=True)  # noqa: E731
        else:
            def step():
                q.grad = k.grad = v.grad = None
                fa_torch.attention(q, k, v, causal=True).backward(dout)
        if runtime.interpreting():
            step()
            return 0.0, ok
        return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"), ok
    except Exception as exc:  # noqa: BLE001  (a config the compiler rejects: out of resources)
        print(f"  {kernel} D={head_dim} {dtype} {cfg}: {type(exc).__name__}", file=sys.stderr)
        return float("inf"), False
    finally:
        table[(kernel, head_dim)] = saved


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = "cpu" if runtime.interpreting() else "cuda"
    lines = []
    for dtype in args.dtypes.split(","):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            shape = (1, 64, 1) if args.smoke else (4, 4096, max(1, 2048 // head_dim))
            for kernel in KERNELS:
                results = [(measure(kernel, head_dim, dtype, cfg, shape, device), cfg)
                           for cfg in candidates(kernel, head_dim, dtype, args.smoke)]
                good = [(ms, cfg) for (ms, ok), cfg in results if ok]
                if not good:
                    lines.append(f"# {kernel} D={head_dim} {dtype}: no candidate passed")
                    continue
                ms, best = min(good, key=lambda r: r[0])
                lines.append(f'("{kernel}", {head_dim}): TileConfig({best.block_m}, {best.block_n}, '
                             f'{best.num_warps}, {best.num_stages}),  # {dtype} {ms:.3f} ms')
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
