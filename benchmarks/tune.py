"""Pick block sizes, warps and stages for ``kernels/fa_kernels/configs.py`` on the GPU.

For each (kernel, head dim) it times every candidate config of that one kernel
(forward, backward dK/dV, backward dQ) on a representative problem, causal and not,
through the plan and fa_torch's launcher (`triton.testing.do_bench`, median), and keeps
only candidates whose outputs match the current table's (a config that is fast and
wrong is dropped; the full test suite checks the final table against float64).
Candidates are compiled first in a pool of processes (Triton's disk cache then serves
the timing process), so a sweep of a few hundred configs fits in minutes.

    python benchmarks/tune.py [--head-dims 64,128,256] [--dtype bfloat16]
                              [--kernels forward,dkdv,dq] [--seqlen 4096] [--workers 16]
                              [--out DIR] [--tma-only]

``--seqlen`` below 4096 tunes the short-sequence entries (``_GPU_16BIT_SHORT``: keyed
by the seqlen bucket they serve up to) instead of the main table. ``--decode [--write]``
tunes the forward for query tiles of at most 16 rows on decode shapes (Sq = 1, packed GQA
and not, split-KV) and can write the winner into ``configs.py`` itself.

Prints, per kernel and head dim, the winner beside the current entry, and the table
lines to paste into ``configs.py`` (a ``causal`` line for ``_GPU_16BIT_CAUSAL`` where the
causal times alone pick another config, faster by more than 3 %); writes all timings to
``DIR/tune.json``. ``--tma-only`` times only the candidates that read through tensor
descriptors, and the entry serving now.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_kernels  # noqa: E402,F401
import torch  # noqa: E402

from fa_kernels import configs, plan  # noqa: E402
from fa_torch import _launch  # noqa: E402

KERNELS = ("forward", "dkdv", "dq")
CHECKED = {"forward": ("out", "lse"), "dkdv": ("dk", "dv"), "dq": ("dq",)}


def fits(kernel: str, cfg, head_dim: int, dtype: str, capability) -> bool:
    """The config's tiles fit the GPU's shared memory: the table's fitting
    (configs.tile_config) leaves it as it is, so the config timed is the config kept."""
    return (configs.shared_memory(kernel, cfg, head_dim, configs.ITEMSIZE[dtype])
            <= configs.shared_memory_limit(capability))


def candidates(kernel: str, head_dim: int, dtype: str, capability):
    if kernel == "forward":
        blocks_m, blocks_n = (64, 128), (32, 64, 128)
    elif kernel == "dkdv":  # block_m: queries streamed, block_n: keys held
        blocks_m, blocks_n = (16, 32, 64), ((32, 64, 128) if head_dim >= 256 else (64, 128))
    else:  # dq: block_m queries held, block_n keys streamed
        blocks_m, blocks_n = (64, 128), (16, 32, 64)
    out = []
    stage_counts = (2, 3, 4) if kernel == "forward" else (1, 2, 3)
    for bm, bn, warps, stages in itertools.product(blocks_m, blocks_n, (4, 8), stage_counts):
        cfg = configs.TileConfig(bm, bn, warps, stages)
        if (not fits(kernel, cfg, head_dim, dtype, capability)
                or (head_dim >= 256 and bm * bn > 64 * 64 and warps == 4)):
            continue
        out.append(cfg)
        if capability >= (9, 0):  # the streamed blocks through TMA, the held ones too or not
            out.append(configs.TileConfig(bm, bn, warps, stages, tma=True))
            if kernel != "forward":
                out.append(configs.TileConfig(bm, bn, warps, stages, tma=True, hold_tma=False))
    if kernel == "dkdv" and head_dim >= 256:  # dK and dV by programs apart, too
        out += [dataclasses.replace(cfg, apart=True) for cfg in out if cfg.tma and cfg.hold_tma]
    return out


def entry(cfg) -> str:
    """A config as its line in configs.py."""
    extra = (", tma=True" + ("" if cfg.hold_tma else ", hold_tma=False")) if cfg.tma else ""
    extra += ", apart=True" if cfg.apart else ""
    return f"TileConfig({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}{extra})"


LONG = 4096  # the main table's entries are tuned here; shorter --seqlen tunes a short entry


def slot(kernel: str, head_dim: int, dtype: str, seqlen: int) -> tuple[dict, tuple]:
    """The table and key that serve (kernel, head dim) at this seqlen."""
    table, short = configs.tables(dtype)
    if seqlen >= LONG:
        return table, (kernel, head_dim)
    return short, (kernel, head_dim, configs.seqlen_bucket(seqlen))


def causal_slot(kernel: str, head_dim: int, dtype: str, seqlen: int):
    """The causal entry that goes with a main-table slot (None for a short one): a
    candidate is timed in both, so that causal problems run it too."""
    return (configs.causal_table(dtype), (kernel, head_dim)) if seqlen >= LONG else None


def put(where: tuple[dict, tuple], cfg) -> None:
    """Set an entry; None removes it (a short entry that did not exist)."""
    table, key = where
    if cfg is None:
        table.pop(key, None)
    else:
        table[key] = cfg


def problem(head_dim, dtype, causal, seqlen):
    heads = max(1, 2048 // head_dim)
    batch = max(1, 16384 // seqlen)
    return plan.check_problem((batch, seqlen, heads, head_dim), (batch, seqlen, heads, head_dim),
                              (batch, seqlen, heads, head_dim), dtype, dtype, dtype,
                              causal=causal)


def plans(p, capability):
    # The plans are cached, and this script edits the table under them: rebuild.
    plan.forward_plan.cache_clear()
    plan.backward_plan.cache_clear()
    return {"forward": plan.forward_plan(p, capability=capability),
            **{k: getattr(plan.backward_plan(p, capability=capability), k)
               for k in ("preprocess", "dkdv", "dq")}}


def random_arrays(p, names, seed=0, device="cuda"):
    """Random q-shaped (q, dout) and k/v-shaped arrays of the problem's dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tdtype = getattr(torch, p.dtype)
    return {name: torch.randn(p.q_shape if name in ("q", "dout") else p.kv_shape,
                              device=device, dtype=tdtype, generator=gen) for name in names}


def inputs_for(p, capability, seed=0, device="cuda"):
    """Every array the three kernels read, made with the current table."""
    arrays = random_arrays(p, ("q", "k", "v", "dout"), seed, device)
    arrays["dlse"] = torch.zeros(p.lse_shape, device=device, dtype=torch.float32)
    launches = plans(p, capability)
    _launch.run(launches["forward"].launch, arrays, torch.device(device))
    _launch.run(launches["preprocess"], arrays, torch.device(device))
    return arrays


def launch_of(kernel, p, capability):
    launches = plans(p, capability)
    return launches["forward"].launch if kernel == "forward" else launches[kernel]


def _compile(task):
    """Worker: compile one candidate by running it once on a small problem whose
    integer arguments specialise the same way (multiples of 16)."""
    kernel, head_dim, dtype, seqlen, cfg = task
    put(slot(kernel, head_dim, dtype, seqlen), configs.TileConfig(*cfg))
    if causal_slot(kernel, head_dim, dtype, seqlen):
        put(causal_slot(kernel, head_dim, dtype, seqlen), configs.TileConfig(*cfg))
    # Long enough that the pipeline-depth cap leaves every candidate's stages alone, and
    # served by the slot being tuned: a main-table candidate compiled at a short length
    # would compile the short-sequence entry instead, and the timing process would then
    # compile every candidate itself, one after another (it did, for dK/dV at D = 128).
    seq = seqlen if seqlen < LONG else LONG // 2
    shape = (1, seq, 2, head_dim)
    try:
        for causal in (False, True):
            if (configs.table_entry(kernel, head_dim, dtype, seq, seq, causal)
                    != configs.TileConfig(*cfg)):
                raise RuntimeError(f"seqlen {seq} is not served by the slot being tuned")
            p = plan.check_problem(shape, shape, shape, dtype, dtype, dtype, causal=causal)
            capability = torch.cuda.get_device_capability()
            arrays = inputs_for(p, capability)
            _launch.run(launch_of(kernel, p, capability), arrays, torch.device("cuda"))
        torch.cuda.synchronize()
        return task, None
    except Exception as exc:  # noqa: BLE001  (out of shared memory, registers...)
        return task, f"{type(exc).__name__}: {str(exc)[:100]}"


def close(a, b) -> bool:
    a, b = a.float(), b.float()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return False
    scale = b[finite].abs().max().item() if finite.any() else 1.0
    return bool(((a - b)[finite].abs().max().item() if finite.any() else 0.0) <= 2e-2 * scale)


# Decode (few query rows): (batch, seqlen_q, seqlen_k, heads_q, heads_k), packed GQA and not.
DECODE_SHAPES = ((16, 1, 8192, 32, 8), (1, 1, 32768, 32, 32))


def decode_candidates(head_dim: int, dtype: str, capability):
    out = []
    for bn, warps, stages in itertools.product((32, 64, 128, 256), (2, 4, 8), (2, 3, 4)):
        cfg = configs.TileConfig(configs.FEW_ROWS, bn, warps, stages)
        if fits("forward", cfg, head_dim, dtype, capability):
            out.append(cfg)
    return out


def decode_plan(shape, head_dim, dtype, num_sms):
    batch, seqlen_q, seqlen_k, heads_q, heads_k = shape
    p = plan.check_problem((batch, seqlen_q, heads_q, head_dim),
                           (batch, seqlen_k, heads_k, head_dim),
                           (batch, seqlen_k, heads_k, head_dim), dtype, dtype, dtype)
    plan.forward_plan.cache_clear()
    return plan.forward_plan(p, capability=torch.cuda.get_device_capability(), num_sms=num_sms)


def _compile_decode(task):
    """Worker: compile a decode candidate on small problems that specialise the same way
    (packed GQA and not, split-KV on, keys enough for every stage)."""
    head_dim, dtype, cfg = task
    configs._GPU_16BIT_FEW_ROWS[("forward", head_dim)] = configs.TileConfig(*cfg)
    try:
        for shape in ((1, 1, 2048, 8, 2), (1, 1, 2048, 4, 4)):
            fwd = decode_plan(shape, head_dim, dtype, fa_kernels.runtime.multiprocessors(0))
            arrays = random_arrays(fwd.problem, ("q", "k", "v"))
            for launch in fwd.launches:
                _launch.run(launch, arrays, torch.device("cuda"))
        torch.cuda.synchronize()
        return task, None
    except Exception as exc:  # noqa: BLE001
        return task, f"{type(exc).__name__}: {str(exc)[:100]}"


def tune_decode(args):
    """Time every decode candidate on DECODE_SHAPES (forward + combine); print the
    winner per head dim and, with --write, put it in configs.py's few-rows table."""
    import triton.testing

    dtype = args.dtype
    head_dims = [int(d) for d in args.head_dims.split(",")]
    num_sms = fa_kernels.runtime.multiprocessors(0)
    capability = torch.cuda.get_device_capability()
    tasks = [(d, dtype, dataclasses.astuple(c)) for d in head_dims
             for c in decode_candidates(d, dtype, capability)]
    with futures.ProcessPoolExecutor(args.workers,
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = {task for task, error in pool.map(_compile_decode, tasks) if error}
    lines = []
    for head_dim in head_dims:
        table = configs._GPU_16BIT_FEW_ROWS
        current = table.get(("forward", head_dim))

        def time_all():
            ms, outs = [], []
            for shape in DECODE_SHAPES:
                fwd = decode_plan(shape, head_dim, dtype, num_sms)
                arrays = random_arrays(fwd.problem, ("q", "k", "v"))

                def run():
                    results = dict(arrays)
                    for launch in fwd.launches:
                        _launch.run(launch, results, torch.device("cuda"))
                    return results["out"]
                outs.append(run().clone())
                ms.append(triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median"))
            return ms, outs

        table.pop(("forward", head_dim), None)
        base_ms, base_out = time_all()  # the main table's entry, shrunk to the rows
        print(f"decode D={head_dim} main entry: {' / '.join(f'{m:.3f}' for m in base_ms)} ms",
              flush=True)
        best = (sum(base_ms), None, base_ms)
        for cfg in decode_candidates(head_dim, dtype, capability):
            if (head_dim, dtype, dataclasses.astuple(cfg)) in failed:
                continue
            table[("forward", head_dim)] = cfg
            try:
                ms, outs = time_all()
            except Exception as exc:  # noqa: BLE001
                print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            finally:
                table.pop(("forward", head_dim), None)
            ok = all(close(a, b) for a, b in zip(outs, base_out))
            print(f"  {cfg}: {' / '.join(f'{m:.3f}' for m in ms)} ms{'' if ok else ' WRONG'}",
                  file=sys.stderr, flush=True)
            if ok and sum(ms) < best[0]:
                best = (sum(ms), cfg, ms)
        if current is not None:
            table[("forward", head_dim)] = current
        _, cfg, ms = best
        if cfg is None:
            lines.append(f"# decode D={head_dim}: the main entry won")
            continue
        lines.append(f'    ("forward", {head_dim}): {entry(cfg)},  # {" / ".join(f"{m:.3f}" for m in ms)}'
                     f' ms, main entry {" / ".join(f"{m:.3f}" for m in base_ms)}')
        print(lines[-1], flush=True)
    if args.write:
        path = os.path.join(os.path.dirname(configs.__file__), "configs.py")
        text = open(path).read()
        head, rest = text.split("# BEGIN few-rows\n")
        _, tail = rest.split("# END few-rows\n")
        entries = [line for line in lines if not line.startswith("#")]
        block = ("_GPU_16BIT_FEW_ROWS = {\n" + "\n".join(entries) + "\n}\n" if entries
                 else "_GPU_16BIT_FEW_ROWS: dict = {}\n")
        with open(path, "w") as fh:
            fh.write(head + "# BEGIN few-rows\n" + block + "# END few-rows\n" + tail)
        print(f"wrote {len(entries)} entries to {path}", flush=True)
    return lines


def main(argv=None):
    import triton.testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--tma-only", action="store_true",
                        help="time only candidates that read through tensor descriptors "
                             "(and the entry serving now), when only that path changed")
    parser.add_argument("--decode", action="store_true",
                        help="tune the forward for few query rows (decode) instead")
    parser.add_argument("--write", action="store_true",
                        help="with --decode: write the winners into kernels/fa_kernels/configs.py")
    args = parser.parse_args(argv)
    if args.decode:
        return tune_decode(args)
    dtype, kernels = args.dtype, args.kernels.split(",")
    head_dims = [int(d) for d in args.head_dims.split(",")]
    capability = torch.cuda.get_device_capability()

    def chosen(kernel, head_dim):
        found = candidates(kernel, head_dim, dtype, capability)
        if not args.tma_only:
            return found
        serving = configs.table_entry(kernel, head_dim, dtype, args.seqlen, args.seqlen)
        return [c for c in found if c.tma] + ([] if serving.tma else [serving])

    tasks = [(kernel, d, dtype, args.seqlen, dataclasses.astuple(c))
             for d in head_dims for kernel in kernels for c in chosen(kernel, d)]
    start = time.time()
    failed = {}
    with futures.ProcessPoolExecutor(args.workers,
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
        for task, error in pool.map(_compile, tasks):
            if error:
                failed[task] = error
    print(f"compiled {len(tasks)} candidates in {time.time() - start:.0f} s "
          f"({len(failed)} rejected by the compiler)", flush=True)

    results, lines = [], []
    for head_dim in head_dims:
        problems = {c: problem(head_dim, dtype, c, args.seqlen) for c in (False, True)}
        arrays = {c: inputs_for(p, capability) for c, p in problems.items()}
        for kernel in kernels:
            where = slot(kernel, head_dim, dtype, args.seqlen)
            current = where[0].get(where[1])  # None: no short entry yet
            serving = configs.table_entry(kernel, head_dim, dtype, args.seqlen, args.seqlen)
            causal_where = causal_slot(kernel, head_dim, dtype, args.seqlen)
            causal_now = causal_where[0].get(causal_where[1]) if causal_where else None
            baseline = {}
            for c, p in problems.items():
                out = _launch.run(launch_of(kernel, p, capability), dict(arrays[c]),
                                  torch.device("cuda"))
                baseline[c] = {n: out[n].clone() for n in CHECKED[kernel]}
            timed = []
            for cfg in chosen(kernel, head_dim):
                key = (kernel, head_dim, dtype, args.seqlen, dataclasses.astuple(cfg))
                if key in failed:
                    continue
                put(where, cfg)
                if causal_where:
                    put(causal_where, cfg)
                try:
                    ms, ok = {}, True
                    for c, p in problems.items():
                        launch = launch_of(kernel, p, capability)
                        out = _launch.run(launch, dict(arrays[c]), torch.device("cuda"))
                        ok = ok and all(close(out[n], baseline[c][n]) for n in CHECKED[kernel])
                        ms[c] = triton.testing.do_bench(
                            lambda: _launch.run(launch, dict(arrays[c]), torch.device("cuda")),
                            warmup=10, rep=80, return_mode="median")
                except Exception as exc:  # noqa: BLE001
                    print(f"  {kernel} D={head_dim} {cfg}: {type(exc).__name__}", file=sys.stderr)
                    continue
                finally:
                    put(where, current)
                    if causal_where:
                        put(causal_where, causal_now)
                timed.append((ms[False] + ms[True], cfg, ms, ok))
                results.append(dict(kernel=kernel, head_dim=head_dim, dtype=dtype,
                                    seqlen=args.seqlen, config=list(key[4]), ms=ms[False],
                                    ms_causal=ms[True], ok=ok))
                # As it goes: a run cut by a time limit, or stuck in one candidate, still
                # tells what it measured and where it stopped.
                print(f"  {kernel} D={head_dim} {entry(cfg)}: {ms[False]:.3f} / {ms[True]:.3f} ms"
                      + ("" if ok else " WRONG"), file=sys.stderr, flush=True)
            save(args.out, results, failed)  # (and the JSON after each kernel and head dim)
            good = sorted((t for t in timed if t[3]), key=lambda t: t[0])
            now = next((t for t in timed if t[1] == serving), None)
            if not good:
                lines.append(f"# {kernel} D={head_dim}: no candidate passed")
                continue
            total, best, ms, _ = good[0]
            line = f'{where[1]!r}: {entry(best)},'.replace("'", '"')
            note = (f"{ms[False]:.3f} / {ms[True]:.3f} ms (causal)"
                    + (f"; table now {serving}: {now[2][False]:.3f} / {now[2][True]:.3f} ms"
                       if now else ""))
            lines.append(f"{line}  # {note}")
            print(lines[-1], flush=True)
            # A causal entry where the causal times alone pick another config, faster by
            # more than the noise between runs.
            causal_best = min(good, key=lambda t: t[2][True])
            if causal_where and causal_best[2][True] < 0.97 * ms[True]:
                lines.append(f"causal {where[1]!r}: {entry(causal_best[1])},".replace("'", '"')
                             + f"  # {causal_best[2][True]:.3f} ms against {ms[True]:.3f}")
                print(lines[-1], flush=True)
    print("\n".join(lines), flush=True)
    return lines


def save(out: str, results: list, failed: dict) -> None:
    """Every timing so far, and the candidates the compiler rejected, to OUT/tune.json."""
    with open(os.path.join(out, "tune.json"), "w") as fh:
        json.dump(dict(results=results, failed=[list(map(str, k)) + [v] for k, v in failed.items()]),
                  fh, indent=1)


if __name__ == "__main__":
    main()
