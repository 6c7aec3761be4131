"""Decode against the memory limit: one query token per sequence over a full K/V cache.

For each shape it reports the bytes a decode step must move (K and V of every cached
token, q and out) divided by its time, as a fraction of the device-to-device copy
bandwidth measured in the same run on the same bytes (``dst.copy_(src)``, counted as
read + write: 2 x bytes / time). Three times per row, each the median of many runs:

* ``kernel``: the plan's launches alone (forward, and the combine with split-KV) into
  preallocated outputs, captured in a CUDA graph: no host work at all;
* ``graph``: the public call ``fa_torch.flash_attn_with_kvcache`` captured in a CUDA
  graph, as a serving loop runs it;
* ``call``: the same public call, eager (what a Python loop pays, host included).

fa_jax, where jax is installed, on the same arrays (shared through DLPack, no copy):
``fa_jax.attention_with_kvcache`` jitted, timed as a Python loop of calls (``jax call``)
and inside one jitted ``fori_loop`` (``jax loop``: no host between steps, as a serving
loop compiled whole runs it), with bench.py's timers.

Layouts: the contiguous cache, and paged caches (pages in random order over the same
memory) of the given page sizes. Peer where present: torch SDPA on the contiguous cache
(``enable_gqa``); flash-attn's CUDA kernels and FlashInfer are not on the lent machine.

    python benchmarks/decode.py [--batch 1,8,64] [--seqlen 4096,32768,131072]
                                [--heads 32/8,32/32] [--pages 0,256,16] [--max-gb 40]
                                [--out benchmarks]        # decode.md, decode.png
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fa_torch  # noqa: E402
from bench import bench_jax, bench_jitted_loop  # noqa: E402
from fa_kernels import configs  # noqa: E402
from fa_kernels import plan as fa_plan  # noqa: E402
from fa_torch import _launch  # noqa: E402
from fa_torch.ops import problem_of  # noqa: E402


def graph_time(fn, replays=20, rounds=7) -> float:
    """Median seconds of one ``fn()`` replayed from a CUDA graph (``replays`` copies of
    it captured back to back, so a replay's launch cost is shared)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    return _median_time(graph.replay, rounds) / replays


def eager_time(fn, calls=20, rounds=7) -> float:
    for _ in range(3):
        fn()
    return _median_time(lambda: [fn() for _ in range(calls)], rounds) / calls


def _median_time(run, rounds) -> float:
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_step(q, k, v, seqused_k, block_table, num_splits=None):
    """The plan's launches alone, into preallocated outputs: () -> None. ``num_splits``
    forces a split count (None: the plan's)."""
    problem = problem_of(q, k, v, seqused_k=seqused_k, block_table=block_table)
    fwd = fa_plan.forward_plan(problem, capability=_launch.capability(q.device),
                               q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(),
                               num_sms=_launch.num_sms(q.device), num_splits=num_splits)
    arrays = {"q": q, "k": k, "v": v, "seqused_k": seqused_k, "block_table": block_table}
    outputs = {o.name: torch.empty(o.shape, dtype=_launch.TORCH_DTYPES[o.dtype], device=q.device)
               for launch in fwd.launches for o in launch.outputs}
    arrays.update(outputs)

    def step(launches=fwd.launches):
        for launch in launches:
            _launch.launch_into(launch, arrays, {o.name: outputs[o.name] for o in launch.outputs},
                                q.device)
    step.forward_only = lambda: step(fwd.launches[:1])
    return step, fwd.num_splits


def decode_inputs(batch, seqlen, heads_q, heads_k, page_size, head_dim, dtype):
    """q, full caches, their lengths and (paged) the block table: with ``page_size`` the
    caches are the same memory viewed as pages, in random order."""
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    shape = (batch, seqlen, heads_k, head_dim)
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(batch, 1, heads_q, head_dim, generator=gen, device=device, dtype=dtype)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    table = None
    if page_size:
        pages = batch * seqlen // page_size
        k, v = (c.view(pages, page_size, heads_k, head_dim) for c in (k, v))
        table = torch.randperm(pages, generator=gen, device=device).view(batch, -1).int()
    return q, k, v, seqlens, table


def sweep(batch, seqlen, heads_q, heads_k, page_size, splits, tiles, head_dim=128,
          dtype=torch.bfloat16):
    """Kernel time (us) for each forced split count and few-rows tile (block_n, warps,
    stages): what the plan's choices could be."""
    q, k, v, seqlens, table = decode_inputs(batch, seqlen, heads_q, heads_k, page_size,
                                            head_dim, dtype)
    moved = 2 * k.numel() * k.element_size()
    key = ("forward", 128)
    saved = configs._GPU_16BIT_FEW_ROWS.get(key)
    for tile in tiles:
        if tile:
            configs._GPU_16BIT_FEW_ROWS[key] = configs.TileConfig(configs.FEW_ROWS, *tile)
        fa_plan.forward_plan.cache_clear()
        cells = []
        for s in splits:
            step, used = kernel_step(q, k, v, seqlens, table, s or None)
            t, forward = graph_time(step), graph_time(step.forward_only)
            cells.append(f"{used}:{t * 1e6:.1f}us/{moved / t / 1e12:.2f}TB/s"
                         f"(fwd {forward * 1e6:.1f})")
        print(f"B={batch} Sk={seqlen} H={heads_q}/{heads_k} page={page_size} tile={tile or 'table'}: "
              + "  ".join(cells), flush=True)
    if saved is not None:
        configs._GPU_16BIT_FEW_ROWS[key] = saved
    fa_plan.forward_plan.cache_clear()


def measure(batch, seqlen, heads_q, heads_k, page_size, head_dim=128, dtype=torch.bfloat16):
    device = torch.device("cuda")
    item = torch.finfo(dtype).bits // 8
    moved = (2 * batch * seqlen * heads_k + 2 * batch * heads_q) * head_dim * item
    src = torch.empty(min(moved, 8 << 30) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_bandwidth = 2 * 4 * src.numel() / graph_time(lambda: dst.copy_(src))
    del src, dst
    q, k, v, seqlens, table = decode_inputs(batch, seqlen, heads_q, heads_k, page_size,
                                            head_dim, dtype)
    step, splits = kernel_step(q, k, v, seqlens, table)
    kernel = graph_time(step)

    def call():
        return fa_torch.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
    graph, eager = graph_time(call), eager_time(call)
    sdpa = peer = None
    if not page_size:
        def peer():
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), enable_gqa=True)
        try:
            sdpa = graph_time(peer)
        except RuntimeError as error:  # (a backend may refuse the shape)
            print(f"  sdpa: {str(error)[:120]}", file=sys.stderr)
    jax_call, jax_loop = jax_times(q, k, v, seqlens, table)
    del k, v, step, call, peer
    torch.cuda.empty_cache()
    bandwidth = lambda t: moved / t  # noqa: E731
    return dict(batch=batch, seqlen=seqlen, heads=f"{heads_q}/{heads_k}", page=page_size,
                splits=splits, gb=moved / 1e9, copy=copy_bandwidth, kernel=kernel, graph=graph,
                call=eager, sdpa=sdpa, jax_call=jax_call, jax_loop=jax_loop,
                fraction=bandwidth(kernel) / copy_bandwidth,
                graph_over_kernel=graph / kernel)


def jax_times(q, k, v, seqlens, table):
    """fa_jax's decode step on the same arrays, in seconds: (a Python loop of jitted calls,
    a call inside one jitted loop); (None, None) without jax."""
    try:
        import jax

        import fa_jax
    except ImportError:
        return None, None
    jq, jk, jv, jseqlens = (jax.dlpack.from_dlpack(x) for x in (q, k, v, seqlens))
    jtable = None if table is None else jax.dlpack.from_dlpack(table)

    def decode(q, k_cache, v_cache, seqlens, table):
        return fa_jax.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             block_table=table)[0]
    step = jax.jit(decode)
    call = bench_jax(step, (jq, jk, jv, jseqlens, jtable)) / 1e3
    loop = bench_jitted_loop(lambda q, k, v, seqlens: decode(q, k, v, seqlens, jtable),
                             (jq, jk, jv, jseqlens), iters=50) / 1e3
    return call, loop


def render(rows) -> str:
    device = torch.cuda.get_device_name()
    lines = [f"Decode, bf16, D = 128, one query token, full caches; {device}, "
             f"{datetime.date.today()}; torch {torch.__version__}.",
             "",
             "| B | Sk | Hq/Hk | page | splits | GB moved | copy TB/s | kernel us | kernel TB/s "
             "| of copy | graph us | graph/kernel | call us | SDPA us | fa_jax call us "
             "| fa_jax loop us |",
             "|" + "---|" * 16]
    us = lambda t: f"{t * 1e6:.1f}" if t else "-"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['seqlen']} | {r['heads']} | {r['page'] or 'contiguous'} "
            f"| {r['splits']} | {r['gb']:.3f} | {r['copy'] / 1e12:.2f} | {r['kernel'] * 1e6:.1f} "
            f"| {r['gb'] * 1e9 / r['kernel'] / 1e12:.2f} | {r['fraction']:.0%} "
            f"| {r['graph'] * 1e6:.1f} | {r['graph_over_kernel']:.2f} | {r['call'] * 1e6:.1f} "
            f"| {us(r['sdpa'])} | {us(r['jax_call'])} | {us(r['jax_loop'])} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        series.setdefault((r["batch"], r["heads"], r["page"]), []).append(r)
    for (batch, heads, page), rs in sorted(series.items()):
        ax.plot([r["seqlen"] for r in rs], [r["fraction"] for r in rs], marker="o",
                label=f"B={batch} H={heads} {'page ' + str(page) if page else 'contiguous'}")
    ax.axhline(0.8, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens Sk")
    ax.set_ylabel("kernel bandwidth / copy bandwidth")
    ax.set_title("fa_torch decode (bf16, D=128)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--batch", type=ints, default=[1, 8, 64])
    parser.add_argument("--seqlen", type=ints, default=[4096, 32768, 131072])
    parser.add_argument("--heads", default="32/8,32/32")
    parser.add_argument("--pages", type=ints, default=[0, 256, 16])
    parser.add_argument("--max-gb", type=float, default=40.0, help="skip larger K/V")
    parser.add_argument("--out", default=None)
    parser.add_argument("--splits", type=ints, default=None,
                        help="instead: kernel times at these split counts (0: the plan's)")
    parser.add_argument("--tiles", default="",
                        help="with --splits: few-rows tiles block_n/warps/stages, comma-separated "
                             "('-': the table's)")
    args = parser.parse_args()
    if args.splits:
        tiles = [tuple(map(int, t.split("/"))) if t != "-" else None
                 for t in (args.tiles or "-").split(",")]
        for heads in args.heads.split(","):
            heads_q, heads_k = map(int, heads.split("/"))
            for batch in args.batch:
                for page in args.pages:
                    for seqlen in args.seqlen:
                        sweep(batch, seqlen, heads_q, heads_k, page, args.splits, tiles)
        return
    rows = []
    for heads in args.heads.split(","):
        heads_q, heads_k = map(int, heads.split("/"))
        for batch in args.batch:
            for page in args.pages:
                for seqlen in args.seqlen:
                    if 4 * batch * seqlen * heads_k * 128 / 1e9 > args.max_gb:
                        continue
                    row = measure(batch, seqlen, heads_q, heads_k, page)
                    rows.append(row)
                    print(render([row]).splitlines()[-1], file=sys.stderr, flush=True)
    text = render(rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.md"), "w") as f:
            f.write(text)
        plot(rows, os.path.join(args.out, "decode.png"))
    print(text)


if __name__ == "__main__":
    main()
