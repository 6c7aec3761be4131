"""fa_jax against fa_torch on the GPU: the same kernels, so any gap is the launch path.

Times forward and forward+backward of one problem, causal and not, through
* fa_torch (``triton.testing.do_bench``, median),
* fa_jax with each GPU launcher (``FA_JAX_LAUNCHER``: "custom_call", the default, launches
  Triton's own binary on XLA's stream; "jax_triton" goes through jax_triton 0.3.1, when
  installed), timed two ways: back-to-back jitted calls from a Python loop, and N calls
  inside one jitted ``fori_loop`` (no Python between launches),
and checks that each fa_jax launcher gives fa_torch's bits.

    python benchmarks/launch_compare.py [--shape 4,4096,16,16,128] [--iters 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import fa_kernels  # noqa: E402,F401
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fa_jax  # noqa: E402
import fa_torch  # noqa: E402
from fa_jax import _launch as jax_launch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench import bench_jitted_loop  # noqa: E402


def tflops(shape, causal, mode, ms):
    batch, seqlen, heads_q, _, head_dim = shape
    f = 4 * batch * heads_q * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd+bwd" else 1.0) / (ms * 1e-3) / 1e12


def torch_side(shape, causal, inputs):
    import triton.testing

    q, k, v, dout = (torch.from_numpy(x).cuda().bfloat16() for x in inputs)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa_torch.attention(*leaves, causal=causal)
    out.backward(dout)
    result = {"out": out.detach().cpu(), "grads": [x.grad.cpu() for x in leaves]}

    def fwd():
        with torch.no_grad():
            fa_torch.attention(q, k, v, causal=causal)

    def both():
        for x in leaves:
            x.grad = None
        fa_torch.attention(*leaves, causal=causal).backward(dout)

    result["fwd"] = triton.testing.do_bench(fwd, warmup=100, rep=500, return_mode="median")
    result["fwd+bwd"] = triton.testing.do_bench(both, warmup=100, rep=500, return_mode="median")
    return result


def jax_side(shape, causal, inputs, iters):
    q, k, v, dout = (jnp.asarray(x, jnp.bfloat16) for x in inputs)

    def fwd(q, k, v, dout):
        return fa_jax.attention(q, k, v, causal=causal)

    def both(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: fa_jax.attention(q, k, v, causal=causal), q, k, v)
        return vjp(dout)

    result = {"out": np.asarray(jax.jit(fwd)(q, k, v, dout).astype(jnp.float32)),
              "grads": [np.asarray(g.astype(jnp.float32)) for g in jax.jit(both)(q, k, v, dout)]}
    for mode, fn in (("fwd", fwd), ("fwd+bwd", both)):
        step = jax.jit(fn)
        jax.block_until_ready(step(q, k, v, dout))
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(iters):
                res = step(q, k, v, dout)
            jax.block_until_ready(res)
            rounds.append((time.perf_counter() - start) / iters * 1e3)
        result[mode] = statistics.median(rounds)

        result[mode + " (jitted loop)"] = bench_jitted_loop(fn, (q, k, v, dout), iters)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,4096,16,16,128", help="B,S,Hq,Hk,D")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    batch, seqlen, heads_q, heads_k, head_dim = shape
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((batch, seqlen, h, head_dim), dtype=np.float32)
              for h in (heads_q, heads_k, heads_k, heads_q)]
    launchers = ["custom_call"]
    try:
        jax_launch._jax_triton()  # (restores TRITON_CACHE_DIR, which jax_triton clears)
        launchers.append("jax_triton")
    except Exception as exc:  # noqa: BLE001
        print(f"jax_triton not usable here: {type(exc).__name__}: {exc}"[:200])
    rows = []
    for causal in (False, True):
        t = torch_side(shape, causal, inputs)
        rows.append(("fa_torch", causal, t["fwd"], t["fwd+bwd"], "", ""))
        for launcher in launchers:
            os.environ[jax_launch.LAUNCHER_ENV] = launcher
            # the launcher is chosen at trace time: drop every cached trace
            jax.clear_caches()
            for cached in (fa_jax.ops._differentiable, fa_jax.ops.forward_op,
                           fa_jax.ops.backward_op, fa_jax.ops._partitioned_op):
                cached.cache_clear()
            j = jax_side(shape, causal, inputs, args.iters)
            same_out = np.array_equal(j["out"], t["out"].float().numpy())
            same_grads = all(np.array_equal(a, b.float().numpy())
                             for a, b in zip(j["grads"], t["grads"]))
            parity = f"out {'bitwise' if same_out else 'DIFFERS'}, grads " \
                     f"{'bitwise' if same_grads else 'DIFFER'}"
            rows.append((f"fa_jax [{launcher}]", causal, j["fwd"], j["fwd+bwd"],
                         f"{j['fwd (jitted loop)']:.3f} / {j['fwd+bwd (jitted loop)']:.3f}", parity))
        os.environ.pop(jax_launch.LAUNCHER_ENV, None)
    print(f"\nshape B,S,Hq,Hk,D = {shape}, bf16; ms (TFLOP/s)")
    print("| impl | causal | fwd | fwd+bwd | jitted loop fwd / fwd+bwd (ms) | parity with fa_torch |")
    print("|---|---|---|---|---|---|")
    for name, causal, f, b, loop, parity in rows:
        print(f"| {name} | {causal} | {f:.3f} ({tflops(shape, causal, 'fwd', f):.0f}) | "
              f"{b:.3f} ({tflops(shape, causal, 'fwd+bwd', b):.0f}) | {loop} | {parity} |")


if __name__ == "__main__":
    main()
