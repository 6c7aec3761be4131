"""Host time per call: where a small attention call spends its microseconds.

On a problem so small that the GPU finishes each kernel long before the next launch,
the time per call of a loop of N calls is the host's time per call. Each row peels
off one layer: the public function, the torch custom op, our implementation behind
it, the plan, Triton's launcher, and torch SDPA's C++ path for comparison; then jitted
fa_jax beside jax's cuDNN attention.

    python benchmarks/overhead.py [--calls 2000] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_kernels  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fa_torch  # noqa: E402
from fa_kernels import plan as fa_plan  # noqa: E402
from fa_kernels import registry  # noqa: E402
from fa_torch import _launch, ops  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true",
                        help="then profile where a fwd+bwd call's host time goes")
    args = parser.parse_args()
    # Without a GPU (TRITON_INTERPRET=1) the script runs on the CPU: a smoke test of it.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, 128, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scale = 64 ** -0.5
    op_args = ops.forward_arguments(q=q, k=k, v=v, softmax_scale=scale)
    problem = ops.problem_of(q, k, v)
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(q.device),
                               q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride())
    arrays = {"q": q, "k": k, "v": v}
    outputs = {"out": torch.empty_like(q),
               "lse": torch.empty(problem.lse_shape, device=device, dtype=torch.float32),
               "lse_lo": torch.empty(problem.lse_shape, device=device, dtype=torch.float32)}
    launch = fwd.launch
    kernel = fa_kernels.kernel(launch.kernel)
    triton_args = ([arrays.get(n, _launch.placeholder(q.device)) for n in launch.inputs]
                   + list(registry.scalar_arguments(launch))
                   + [outputs[o.name] for o in launch.outputs])
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.constexprs)
    if device == "cuda":  # the raw-kernel rows launch descriptor kernels outside the launcher
        import triton

        triton.set_allocator(_launch.scratch)
    compiled = kernel[launch.grid](*triton_args, **options)
    bound = dict(zip(kernel.arg_names, triton_args))
    bound.update(launch.constexprs)
    ordered = [bound[name] for name in kernel.arg_names]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        fa_torch.attention(*leaves).backward(dout)

    def sdpa_fwd_bwd():
        for x in leaves:
            x.grad = None
        F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves)).backward(
            dout.transpose(1, 2))

    out, lse, lse_lo = ops.attention_forward(*op_args)
    bwd_args = (dout, q, k, v, out, lse, lse_lo, scale)  # (the rest: their defaults)

    class Identity(torch.autograd.Function):  # the cost of any Python backward node
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def identity_fwd_bwd(x):
        x.grad = None
        Identity.apply(x).backward(x)

    def on_calling_thread(fn):  # the backward without autograd's device-thread hand-off
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()
        return run

    cuda_leaf = torch.ones(4, device=device, requires_grad=True)
    cpu_leaf = torch.ones(4, requires_grad=True)

    rows = [
        ("fa_torch.attention (forward)", lambda: fa_torch.attention(q, k, v)),
        ("custom op fa_torch::attention_forward", lambda: ops.attention_forward(*op_args)),
        ("its implementation, called directly", lambda: ops.attention_forward._init_fn(*op_args)),
        ("problem_of + forward_plan (cached)", lambda: fa_plan.forward_plan(
            ops.problem_of(q, k, v), capability=(9, 0), q_strides=q.stride(),
            k_strides=k.stride(), v_strides=v.stride())),
        ("_launch.run (allocate + Triton launch)", lambda: _launch.run(launch, dict(arrays), q.device)),
        ("Triton kernel[grid](...)", lambda: kernel[launch.grid](*triton_args, **options)),
        *((("Triton CompiledKernel[grid](...)", lambda: compiled[launch.grid](*ordered)),)
          if compiled is not None else ()),
        ("torch SDPA (forward)", lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))),
        ("custom op fa_torch::attention_backward", lambda: ops.attention_backward(*bwd_args)),
        ("its implementation, called directly", lambda: ops.attention_backward._init_fn(*bwd_args)),
        ("fa_torch fwd+bwd (autograd)", fwd_bwd),
        ("fa_torch fwd+bwd, autograd multithreading off", on_calling_thread(fwd_bwd)),
        (f"identity autograd.Function fwd+bwd, {device} tensor", lambda: identity_fwd_bwd(cuda_leaf)),
        ("identity autograd.Function fwd+bwd, CPU tensor", lambda: identity_fwd_bwd(cpu_leaf)),
        ("torch SDPA fwd+bwd", sdpa_fwd_bwd),
        ("torch SDPA fwd+bwd, autograd multithreading off", on_calling_thread(sdpa_fwd_bwd)),
    ]
    print(f"| call ({args.calls} calls, B=1 S=128 H=2 D=64 bf16) | host us per call |")
    print("|---|---|")
    for name, fn in rows:
        with torch.set_grad_enabled("fwd+bwd" in name):
            us = per_call_us(fn, args.calls)
        print(f"| {name} | {us:.1f} |", flush=True)
    for name, us in jax_rows(args.calls) if device == "cuda" else ():
        print(f"| {name} | {us:.1f} |", flush=True)
    if args.profile:
        profile(fwd_bwd, lambda: ops.attention_backward._init_fn(*bwd_args), args.calls)


def profile(fwd_bwd, backward_impl, calls):
    """Where a fwd+bwd's host time goes: the time inside the backward op as autograd's
    device thread runs it, against the whole call; then the Python profile of the
    backward implementation called directly."""
    import cProfile
    import pstats

    inside = []
    op = ops.attention_backward

    def timed(*a):
        start = time.perf_counter()
        try:
            return op(*a)
        finally:
            inside.append(time.perf_counter() - start)

    ops.attention_backward = timed  # _backward looks the op up at call time
    try:
        with torch.enable_grad():
            whole = per_call_us(fwd_bwd, calls)
    finally:
        ops.attention_backward = op
    inside_us = sum(inside[20:]) / max(1, len(inside) - 20) * 1e6
    print(f"\nfwd+bwd {whole:.1f} us per call, of which {inside_us:.1f} us inside "
          f"attention_backward (autograd's thread)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        backward_impl()
    sync()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch.enable_grad(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            fwd_bwd()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def jax_rows(calls):
    """Jitted fa_jax and jax's cuDNN attention: XLA's dispatch of a compiled call (fa_jax's
    kernels launch from jaxlib's Triton custom call, no Python per launch)."""
    import jax
    import jax.numpy as jnp

    import fa_jax

    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 128, 2, 64), jnp.bfloat16)
               for i in range(3))
    out = []
    for name, fn in (("fa_jax.attention, jitted (forward)", fa_jax.attention),
                     ("jax.nn.dot_product_attention cuDNN, jitted", lambda q, k, v:
                      jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))):
        step = jax.jit(fn)
        for _ in range(20):
            result = step(q, k, v)
        jax.block_until_ready(result)
        start = time.perf_counter()
        for _ in range(calls):
            result = step(q, k, v)
        jax.block_until_ready(result)
        out.append((name, (time.perf_counter() - start) / calls * 1e6))
    return out


if __name__ == "__main__":
    main()
