"""Host time per call: where a small attention call spends its microseconds.

On a problem so small that the GPU finishes each kernel long before the next launch,
the time per call of a loop of N calls is the host's time per call. Each row peels
off one layer: the public function, the torch custom op, our implementation behind
it, the plan, Triton's launcher, and torch SDPA's C++ path for comparison; then jitted
fa_jax beside jax's cuDNN attention.

    python benchmarks/overhead.py [--calls 2000]
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
from fa_torch import _launch, ops  # noqa: E402


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scale = 64 ** -0.5
    op_args = (q, k, v, None, None, None, None, None, 0, 0, False, scale, -1, -1, 0.0, 0.0)
    problem = ops.problem_of(q, k, v)
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(q.device),
                               q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride())
    arrays = {"q": q, "k": k, "v": v}
    outputs = {"out": torch.empty_like(q),
               "lse": torch.empty(problem.lse_shape, device="cuda", dtype=torch.float32)}
    launch = fwd.launch
    kernel = fa_kernels.kernel(launch.kernel)
    triton_args = ([arrays.get(n, _launch.placeholder(q.device)) for n in launch.inputs]
                   + list(launch.scalars) + [outputs[o.name] for o in launch.outputs])
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.constexprs)
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

    rows = [
        ("fa_torch.attention (forward)", lambda: fa_torch.attention(q, k, v)),
        ("custom op fa_torch::attention_forward", lambda: ops.attention_forward(*op_args)),
        ("its implementation, called directly", lambda: ops.attention_forward._init_fn(*op_args)),
        ("problem_of + forward_plan (cached)", lambda: fa_plan.forward_plan(
            ops.problem_of(q, k, v), capability=(9, 0), q_strides=q.stride(),
            k_strides=k.stride(), v_strides=v.stride())),
        ("_launch.run (allocate + Triton launch)", lambda: _launch.run(launch, dict(arrays), q.device)),
        ("Triton kernel[grid](...)", lambda: kernel[launch.grid](*triton_args, **options)),
        ("Triton CompiledKernel[grid](...)", lambda: compiled[launch.grid](*ordered)),
        ("torch SDPA (forward)", lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))),
        ("fa_torch fwd+bwd (autograd)", fwd_bwd),
        ("torch SDPA fwd+bwd", sdpa_fwd_bwd),
    ]
    print(f"| call ({args.calls} calls, B=1 S=128 H=2 D=64 bf16) | host us per call |")
    print("|---|---|")
    for name, fn in rows:
        with torch.set_grad_enabled("fwd+bwd" in name):
            us = per_call_us(fn, args.calls)
        print(f"| {name} | {us:.1f} |", flush=True)
    for name, us in jax_rows(args.calls):
        print(f"| {name} | {us:.1f} |", flush=True)


def jax_rows(calls):
    """Jitted fa_jax and jax's cuDNN attention: XLA dispatch plus, for fa_jax, the
    custom call's handler (Python) that launches the kernel."""
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
