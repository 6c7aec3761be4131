"""The warp-specialised kernels against the plain ones, through fa_torch (benchmarks/NOTES.md 36).

For each shape, three ways to run the same call: the plain kernels (the tables as they
are); attention_forward_ws and attention_backward_dkdv_ws (the forward and dK/dV entries
asking for them, allowed on the GPU); and the same two kernels compiled with their loop
unspecialised (``WARP_SPECIALIZE=False``: the same source, no producer/consumer split).
Each row says how far the output and the gradients are from the plain kernels' (the
share of NaN, the largest difference beside the largest plain value) and the times
(``triton.testing.do_bench``, median): the forward alone, and the backward alone.

Where the unspecialised loop matches the plain kernels and the specialised one does not,
the arithmetic is right and the specialisation is not; that is what decides whether
``plan.WARP_SPECIALIZED_ON_GPU`` may be turned on for a Triton release.

    python benchmarks/warp_specialized.py [--shape B,S,Hq,Hk,D,causal]... [--stages N]

Without a GPU it runs in Triton's interpreter, untimed (small shapes: ``--shape
1,128,2,1,64,1``), which checks the script, not the compiled kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

import torch  # noqa: E402

import fa_torch  # noqa: E402
from fa_kernels import configs  # noqa: E402
from fa_kernels import plan as fa_plan  # noqa: E402

from bench import warp_specialized_tables  # noqa: E402

SHAPES = ["4,4096,16,16,64,0", "4,4096,16,16,128,0", "4,4096,16,16,128,1",
          "4,4096,32,8,128,0", "4,2048,8,8,256,0"]
WS_LAUNCHES = ("_forward_ws_launch", "_dkdv_ws_launch")


@contextlib.contextmanager
def unspecialized():
    """The warp-specialised launches with WARP_SPECIALIZE=False (the loop compiled plain)."""
    originals = {name: getattr(fa_plan, name) for name in WS_LAUNCHES}

    def plain_loop(make):
        def launch(*args, **kwargs):
            made = make(*args, **kwargs)
            return dataclasses.replace(made, constexprs=dict(made.constexprs,
                                                             WARP_SPECIALIZE=False))
        return launch

    for name, make in originals.items():
        setattr(fa_plan, name, plain_loop(make))
    fa_plan._drop_cached_plans()
    try:
        yield
    finally:
        for name, make in originals.items():
            setattr(fa_plan, name, make)
        fa_plan._drop_cached_plans()


def variant(name: str, stages: int | None):
    """The tables and plan for one way of running: "plain", "ws" or "ws unspecialised"."""
    stack = contextlib.ExitStack()
    if name != "plain":
        stack.enter_context(warp_specialized_tables())
        if stages is not None:
            stack.enter_context(configs.override(("forward_ws", "dkdv_ws"), num_stages=stages))
        if name == "ws unspecialised":
            stack.enter_context(unspecialized())
    return stack


def kernels_chosen(q, k, v, causal):
    """The forward and dK/dV kernels fa_torch's plan takes for this call, as it plans."""
    from fa_torch import _launch

    problem = fa_plan.check_problem(tuple(q.shape), tuple(k.shape), tuple(v.shape), "bfloat16",
                                    "bfloat16", "bfloat16", causal=causal)
    capability = torch.cuda.get_device_capability() if q.is_cuda else None
    forward = fa_plan.forward_plan(problem, capability=capability,
                                   num_sms=_launch.num_sms(q.device)).launch
    dkdv = fa_plan.backward_plan(problem, capability=capability).dkdv
    return f"{forward.kernel} / {dkdv.kernel}"


def difference(ours: torch.Tensor, plain: torch.Tensor) -> str:
    nan = torch.isnan(ours)
    diff = torch.where(nan, 0.0, (ours.float() - plain.float()).abs()).max().item()
    return f"{nan.float().mean().item():.0%} NaN, {diff:.2g} of {plain.abs().max().item():.2g}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", default=[],
                        help="B,S,Hq,Hk,D,causal (repeatable); replaces the default list")
    parser.add_argument("--stages", type=int, default=None,
                        help="the warp-specialised entries' num_stages (default: the tables')")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from triton.testing import do_bench

    def timed(fn):
        return do_bench(fn, return_mode="median") if device == "cuda" else float("nan")

    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU (interpreter)'}, "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}, bf16")
    print("| B | S | Hq | Hk | D | causal | run | kernels | out | dq | dk | dv | fwd ms | bwd ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.shape or SHAPES:
        batch, seqlen, heads_q, heads_k, head_dim, causal = (int(x) for x in spec.split(","))
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
                         for shape in ((batch, seqlen, heads_q, head_dim),
                                       (batch, seqlen, heads_k, head_dim),
                                       (batch, seqlen, heads_k, head_dim),
                                       (batch, seqlen, heads_q, head_dim)))
        leaves = [x.requires_grad_() for x in (q, k, v)]
        plain = None
        for name in ("plain", "ws", "ws unspecialised"):
            with variant(name, args.stages):
                chosen = kernels_chosen(q, k, v, bool(causal))
                out = fa_torch.flash_attn_func(*leaves, causal=bool(causal))
                grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
                with torch.no_grad():
                    fwd = timed(lambda: fa_torch.flash_attn_func(q, k, v, causal=bool(causal)))
                bwd = timed(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
            results = (out.detach(), *grads)
            if plain is None:
                plain = results
            cells = ["" if name == "plain" else difference(r, p) for r, p in zip(results, plain)]
            print(f"| {batch} | {seqlen} | {heads_q} | {heads_k} | {head_dim} | {bool(causal)} "
                  f"| {name} | {chosen} | {' | '.join(cells)} | {fwd:.3f} | {bwd:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
