"""Compile plan launches for a GPU on a machine without one.

The interpreter runs the kernels' arithmetic but not Triton's compiler: an error of the
compiled path only (types that differ between constexpr branches, a pass that rejects a
kernel, shared memory past the device's limit) would first show on the GPU. Triton's
compiler and its bundled ptxas need no GPU, so this compiles a grid of forward and
backward variants for a given capability, specialising the arguments as Triton's JIT
would (16-byte aligned arrays, integers by value), and reports each kernel's shared
memory against the limit, its registers a thread and its stack frame (bytes a thread of
local memory: spilled registers), as ``cuobjdump`` reads them from the cubin.

    TRITON_INTERPRET=0 python -m fa_kernels.offline [--capability 9.0] [--quick]
    TRITON_INTERPRET=0 python -m fa_kernels.offline --compare-launchers [--quick]

``--compare-launchers`` compiles the launches fa_jax makes on the GPU (tensor
descriptors made on the host, none made on the device) twice, with the argument attributes of Triton's JIT (fa_torch) and of
jax_triton (fa_jax), and compares the PTX: the same code gives the same bits. With a
bias the code may differ (Triton's JIT also knows the bias strides' divisibility); the
instruction counts still match.

TRITON_INTERPRET=0 keeps the kernels compilable (the interpreter replaces them).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from . import configs, runtime
from . import plan as fa_plan

POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32"}


def input_dtypes(problem: fa_plan.AttentionProblem, plans) -> dict:
    """The dtype of every array a plan's launches read: the problem's, its options', and
    what earlier launches write. An input the problem does not use is the front ends'
    fp32 placeholder."""
    dtypes = {name: problem.dtype for name in ("q", "k", "v", "dout", "out")}
    dtypes.update(slopes="float32", seed="int32", dlse="float32")
    if problem.bias_shape is not None:
        dtypes["bias"] = problem.dtype
    if problem.varlen:
        dtypes.update(cu_seqlens_q="int32", cu_seqlens_k="int32")
    if problem.seqused_k:
        dtypes["seqused_k"] = "int32"
    if problem.paged:
        dtypes["block_table"] = "int32"
    for launch in (launch for p in plans for launch in p.launches):
        dtypes.update((o.name, o.dtype) for o in launch.outputs)
    return dtypes


def _descriptor_type(launch, dtype: str, block_shape) -> str:
    """The signature type of a host descriptor over a ``dtype`` array: for a Gluon kernel
    with the shared-memory layout the launcher gives it (launcher._gluon_descriptor)."""
    from .registry import GLUON_KERNELS

    block = f"{POINTER_TYPES[dtype][1:]}[{','.join(map(str, block_shape))}]"
    if launch.kernel not in GLUON_KERNELS:
        return f"tensordesc<{block}>"
    from .gluon_forward import shared_layout

    return f"tensordesc<{block},{shared_layout(tuple(block_shape), dtype)!r}>"


def specialise(launch, dtypes: dict, launcher: str = "jit"):
    """(signature, constexprs, attrs) of ``launch`` as ``launcher`` makes them: "jit",
    Triton's JIT (fa_torch: every integer divisible by 16 marked so), or "jax_triton"
    (fa_jax: only the arrays marked; any scalar equal to 1, a float too, folded in)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from .registry import KERNELS, scalar_arguments

    kernel = KERNELS[launch.kernel]
    arrays = [dtypes.get(name, "float32") for name in launch.inputs]
    arrays_out = [o.dtype for o in launch.outputs]
    scalars = scalar_arguments(launch)
    blocks = [("descriptor", _descriptor_type(launch, dtypes[b.array], b.block_shape))
              if b.host_descriptor else ("array", dtypes.get(b.array, "float32"))
              for b in launch.blocks]
    values = ([("array", d) for d in arrays] + blocks + [("scalar", s) for s in scalars]
              + [("array", d) for d in arrays_out])
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for index, name in enumerate(kernel.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        kind, value = values[index]
        if kind == "descriptor":
            signature[name], spec = value, ""
        elif kind == "array":
            signature[name], spec = POINTER_TYPES[value], "D"
        elif launcher == "jax_triton":
            if value == 1:
                constexprs[name] = 1
                continue
            signature[name] = "fp32" if isinstance(value, float) else native_specialize_impl(
                BaseBackend, value, False, True, True)[0]
            spec = ""
        else:
            specialised = not kernel.params[index].do_not_specialize
            signature[name], spec = native_specialize_impl(BaseBackend, value, False, specialised,
                                                           True)
            if signature[name] == "constexpr":  # Triton folds an integer 1 into the kernel
                constexprs[name] = spec
                continue
        if spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return kernel, signature, constexprs, attrs


def compile_launch(launch, dtypes: dict, capability: tuple[int, int] = (9, 0),
                   launcher: str = "jit"):
    """Triton's CompiledKernel of ``launch`` for ``capability`` (no GPU needed), with the
    argument attributes ``launcher`` gives (``specialise``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .registry import GLUON_KERNELS

    kernel, signature, constexprs, attrs = specialise(launch, dtypes, launcher)
    if launch.kernel in GLUON_KERNELS:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    if launch.maxnreg is not None:
        options["maxnreg"] = launch.maxnreg
    return triton.compile(source, target=target, options=options)


def _cuobjdump(compiled, *options: str) -> str:
    """What the cuobjdump bundled with Triton prints of the kernel's cubin ("" where it
    cannot run)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        try:
            return subprocess.run([tool, *options, cubin.name], capture_output=True,
                                  text=True, timeout=120).stdout
        except OSError:
            return ""


def resources(compiled) -> tuple[int, int] | None:
    """(registers a thread, stack bytes a thread) of a compiled kernel, from the cubin;
    None where it cannot be read."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(compiled, "--dump-resource-usage"))
    return (int(found.group(1)), int(found.group(2))) if found else None


def ptxas_report(compiled, capability: tuple[int, int]) -> str:
    """What the ptxas Triton itself uses for this GPU says of the kernel's PTX with -v
    (Triton 3.9 assembles sm_90 with its newer `ptxas-blackwell`); "" where it cannot run."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(capability[0] * 10 + capability[1]).path
    arch = f"sm_{capability[0]}{capability[1]}{'a' if capability >= (9, 0) else ''}"
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as file:
            file.write(compiled.asm["ptx"])
        try:
            return subprocess.run([tool, "-v", f"--gpu-name={arch}", ptx, "-o",
                                   os.path.join(folder, "kernel.cubin")],
                                  capture_output=True, text=True, timeout=300).stderr
        except OSError:
            return ""


def spills(compiled, capability: tuple[int, int]) -> tuple[int, int] | None:
    """(spill store bytes, spill load bytes) of the kernel, as ptxas reports them."""
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                      ptxas_report(compiled, capability))
    return (int(found.group(1)), int(found.group(2))) if found else None


def wgmma_serialized(compiled, capability: tuple[int, int]) -> bool:
    """Whether ptxas waits for each wgmma as it is issued (its C7514/C7515 "Potential
    Performance Loss: wgmma.mma_async instructions are serialized"): what a kernel built
    to overlap its matmuls with other work must not get."""
    return "wgmma.mma_async instructions are serialized" in ptxas_report(compiled, capability)


def exp2s_beside_pv(compiled) -> int:
    """How many MUFU.EX2 the SASS places while the main loop's first ``p·v`` (the first
    wgmma reading its A operand from registers) runs: between its issue and the wait
    for it. A kernel that overlaps the softmax with that matmul has many; ptxas moving
    the wait up leaves none."""
    lines = [line.split(";")[0] for line in _cuobjdump(compiled, "-sass").splitlines()
             if "/*" in line]
    issued = next((k for k, line in enumerate(lines)
                   if "HGMMA" in line and "gdesc" not in line.split(",")[1]), None)
    if issued is None:
        return 0
    count = 0
    for line in lines[issued:]:
        if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            return count
        count += "MUFU.EX2" in line
    return count


def resource_table(capability: tuple[int, int], out=sys.stdout) -> None:
    """One line per main kernel (bf16, D 64/128/256, causal or not, the plan's table as
    fa_torch launches it): shared memory, registers, stack and spills, to compare Triton
    releases with each other."""
    import triton

    print(f"triton {triton.__version__}, sm_{capability[0]}{capability[1]}", file=out)
    print("| problem | kernel | tile (m, n, warps, stages) | tma | shared KB | regs | stack B "
          "| spill st/ld B |", file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            shape = (4, 4096, 16, head_dim)
            problem = fa_plan.check_problem(shape, shape, shape, "bfloat16", "bfloat16",
                                            "bfloat16", causal=causal)
            fwd = fa_plan.forward_plan(problem, capability=capability, num_sms=132)
            bwd = fa_plan.backward_plan(problem, capability=capability)
            dtypes = input_dtypes(problem, (fwd, bwd))
            for launch in (*fwd.launches, *bwd.launches):
                if launch.kernel == "attention_backward_preprocess":
                    continue
                compiled = compile_launch(launch, dtypes, capability)
                regs, stack = resources(compiled) or ("?", "?")
                spill = spills(compiled, capability)
                c = launch.constexprs
                tile = (c.get("BLOCK_M"), c.get("BLOCK_N"), launch.num_warps, launch.num_stages)
                print(f"| D={head_dim}{' causal' if causal else ''} | {launch.kernel} | {tile} "
                      f"| {int(bool(c.get('USE_TMA')))} | {compiled.metadata.shared / 1024:.0f} "
                      f"| {regs} | {stack} | {'%d / %d' % spill if spill else '?'} |",
                      file=out, flush=True)


def variants(quick: bool, capability: tuple[int, int] = (9, 0)):
    """(name, problem, forward plan options) over head dims, dtypes and features."""
    head_dims = (64, 128) if quick else (32, 64, 96, 128, 256)
    if quick and capability < (9, 0):  # no descriptors below sm_90: the D = 128 kinds say it
        head_dims = (128,)
    dtypes = ("bfloat16",) if quick else ("bfloat16", "float16", "float32")
    for dtype in dtypes:
        for head_dim in head_dims:
            # S = 4096 takes the table's main entries, S = 1024 its short-sequence ones.
            shape, short = (2, 4096, 4, head_dim), (2, 1024, 4, head_dim)
            gqa_kv = (2, 4096, 2, head_dim)
            check = lambda q, kv, **o: fa_plan.check_problem(  # noqa: E731
                q, kv, kv, dtype, dtype, dtype, **o)
            yield f"{dtype} D={head_dim}", check(shape, shape), {}
            yield f"{dtype} D={head_dim} S=1024", check(short, short), {}
            yield f"{dtype} D={head_dim} causal gqa", check(shape, gqa_kv, causal=True), {}
            yield (f"{dtype} D={head_dim} every option",
                   check(shape, gqa_kv, causal=True, window_size=(256, -1), softcap=30.0,
                         dropout_p=0.1, bias_shape=(2, 4, 4096, 4096), bias_dtype=dtype,
                         alibi_shape=(4,), alibi_dtype="float32"), {})
            if dtype != "float32":
                yield f"{dtype} D={head_dim} tma", check(shape, shape), dict(tma=True)
                yield (f"{dtype} D={head_dim} warp specialized", check(shape, shape),
                       dict(tma=True, warp_specialize=True))
                yield (f"{dtype} D={head_dim} warp specialized causal gqa",
                       check(shape, gqa_kv, causal=True), dict(tma=True, warp_specialize=True))
                yield f"{dtype} D={head_dim} gluon", check(shape, shape), dict(gluon=True)
                yield (f"{dtype} D={head_dim} gluon causal gqa window",
                       check(shape, gqa_kv, causal=True, window_size=(256, -1)),
                       dict(gluon=True))
                if head_dim in (64, 128, 256):  # its warpgroups in turns
                    yield (f"{dtype} D={head_dim} gluon ping-pong causal gqa",
                           check(shape, gqa_kv, causal=True),
                           dict(gluon=True, entries={("forward_gluon", head_dim, dtype): replace(
                               configs.table_entry("forward_gluon", head_dim, dtype, 4096, 4096),
                               ping_pong=True)}))
                if head_dim == 128:  # 64-row tiles, two programs an SM (plan.gluon_programs_per_sm)
                    yield (f"{dtype} D={head_dim} gluon two programs an SM", check(shape, shape),
                           dict(gluon=True, entries={("forward_gluon", head_dim, dtype):
                                                     configs.TileConfig(64, 64, 4, 2, tma=True)}))
                yield (f"{dtype} D={head_dim} dk dv apart",
                       check(shape, gqa_kv, causal=True, softcap=30.0, dropout_p=0.1),
                       dict(apart=True))
                yield (f"{dtype} D={head_dim} decode packed split",
                       check((2, 1, 8, head_dim), (2, 8192, 2, head_dim)),
                       dict(num_splits=4))
    yield ("bfloat16 D=128 varlen",
           fa_plan.check_problem((300, 4, 128), (300, 4, 128), (300, 4, 128), "bfloat16",
                                 "bfloat16", "bfloat16", causal=True,
                                 varlen=dict(cu_seqlens_q_shape=(4,), cu_seqlens_k_shape=(4,),
                                             cu_seqlens_q_dtype="int32",
                                             cu_seqlens_k_dtype="int32",
                                             max_seqlen_q=200, max_seqlen_k=200)), {})
    yield ("bfloat16 D=128 seqused_k causal gqa tma",
           fa_plan.check_problem((2, 4096, 4, 128), (2, 4096, 2, 128), (2, 4096, 2, 128),
                                 "bfloat16", "bfloat16", "bfloat16", causal=True,
                                 seqused_k_shape=(2,), seqused_k_dtype="int32"),
           dict(tma=capability >= (9, 0)))
    yield ("bfloat16 D=128 paged decode packed split",
           fa_plan.check_problem((4, 1, 32, 128), (64, 16, 8, 128), (64, 16, 8, 128),
                                 "bfloat16", "bfloat16", "bfloat16", seqused_k_shape=(4,),
                                 seqused_k_dtype="int32", block_table_shape=(4, 16),
                                 block_table_dtype="int32"),
           dict(num_splits=4))
    if capability < (9, 0):
        return
    # Short sequences take the tile shrunk to them and, at 1, Triton folds the length
    # into the kernel as a constant: every such kind at D = 256 on Hopper, where the
    # entries read through descriptors (ptxas once crashed on the causal forward with
    # seqlen_k = 1 there), with and without every option.
    for seqlen_q, seqlen_k in ((239, 1), (1, 239), (64, 1), (1, 1), (17, 33)):
        for causal in (False, True):
            q, kv = (8, seqlen_q, 4, 256), (8, seqlen_k, 2, 256)
            yield (f"bfloat16 D=256 {seqlen_q}x{seqlen_k}{' causal' if causal else ''}",
                   fa_plan.check_problem(q, kv, kv, "bfloat16", "bfloat16", "bfloat16",
                                         causal=causal), dict(num_sms=132))
    q, kv = (8, 239, 4, 256), (8, 1, 2, 256)
    yield ("bfloat16 D=256 239x1 every option",
           fa_plan.check_problem(q, kv, kv, "bfloat16", "bfloat16", "bfloat16", causal=True,
                                 softcap=30.0, dropout_p=0.1, bias_shape=(8, 4, 239, 1),
                                 bias_dtype="bfloat16", alibi_shape=(4,),
                                 alibi_dtype="float32"), dict(num_sms=132))


def check(capability: tuple[int, int], quick: bool, out=sys.stdout) -> int:
    """Compile every variant's launches; print one line each; return the failures."""
    limit = configs.shared_memory_limit(capability)
    failures = 0
    for name, problem, options in variants(quick, capability):
        # (the warp-specialised kernels compiled here whether or not they run)
        with fa_plan.warp_specialized_on_gpu(), configs.override(entries=options.get("entries")):
            plans = (fa_plan.forward_plan(problem, capability=capability,
                                          **{k: v for k, v in options.items()
                                             if k not in ("apart", "entries")}),)
            if not problem.paged:
                plans += (fa_plan.backward_plan(
                    problem, capability=capability, bias_grad=problem.bias_shape is not None,
                    **{k: v for k, v in options.items()
                       if k in ("tma", "apart", "warp_specialize")}),)
        dtypes = input_dtypes(problem, plans)
        for launch in (launch for plan in plans for launch in plan.launches):
            start = time.time()
            usage = None
            try:
                compiled = compile_launch(launch, dtypes, capability)
                shared = compiled.metadata.shared
                usage = resources(compiled)
                verdict = "ok" if shared <= limit else f"FAIL: {shared} B of shared memory > {limit}"
                if (launch.kernel.endswith(("_ws", "_gluon"))
                        and "ttg.warp_specialize" not in compiled.asm["ttgir"]):
                    verdict = "FAIL: not warp-specialised"  # (the pass declines silently)
                if launch.kernel.endswith("_gluon") and wgmma_serialized(compiled, capability):
                    verdict = "FAIL: ptxas serialises its wgmma (C7514: no overlap)"
                elif launch.kernel.endswith("_gluon") and not exp2s_beside_pv(compiled):
                    verdict = "FAIL: no exp2 while the p·v runs (the wait moved up)"
            except Exception as error:  # noqa: BLE001  (report every failure, then count)
                shared, verdict = 0, f"FAIL: {type(error).__name__}: {str(error)[:300]}"
            failures += verdict != "ok"
            regs = f"{usage[0]:3d} regs {usage[1]:4d} B stack" if usage else " " * 18
            print(f"{name:40s} {launch.kernel:32s} {shared:7d} B smem  {regs}  "
                  f"{time.time() - start:5.1f} s  {verdict}", file=out, flush=True)
    print(f"{failures} failed", file=out)
    return failures


def ptx_counts(ptx: str) -> dict:
    """The instructions that tell how a kernel moves its tiles and multiplies them."""
    return {"cp.async.bulk.tensor": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
            "cp.async.cg": len(re.findall(r"cp\.async\.cg", ptx)),
            "ld.global": len(re.findall(r"ld\.global", ptx)),
            "ld.global.v4": len(re.findall(r"ld\.global[.\w]*\.v4", ptx)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx))}


def ptx_body(ptx: str) -> str:
    """The kernel's code, its parameters by position (the names carry the kernel's name),
    without the debug information (``.loc`` lines, their labels, the ``.file`` and DWARF
    sections): it names the source's path, which Triton's cache key does not hold, so a
    kernel cached from another checkout comes back with other paths and the same code."""
    code = ptx[ptx.index(".entry"):].split("\n\t.file", 1)[0]
    lines = [line for line in code.splitlines()
             if not re.match(r"\s*(\.loc\s|\$L__tmp\d+:)", line)]
    return re.sub(r"\w+_param_(\d+)", r"param_\1", "\n".join(lines))


def launcher_variants(capability: tuple[int, int]):
    """(name, problem) of the main shapes at D = 128: plain, causal with GQA, split-KV,
    every option."""
    shape, gqa_kv = (2, 4096, 4, 128), (2, 4096, 2, 128)
    dtype = "bfloat16"
    yield "D=128", fa_plan.check_problem(shape, shape, shape, dtype, dtype, dtype)
    yield "D=128 causal gqa", fa_plan.check_problem(shape, gqa_kv, gqa_kv, dtype, dtype, dtype,
                                                    causal=True)
    # A grid too small for the GPU: split-KV, then the combine kernel (num_sms of an H100).
    small, small_kv = (1, 2048, 4, 128), (1, 2048, 2, 128)
    yield "D=128 split-KV", fa_plan.check_problem(small, small_kv, small_kv, dtype, dtype, dtype)
    yield "D=128 every option", fa_plan.check_problem(
        shape, gqa_kv, gqa_kv, dtype, dtype, dtype, causal=True, window_size=(256, -1),
        softcap=30.0, dropout_p=0.1, bias_shape=(2, 4, 4096, 4096), bias_dtype=dtype,
        alibi_shape=(4,), alibi_dtype="float32")


def compare_launchers(capability: tuple[int, int], quick: bool = False, out=sys.stdout) -> int:
    """Compile each launch with the JIT's and jax_triton's attributes; print the PTX
    counts of each and whether the code is the same; return how many differ (every
    option: the bias strides, which only Triton's JIT marks, are allowed to)."""
    differ = 0
    for name, problem in list(launcher_variants(capability))[:3 if quick else None]:
        fwd = fa_plan.forward_plan(problem, capability=capability, device_descriptors=False,
                                   num_sms=132)
        bwd = fa_plan.backward_plan(problem, capability=capability, device_descriptors=False,
                                    bias_grad=problem.bias_shape is not None)
        dtypes = input_dtypes(problem, (fwd, bwd))
        for launch in (*fwd.launches, *bwd.launches):
            ptx = {launcher: compile_launch(launch, dtypes, capability, launcher).asm["ptx"]
                   for launcher in ("jit", "jax_triton")}
            bodies = [ptx_body(ptx[launcher]).splitlines() for launcher in ("jit", "jax_triton")]
            same = bodies[0] == bodies[1]
            differ += not same and problem.bias_shape is None
            counts = {launcher: " ".join(f"{v}" for v in ptx_counts(text).values())
                      for launcher, text in ptx.items()}
            print(f"{name:20s} {launch.kernel:32s} JIT {counts['jit']:16s} "
                  f"jax_triton {counts['jax_triton']:16s} {'same PTX' if same else 'PTX DIFFERS'}",
                  file=out, flush=True)
            if not same:  # the first line that differs, for whoever reads a failed check
                first = next((pair for pair in zip(*bodies) if pair[0] != pair[1]),
                             (f"{len(bodies[0])} lines", f"{len(bodies[1])} lines"))
                print(f"    JIT:        {first[0].strip()}\n    jax_triton: {first[1].strip()}",
                      file=out)
    print(f"counts: {' / '.join(ptx_counts(''))}; {differ} differ", file=out)
    return differ


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", default="9.0", help="major.minor, e.g. 8.0 or 9.0")
    parser.add_argument("--quick", action="store_true", help="fewer head dims and dtypes")
    parser.add_argument("--resources", action="store_true",
                        help="shared memory, registers and spills of the main kernels")
    parser.add_argument("--compare-launchers", action="store_true",
                        help="the JIT's PTX against jax_triton's, launch by launch")
    args = parser.parse_args(argv)
    if runtime.interpreting():
        raise SystemExit("run with TRITON_INTERPRET=0: the interpreter replaces the kernels")
    major, minor = (int(x) for x in args.capability.split("."))
    if args.resources:
        resource_table((major, minor))
        return 0
    if args.compare_launchers:
        return 1 if compare_launchers((major, minor), args.quick) else 0
    return 1 if check((major, minor), args.quick) else 0


if __name__ == "__main__":
    sys.exit(main())
