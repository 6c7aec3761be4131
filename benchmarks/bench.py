"""fa_torch and fa_jax beside the peers on the GPU: TFLOP/s, forward and forward+backward.

Peers present on the machine are measured in the same run: torch SDPA (flash, cuDNN,
memory-efficient backends), ``jax.nn.dot_product_attention`` (cuDNN and XLA) and
Pallas' Triton attention. FLOPs follow flash-attn: 4*B*H*Sq*Sk*D for the forward,
halved when causal; forward+backward counts 3.5x the forward. Each time is the median
of many runs after warm-up, on random inputs.

    python benchmarks/bench.py [--quick] [--window W]... [--peers a,b] [--memory]
                               [--warp-specialize]
                               [--gluon [--gluon-tile BM,BN,W,S] [--gluon-ping-pong]]
                               [--shape B,S,Hq,Hk,D,causal | B,Sq,Sk,Hq,Hk,D,causal]...
                               [--out benchmarks]            # RESULTS.md, bench.png

With ``--window W`` (repeatable) fa_torch and fa_jax are also timed with a sliding
window; their TFLOP/s still count the dense FLOPs, so a rising number means falling
time. ``--peers`` keeps only the peers whose names contain one of the given words
(fa_torch and fa_jax always run). ``--warp-specialize`` adds fa_torch (and fa_jax where
jax-triton takes host descriptors) with attention_forward_ws and
attention_backward_dkdv_ws, the one-loop kernels for Triton's Hopper warp
specialisation, wherever they serve. ``--gluon`` adds fa_torch with the Gluon forward
(fa_kernels.gluon_forward: sm_90) wherever it serves, ``--gluon-tile`` with that tile
at every head dim (64,64,4,2: two programs an SM, plan.gluon_programs_per_sm),
``--gluon-ping-pong`` with its two warpgroups taking the tensor cores in turns; fa_jax
cannot launch it (fa_jax._launch.LAUNCHES_GLUON). ``--memory`` adds a table of peak device memory of
forward+backward against the sequence length (it must grow linearly).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and jax share the GPU

import fa_kernels  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fa_torch  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # progress bar is a nicety
    def tqdm(x, **_):
        return x


def flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, mode):
    f = 4 * batch * heads * seqlen_q * seqlen_k * head_dim * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


REP_MS = int(os.environ.get("FA_BENCH_REP_MS", 500))  # time per measurement, after warm-up


def bench_torch(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(25, REP_MS // 5), rep=REP_MS,
                                   return_mode="median")


def time_loop(call, sync, rounds=9, round_ms=25.0):
    """Median over rounds of (wall time of back-to-back calls and one final sync) / calls,
    in ms: what a training loop sees, host time between launches included. A round holds
    at least 20 calls and about ``round_ms`` of work, so that the dispatch of its first
    call and the final sync weigh little even for calls of a fraction of a millisecond.
    ``sync(result)`` waits for the device. fa_jax is timed this way (jax has no
    per-launch events), and fa_torch too, so that the two front ends compare alike."""
    sync(call())
    start = time.perf_counter()
    for _ in range(3):
        out = call()
    sync(out)
    estimate = (time.perf_counter() - start) / 3 * 1e3
    reps = max(20, math.ceil(round_ms / max(estimate, 1e-3)))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = call()
        sync(out)
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def bench_jax(fn, args):
    import jax

    return time_loop(lambda: fn(*args), jax.block_until_ready)


def jitted_loop(fn, iters):
    """``fn(q, k, v, dout)`` called ``iters`` times inside one jitted ``fori_loop``: no
    Python between the launches. One element of every result feeds the next call's q,
    so XLA can neither hoist a call out of the loop nor drop one as dead code."""
    import jax
    import jax.numpy as jnp

    def looped(q, k, v, dout):
        def body(i, carry):
            q, acc = carry
            for leaf in jax.tree_util.tree_leaves(fn(q, k, v, dout)):
                acc = acc + leaf[0, 0, 0, 0].astype(jnp.float32)
            return q.at[0, 0, 0, 0].set((acc * 0).astype(q.dtype) + q[0, 0, 0, 0]), acc
        return jax.lax.fori_loop(0, iters, body, (q, jnp.float32(0)))[1]
    return jax.jit(looped)


def bench_jitted_loop(fn, args, iters, rounds=5):
    """ms a call of ``fn`` inside one jitted loop of ``iters`` calls (median of rounds)."""
    import jax

    loop = jitted_loop(fn, iters)
    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------------- torch side


def torch_impls():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ours(q, k, v, causal):
        return fa_torch.attention(q, k, v, causal=causal)

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        return run

    impls = {"fa_torch": (ours, "bshd")}
    for name, backend in (("torch SDPA flash (FA2)", SDPBackend.FLASH_ATTENTION),
                          ("torch SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("torch SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)):
        impls[name] = (sdpa(backend), "bhsd")
    return impls


def run_torch_impl(fn, layout, shape, dtype, causal, mode, loop=False):
    """{"ms": do_bench's median, "peak": GiB, and with ``loop`` "loop_ms": the same
    calls timed as fa_jax is (``time_loop``)}."""
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(s, h):
        if layout == "bhsd":  # SDPA wants (B, H, S, D) contiguous: pass a transposed view of it
            return torch.randn(batch, h, s, head_dim, device="cuda", dtype=dtype,
                               generator=gen).transpose(1, 2).requires_grad_(mode != "fwd")
        return torch.randn(batch, s, h, head_dim, device="cuda", dtype=dtype,
                           generator=gen).requires_grad_(mode != "fwd")

    q, k, v = make(seqlen_q, heads_q), make(seqlen_k, heads_k), make(seqlen_k, heads_k)
    dout = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v, causal)
    else:
        def step():
            q.grad = k.grad = v.grad = None
            fn(q, k, v, causal).backward(dout)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = {"ms": bench_torch(step), "peak": torch.cuda.max_memory_allocated() / 2 ** 30}
    if loop:
        result["loop_ms"] = time_loop(step, lambda _: torch.cuda.synchronize())
    return result


# ------------------------------------------------------------------------------ jax side


def jax_impls():
    import jax

    import fa_jax

    impls = {"fa_jax": lambda q, k, v, causal: fa_jax.attention(q, k, v, causal=causal)}
    for name, impl in (("jax cuDNN", "cudnn"), ("jax XLA", "xla")):
        impls[name] = (lambda impl: lambda q, k, v, causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl))(impl)
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        def pallas(q, k, v, causal):
            if q.shape[2] != k.shape[2]:
                rep = q.shape[2] // k.shape[2]
                k, v = (jax.numpy.repeat(x, rep, axis=2) for x in (k, v))
            return pallas_attention.mha(q, k, v, segment_ids=None, causal=causal,
                                        sm_scale=q.shape[-1] ** -0.5)
        impls["Pallas (Triton) mha"] = pallas
    except Exception as exc:  # noqa: BLE001
        print(f"Pallas attention not available: {exc}", file=sys.stderr)
    return impls


def run_jax_impl(fn, shape, dtype, causal, mode, jitted=False):
    """{"ms": ``time_loop``'s median, and with ``jitted`` "jit_loop_ms": a call inside
    one jitted loop}."""
    import jax
    import jax.numpy as jnp

    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    jdtype = jnp.dtype(str(dtype).removeprefix("torch."))
    q = jax.random.normal(keys[0], (batch, seqlen_q, heads_q, head_dim), jdtype)
    k = jax.random.normal(keys[1], (batch, seqlen_k, heads_k, head_dim), jdtype)
    v = jax.random.normal(keys[2], (batch, seqlen_k, heads_k, head_dim), jdtype)
    dout = jax.random.normal(keys[3], q.shape, jdtype)
    if mode == "fwd":
        step = jax.jit(lambda q, k, v, dout: fn(q, k, v, causal))
    else:
        def fwd_bwd(q, k, v, dout):  # dout an argument, not a constant XLA would fold
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
            return vjp(dout)
        step = jax.jit(fwd_bwd)
    args = (q, k, v, dout)
    result = {"ms": bench_jax(step, args), "peak": float("nan")}
    if jitted:
        call = (lambda q, k, v, dout: fn(q, k, v, causal)) if mode == "fwd" else fwd_bwd
        iters = max(20, math.ceil(25.0 / max(result["ms"], 1e-3)))  # ~25 ms a round
        result["jit_loop_ms"] = bench_jitted_loop(call, args, iters)
    return result


# ---------------------------------------------------------------------------------- main


def shapes(quick):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal), B*S = 16384."""
    out = []
    seqlens = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    for head_dim, heads in ((64, 32), (128, 16)) if quick else ((64, 32), (128, 16), (256, 8)):
        for seqlen in seqlens:
            for causal in (False, True):
                out.append((16384 // seqlen, seqlen, seqlen, heads, heads, head_dim, causal))
    out.append((4, 4096, 4096, 32, 8, 128, False))  # GQA
    out.append((4, 4096, 4096, 16, 16, 128, False))  # the core issue's comparison shape
    return out


def parse_shape(spec: str):
    """B,S,Hq,Hk,D,causal (Sq = Sk) or B,Sq,Sk,Hq,Hk,D,causal."""
    values = [int(x) for x in spec.split(",")]
    if len(values) == 6:
        b, s, hq, hk, d, c = values
        return b, s, s, hq, hk, d, bool(c)
    if len(values) == 7:
        b, sq, sk, hq, hk, d, c = values
        return b, sq, sk, hq, hk, d, bool(c)
    raise SystemExit(f"--shape {spec!r}: expected 6 or 7 comma-separated integers")


def add_window_impls(t_impls, j_impls, w):
    import fa_jax

    window = lambda causal: (w, 0 if causal else w)  # noqa: E731
    t_impls[f"fa_torch window {w}"] = (
        lambda q, k, v, causal: fa_torch.attention(q, k, v, causal=causal,
                                                   window_size=window(causal)), "bshd")
    j_impls[f"fa_jax window {w}"] = (
        lambda q, k, v, causal: fa_jax.attention(q, k, v, causal=causal,
                                                 window_size=window(causal)))


def memory_table(seqlens=(8192, 16384, 32768, 65536), heads=16, head_dim=128):
    """Peak device memory of one fwd+bwd (B=1, bf16), fa_torch and fa_jax, against S.

    ``inputs`` counts q, k, v, out, dout and the three gradients (8 * S*H*D*2 bytes):
    with no S x S buffer the peak is a constant multiple of it.
    """
    import jax
    import jax.numpy as jnp

    import fa_jax

    lines = ["\n## Peak memory of forward+backward (B=1, H=16, D=128, bf16, causal)\n",
             "| S | q,k,v,o,dO,dq,dk,dv (MiB) | fa_torch peak (MiB) | fa_jax peak (MiB) "
             "| fa_torch peak / inputs |", "|---|---|---|---|---|"]
    for s in seqlens:
        shape = (1, s, heads, head_dim)
        inputs = 8 * s * heads * head_dim * 2 / 2 ** 20
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        fa_torch.attention(q, k, v, causal=True).backward(torch.randn_like(q))
        torch.cuda.synchronize()
        t_peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        del q, k, v
        torch.cuda.empty_cache()
        args = [jnp.asarray(np.random.default_rng(i).standard_normal(shape), jnp.bfloat16)
                for i in range(4)]
        step = jax.jit(lambda q, k, v, do: jax.vjp(
            lambda q, k, v: fa_jax.attention(q, k, v, causal=True), q, k, v)[1](do))
        # XLA's peak of the compiled step: temporaries + arguments + outputs.
        stats = step.lower(*args).compile().memory_analysis()
        j_peak = float("nan")
        if stats is not None:
            j_peak = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                      + stats.output_size_in_bytes) / 2 ** 20
        jax.block_until_ready(step(*args))
        del args
        lines.append(f"| {s} | {inputs:.0f} | {t_peak:.0f} | {j_peak:.0f} | {t_peak / inputs:.2f} |")
    return "\n".join(lines) + "\n"


WARP_SPECIALIZED = " ws"  # the name's ending of an impl timed with the warp-specialised kernels


def add_warp_specialized_impls(t_impls):
    """fa_torch again under the name ending WARP_SPECIALIZED: timed with every forward and
    dK/dV entry asking for attention_forward_ws and attention_backward_dkdv_ws
    (``tables_for``). Not fa_jax: jax-triton 0.4.1 launches a warp-specialised kernel
    with fewer warps than it was compiled for (NOTES 41)."""
    t_impls["fa_torch" + WARP_SPECIALIZED] = t_impls["fa_torch"]


def warp_specialized_tables() -> contextlib.ExitStack:
    """Within: every forward and dK/dV entry asks for its warp-specialised kernel, and the
    plan takes it on the GPU too."""
    from fa_kernels import configs
    from fa_kernels import plan as fa_plan

    stack = contextlib.ExitStack()
    stack.enter_context(fa_plan.warp_specialized_on_gpu())
    stack.enter_context(configs.override(("forward", "dkdv"), tma=True, warp_specialize=True))
    return stack


GLUON = " gluon"  # the name's ending of an impl timed with the Gluon forward
GLUON_TILE = None  # --gluon-tile: (block_m, block_n, num_warps, num_stages) for every D
GLUON_PING_PONG = False  # --gluon-ping-pong


def gluon_tables(tile=None, ping_pong: bool = False) -> contextlib.ExitStack:
    """Within: every forward entry asks for the Gluon forward (where it serves), with
    ``tile`` (``--gluon-tile``) in place of the table's Gluon entries if one is given,
    and its warpgroups in turns with ``ping_pong`` (``--gluon-ping-pong``)."""
    from fa_kernels import configs

    entries = {} if tile is None else {
        ("forward_gluon", block_d, dtype): configs.TileConfig(*tile, tma=True)
        for block_d in (64, 128, 256) for dtype in ("bfloat16", "float16")}
    stack = contextlib.ExitStack()
    stack.enter_context(configs.override(("forward",), entries=entries, gluon=True))
    if ping_pong:
        stack.enter_context(configs.override(("forward_gluon",), ping_pong=True))
    return stack


def tables_for(name):
    """The tables an impl is timed with: ``warp_specialized_tables`` for a
    WARP_SPECIALIZED name, ``gluon_tables`` for a GLUON one (one context around all its
    calls: the plans are made once and cached, as with the table's own entries)."""
    if name.endswith(WARP_SPECIALIZED):
        return warp_specialized_tables()
    if name.endswith(GLUON):
        return gluon_tables(GLUON_TILE, GLUON_PING_PONG)
    return contextlib.nullcontext()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--shape", action="append", default=[],
                        help="B,S,Hq,Hk,D,causal or B,Sq,Sk,Hq,Hk,D,causal (repeatable); "
                             "replaces the default list")
    parser.add_argument("--window", type=int, action="append", default=[],
                        help="also time fa_torch/fa_jax with window_size=(W, W) (W, 0 causal)")
    parser.add_argument("--peers", default="",
                        help="comma-separated words: keep only peers whose name has one")
    parser.add_argument("--warp-specialize", action="store_true",
                        help="also time fa_torch with the warp-specialised forward and "
                             "dK/dV where they serve")
    parser.add_argument("--gluon", action="store_true",
                        help="also time fa_torch with the Gluon forward where it serves")
    parser.add_argument("--gluon-tile", default=None,
                        help="BLOCK_M,BLOCK_N,WARPS,STAGES: the Gluon forward's tile at every "
                             "head dim (e.g. 64,64,4,2: two programs an SM at D <= 128)")
    parser.add_argument("--gluon-ping-pong", action="store_true",
                        help="the Gluon forward's two compute warpgroups taking the tensor "
                             "cores in turns (FA3's ping-pong; 128-row tiles)")
    parser.add_argument("--memory", action="store_true",
                        help="also report peak memory of fwd+bwd at S = 8k..64k")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    modes = args.modes.split(",")
    rows = []
    t_impls, j_impls = torch_impls(), jax_impls()
    if args.peers:
        words = args.peers.split(",")
        keep = lambda name: name in ("fa_torch", "fa_jax") or any(w in name for w in words)  # noqa: E731
        t_impls = {n: v for n, v in t_impls.items() if keep(n)}
        j_impls = {n: v for n, v in j_impls.items() if keep(n)}
    for w in args.window:
        add_window_impls(t_impls, j_impls, w)
    if args.warp_specialize:
        add_warp_specialized_impls(t_impls)
    if args.gluon:
        t_impls["fa_torch" + GLUON] = t_impls["fa_torch"]
    if args.gluon_tile:
        global GLUON_TILE
        GLUON_TILE = tuple(int(x) for x in args.gluon_tile.split(","))
    if args.gluon_ping_pong:
        global GLUON_PING_PONG
        GLUON_PING_PONG = True

    chosen = [parse_shape(spec) for spec in args.shape] or shapes(args.quick)
    work = [(s, m) for s in chosen for m in modes]
    for (b, sq, sk, hq, hk, d, causal), mode in tqdm(work, desc="bench", file=sys.stderr):
        shape = (b, sq, sk, hq, hk, d)
        result = {}
        for name, (fn, layout) in t_impls.items():
            try:
                with tables_for(name):
                    result[name] = run_torch_impl(fn, layout, shape, dtype, causal, mode,
                                                  loop=name == "fa_torch")
            except Exception as exc:  # noqa: BLE001  (a peer that cannot run this shape)
                print(f"{name} {shape} {mode}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        for name, fn in j_impls.items():
            try:
                with tables_for(name):
                    result[name] = run_jax_impl(fn, shape, dtype, causal, mode,
                                                jitted=name == "fa_jax")
            except Exception as exc:  # noqa: BLE001
                print(f"{name} {shape} {mode}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        f = flops(b, hq, sq, sk, d, causal, mode)
        rows.append(((b, sq, sk, hq, hk, d, causal, mode),
                     {n: dict(r, tflops=f / (r["ms"] * 1e-3) / 1e12) for n, r in result.items()}))
        # each row as it is timed, so a run cut short by its time limit still reports
        print(f"{rows[-1][0]}: " + ", ".join(f"{n} {r['tflops']:.0f}" for n, r in rows[-1][1].items()),
              file=sys.stderr, flush=True)
    names = list(t_impls) + list(j_impls)
    table = render(rows, names, args) + render_front_ends(rows)
    if args.memory:
        table += memory_table()
    with open(os.path.join(args.out, "RESULTS.md"), "w") as fh:
        fh.write(table)
    plot(rows, names, os.path.join(args.out, "bench.png"))
    print(table)


def render(rows, names, args):
    date = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name()
    lines = [f"# Benchmark results\n",
             f"{gpu}, {args.dtype}, {date}; torch {torch.__version__}. Command: "
             f"`python benchmarks/bench.py {' '.join(sys.argv[1:])}`.\n",
             "TFLOP/s (flash-attn convention: 4·B·H·S²·D forward, half when causal, "
             "fwd+bwd 3.5x); median of many runs after warm-up. `—`: the peer could not run it.\n"]
    header = ("| B | Sq | Sk | Hq | Hk | D | causal | mode | fa_torch ms | " + " | ".join(names)
              + " | fa_torch / FA2 | fa_torch / cuDNN |")
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for (b, sq, sk, hq, hk, d, causal, mode), res in rows:
        ms = f"{res['fa_torch']['ms']:.3f}" if "fa_torch" in res else "—"
        cells = [f"{res[n]['tflops']:.0f}" if n in res else "—" for n in names]
        ratio = lambda peer: (f"{res['fa_torch']['tflops'] / res[peer]['tflops']:.2f}"  # noqa: E731
                              if "fa_torch" in res and peer in res else "—")
        lines.append(f"| {b} | {sq} | {sk} | {hq} | {hk} | {d} | {causal} | {mode} | {ms} | "
                     + " | ".join(cells)
                     + f" | {ratio('torch SDPA flash (FA2)')} | {ratio('torch SDPA cuDNN')} |")
    return "\n".join(lines) + "\n"


def render_front_ends(rows):
    """fa_jax against fa_torch, timed alike: the same kernels, so what differs is the
    host's path to the launch. ``do_bench`` times each fa_torch call between CUDA events
    (host gaps between calls left out); fa_jax can only be timed by the wall clock
    (``time_loop``), so fa_torch is timed that way too, and inside one jitted loop."""
    lines = ["\n## fa_jax against fa_torch, timed alike\n",
             "ms a call. fa_torch: `do_bench` (CUDA events around each call) and a Python loop "
             "timed by the wall clock (`time_loop`, as fa_jax is); fa_jax: the same Python loop "
             "of jitted calls, and the calls inside one jitted `fori_loop`. Ratios are speed "
             "ratios (fa_torch ms / fa_jax ms).\n",
             "| B | Sq | Sk | Hq | Hk | D | causal | mode | fa_torch do_bench | fa_torch loop "
             "| fa_jax loop | fa_jax jitted loop | fa_jax / fa_torch, loops "
             "| fa_jax jitted loop / fa_torch loop | fa_jax loop / fa_torch do_bench |",
             "|" + "---|" * 15]
    for (b, sq, sk, hq, hk, d, causal, mode), res in rows:
        t, j = res.get("fa_torch"), res.get("fa_jax")
        if not (t and j and "loop_ms" in t):
            continue
        jit = j.get("jit_loop_ms", float("nan"))
        lines.append(f"| {b} | {sq} | {sk} | {hq} | {hk} | {d} | {causal} | {mode} "
                     f"| {t['ms']:.3f} | {t['loop_ms']:.3f} | {j['ms']:.3f} | {jit:.3f} "
                     f"| {t['loop_ms'] / j['ms']:.3f} | {t['loop_ms'] / jit:.3f} "
                     f"| {t['ms'] / j['ms']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows, names, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(d, causal, mode) for (b, sq, sk, hq, hk, d, causal, mode), _ in rows
                     if hq == hk and sq == sk})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (d, causal, mode) in zip(axes[0], panels):
        sel = [(s, res) for (b, s, sk, hq, hk, dd, c, m), res in rows
               if (dd, c, m) == (d, causal, mode) and hq == hk and s == sk and b * s == 16384]
        for name in names:
            pts = [(s, res[name]["tflops"]) for s, res in sel if name in res]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d} causal={causal} {mode}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
