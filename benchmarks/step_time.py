"""End-to-end training step time of the language-model examples, our attention against
each framework's own, on the GPU.

    python benchmarks/step_time.py [--size gpu] [--steps 20] [--out DIR]

torch (examples/torch_lm.py): ``ours`` (fa_torch) and ``native`` (torch SDPA, whichever
backend it picks). Flax (examples/flax_lm.py, one jitted step): ``ours`` (fa_jax),
``native`` (``jax.nn.dot_product_attention`` choosing its implementation), ``cudnn``,
``xla``.
Each: a few warm-up steps (compiles), then the mean of ``--steps`` back-to-back steps.
Prints a markdown table (also written to DIR/STEP_TIME.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and jax share the GPU

import fa_kernels  # noqa: E402,F401
from lm_common import SIZES, batches, load_text  # noqa: E402


def torch_step_time(config, attention, steps, warmup=3):
    import torch

    import torch_lm

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch_lm.LanguageModel(config, attention).to(device)
    _, step = torch_lm.make_step(model, device)
    data = batches(load_text()[0], config, seed=0)
    inputs = [tuple(torch.from_numpy(a).to(device) for a in next(data))
              for _ in range(warmup + steps)]
    for x, y in inputs[:warmup]:
        step(x, y, config.lr)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in inputs[warmup:]:
        loss = step(x, y, config.lr)
    loss.item()
    return (time.perf_counter() - start) / steps


def flax_step_time(config, attention, steps, warmup=3):
    import jax
    import jax.numpy as jnp

    import flax_lm

    model = flax_lm.LanguageModel(config, attention, jnp.bfloat16)
    init, step, _ = flax_lm.make_step(model)
    params, opt_state = init(jax.random.PRNGKey(0))
    data = batches(load_text()[0], config, seed=0)
    inputs = [tuple(jnp.asarray(a) for a in next(data)) for _ in range(warmup + steps)]
    lr = jnp.float32(config.lr)
    for x, y in inputs[:warmup]:
        params, opt_state, loss = step(params, opt_state, x, y, lr)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for x, y in inputs[warmup:]:
        params, opt_state, loss = step(params, opt_state, x, y, lr)
    jax.block_until_ready(loss)
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.dirname(__file__)))
    args = parser.parse_args()
    config = SIZES[args.size]
    runs = [("torch", "ours"), ("torch", "native"), ("flax", "ours"), ("flax", "native"),
            ("flax", "cudnn"), ("flax", "xla")]
    times = {}
    for framework, attention in runs:
        fn = torch_step_time if framework == "torch" else flax_step_time
        try:
            times[framework, attention] = fn(config, attention, args.steps)
        except Exception as exc:  # noqa: BLE001  (a native implementation this shape lacks)
            print(f"{framework} {attention}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        print(f"{framework} {attention}: {times.get((framework, attention), float('nan')) * 1e3:.1f} ms/step",
              file=sys.stderr, flush=True)
    tokens = config.batch * config.seqlen
    lines = [f"Training step of the example LM ({config.layers} layers, embed {config.embed}, "
             f"{config.heads} heads over {config.kv_heads} K/V heads, seqlen {config.seqlen}, "
             f"batch {config.batch}, bf16 compute), mean of {args.steps} steps after warm-up.",
             "", "| framework | attention | ms / step | tokens / s | time / time of ours |",
             "|---|---|---|---|---|"]
    for (framework, attention), seconds in times.items():
        ours = times.get((framework, "ours"))
        ratio = f"{seconds / ours:.2f}x" if ours and attention != "ours" else ""
        lines.append(f"| {framework} | {attention} | {seconds * 1e3:.1f} | "
                     f"{tokens / seconds:,.0f} | {ratio} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "STEP_TIME.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
